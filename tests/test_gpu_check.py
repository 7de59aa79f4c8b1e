"""The prepared GPU check (bench/gpu_check.sh) must fit its window and its scripts must run: the stage time caps
sum to <= 8 minutes, and the batch stage of bench/bench_round_captured.py runs end to end in its CPU dry run
(tiny model) and renders its table, so a lent GPU session is not spent on a script error."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_stage_caps_fit_eight_minutes():
    text = (REPO / "bench" / "gpu_check.sh").read_text()
    caps = [int(t) for t in re.findall(r"^step \S+ (\d+) ", text, flags=re.M)]
    caps += [int(t) for t in re.findall(r"^timeout (\d+) pip", text, flags=re.M)]
    assert len(caps) >= 6 and sum(caps) <= 480, caps


def test_batch_stage_dry_run(tmp_path, capsys):
    from bench import bench_round_captured as brc

    assert brc.main(["--stage", "batch", "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "batched generate (cpu)" in out and (tmp_path / "batch_dry.json").exists()
    import json

    rows = json.loads((tmp_path / "batch_dry.json").read_text())["rows"]
    assert rows and all(r["same_tokens"] for r in rows)
    assert {r["k"] for r in rows} >= {1, 4, "vanilla", "threshold", "apd"}  # every strategy that batches


def test_projection_stage_arithmetic(tmp_path, capsys):
    """bench/projection_check.py (gpu_check.sh's measured-vs-projected stage): the projection moved to the measured
    prefix, measured / projected, and the launch costs a measurement implies, on a made-up measurement."""
    from bench import projection_check as pc
    from bench import roundcount as rc

    # the stage's copies of the model's constants are the model's
    assert (pc.H200_MEAS_BW, pc.GRAPH_LAUNCH_US, pc.HOST_READ_US) == (rc.H200_MEAS_BW, rc.GRAPH_LAUNCH_US,
                                                                         rc.HOST_READ_US)
    proj = {"knobs": {"prompt": 64}, "kv_bytes_per_token": 57344, "rows": [
        {"path": "fast", "k": 4, "projection": {}},  # CPU-backend rows are not the GPU's kernel sequence: ignored
        {"path": "fastgpu", "k": 4, "projection": dict(roofline_ms=3.5, launches=500, syncs=1, eager_ms=[6.0, 8.5],
                                                        captured_ms=[4.025, 4.525])}]}
    (tmp_path / "proj.json").write_text(__import__("json").dumps(proj))
    meas = {"device": "cuda", "gpu": "H200", "rows": [dict(k=4, prefix=1024, eager_ms=9.0, captured_ms=5.0),
                                                      dict(k=1, prefix=1024, eager_ms=7.0, captured_ms=4.0)]}
    (tmp_path / "round.json").write_text(__import__("json").dumps(meas))
    assert pc.main(["--out", str(tmp_path), "--projection", str(tmp_path / "proj.json")]) == 0
    rows = __import__("json").loads((tmp_path / "projection_check.json").read_text())
    assert [r["k"] for r in rows] == [4]  # k = 1 has no projection row
    r = rows[0]
    extra = (1024 - 64) * 57344 / 4.3e12 * 1e3
    assert abs(r["roofline_ms"] - (3.5 + extra)) < 1e-12
    # 5.0 ms captured = roofline + 10 us launch + 15 us host read + 500 nodes x u  ->  u = 2.95 - 1e3 * extra / 500
    assert abs(r["implied_us_per_node"] - (1e3 * (5.0 - 3.5 - extra - 0.010 - 0.015) / 500)) < 1e-9
    assert abs(r["captured_over_proj"] - 5.0 / (4.525 + extra)) < 1e-12 and r["captured_from"] == "fastgpu"
    assert "measured vs projected" in capsys.readouterr().out
    # a fastcap row (the captured round as its graph replays it) takes the captured columns: its nodes are its
    # launches less those it counted outside the graph (priced at 7.5 us each)
    proj["rows"].append({"path": "fastcap", "k": 4, "projection": dict(roofline_ms=3.4, launches=204, syncs=1,
                                                                       eager_launches=4, eager_ms=[0, 0],
                                                                       captured_ms=[3.7, 3.9])})
    (tmp_path / "proj.json").write_text(__import__("json").dumps(proj))
    assert pc.main(["--out", str(tmp_path), "--projection", str(tmp_path / "proj.json")]) == 0
    r = __import__("json").loads((tmp_path / "projection_check.json").read_text())[0]
    assert r["captured_from"] == "fastcap" and r["nodes"] == 200 and abs(r["proj_eager_ms"][1] - 8.5 - extra) < 1e-12
    assert abs(r["implied_us_per_node"] - 1e3 * (5.0 - 3.4 - extra - 0.010 - 0.015 - 0.030) / 200) < 1e-9
    assert abs(r["captured_over_proj"] - 5.0 / (3.9 + extra)) < 1e-12


def test_committed_projection_has_every_k():
    """The committed projection the GPU stage compares against covers the round stage's k = 1, 2, 4, 8."""
    import json

    from bench import projection_check as pc

    proj = json.loads(pc.PROJECTION.read_text())
    got = {r["k"] for r in proj["rows"] if r["path"] == "fastgpu"}
    assert got >= {1, 2, 4, 8}, got
    for r in proj["rows"]:
        p = r["projection"]
        assert p["captured_ms"][0] > p["roofline_ms"] > 0 and p["launches"] > 0
