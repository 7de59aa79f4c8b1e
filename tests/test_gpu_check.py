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
