"""Measured vs projected: the GPU's round latency next to the CPU-counted H200 projection (issue 33).

Reads the round stage of bench/bench_round_captured.py ($OUT/round.json: Dream-7B-shaped bf16, k = 1, 2, 4, 8,
window 32, prefix 1024, eager and CUDA-graph-captured ms per round) and the committed projection
(bench/results/real_shapes_dream7b_fit.json: the captured columns against its `fastcap` rows, the captured round
counted as its CUDA graph replays it, where a k has one, else the `fastgpu` rows; the eager columns against the
`fastgpu` rows, the eager round's GPU kernel sequence; counted at Dream-7B width, fitted to 28 layers;
bench/bench_real_shapes.py), moves the projection to the measured prefix (the prefix
K/V is read once per layer: + (prefix - 64) x 57,344 B at 4.3 TB/s), and prints per k: measured, projected (the
range of the launch-cost constants), measured / projected, and the launch costs the measurement implies:

  implied us per graph node = (captured ms - roofline ms - graph launch - host read - eager outside) / graph nodes
  (eager outside: the launches a fastcap row counts outside the graph, at the middle of EAGER_US)
  implied us per eager op   = (eager ms - roofline ms - host read) / launches

so the first GPU run corrects the model's constants (bench/roundcount.py EAGER_US, GRAPH_NODE_US) instead of a guess.
No torch needed. Usage: python bench/projection_check.py [--out DIR] [--dry-run] [--projection JSON]
(bench/gpu_check.sh runs it right after the round stage; --dry-run reads round_dry.json, a tiny CPU model, so only
the code path is exercised).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECTION = REPO / "bench" / "results" / "real_shapes_dream7b_fit.json"
# the projection model's constants (bench/roundcount.py; kept in sync by tests/test_gpu_check.py)
H200_MEAS_BW = 4.3e12
GRAPH_LAUNCH_US = 10.0
HOST_READ_US = 15.0
EAGER_US_MID = 7.5  # the middle of roundcount.EAGER_US (5-10 us)


def compare(round_res: dict, proj: dict) -> list[dict]:
    """One row per k measured on the GPU that the projection has a `fastgpu` row for."""
    by_k = {r["k"]: r for r in proj["rows"] if r["path"] == "fastgpu"}
    cap_k = {r["k"]: r for r in proj["rows"] if r["path"] == "fastcap"}  # the captured round as its graph replays
    kv_per_token = proj.get("kv_bytes_per_token", 28 * 2 * 4 * 128 * 2)
    p0 = proj["knobs"]["prompt"]
    rows = []
    for m in round_res["rows"]:
        p = by_k.get(m["k"])
        if p is None:
            continue
        pj = p["projection"]
        extra = 1e3 * max(0, m["prefix"] - p0) * kv_per_token / H200_MEAS_BW  # the longer prefix's K/V, ms
        roof = pj["roofline_ms"] + extra
        n, syncs = pj["launches"], pj["syncs"]
        host = syncs * HOST_READ_US / 1e3
        row = dict(k=m["k"], prefix=m["prefix"], launches=n, roofline_ms=roof,
                   proj_eager_ms=[x + extra for x in pj["eager_ms"]],
                   proj_captured_ms=[x + extra for x in pj["captured_ms"]],
                   eager_ms=m.get("eager_ms"), captured_ms=m.get("captured_ms"))
        if row["eager_ms"] is not None:
            row["eager_over_proj"] = row["eager_ms"] / row["proj_eager_ms"][1]
            row["implied_eager_us_per_op"] = 1e3 * (row["eager_ms"] - roof - host) / n
        if row["captured_ms"] is not None:
            pc = cap_k.get(m["k"], p)["projection"]
            croof = pc["roofline_ms"] + extra
            eager_out = pc.get("eager_launches", 0.0)
            nodes = pc["launches"] - eager_out
            row.update(proj_captured_ms=[x + extra for x in pc["captured_ms"]], nodes=nodes,
                       captured_from=cap_k.get(m["k"], p)["path"])
            row["captured_over_proj"] = row["captured_ms"] / row["proj_captured_ms"][1]
            row["implied_us_per_node"] = 1e3 * (row["captured_ms"] - croof - GRAPH_LAUNCH_US / 1e3 - host
                                                - eager_out * EAGER_US_MID / 1e3) / nodes
        rows.append(row)
    return rows


def table(rows: list[dict], device: str, dry: bool) -> str:
    f = lambda x, w=7, d=2: f"{x:>{w}.{d}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    dry_note = "; DRY RUN: tiny model, numbers meaningless" if dry else ""
    lines = [f"measured vs projected (Dream-7B bf16, {device}{dry_note})",
             f"{'k':>2} {'eager':>7} {'proj eager':>13} {'capt':>7} {'proj capt':>13} {'capt/proj':>9} "
             f"{'roof':>6} {'nodes':>5} {'us/node':>7} {'us/op':>6}"]
    for r in rows:
        pe, pc = r["proj_eager_ms"], r["proj_captured_ms"]
        lines.append(f"{r['k']:>2} {f(r['eager_ms'])} {pe[0]:>6.2f}-{pe[1]:<6.2f} {f(r['captured_ms'])} "
                     f"{pc[0]:>6.2f}-{pc[1]:<6.2f} {f(r.get('captured_over_proj'), 9)} {r['roofline_ms']:>6.2f} "
                     f"{r.get('nodes', r['launches']):>5.0f} {f(r.get('implied_us_per_node'), 7)} "
                     f"{f(r.get('implied_eager_us_per_op'), 6)}")
    if not rows:
        lines.append("(no k in common between the round stage and the projection)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--projection", default=str(PROJECTION))
    a = ap.parse_args(argv)
    out = Path(a.out)
    src = out / f"round{'_dry' if a.dry_run else ''}.json"
    if not src.exists():
        print(f"projection_check: {src} missing (run bench/bench_round_captured.py --stage round first)")
        return 1
    round_res = json.loads(src.read_text())
    proj = json.loads(Path(a.projection).read_text())
    rows = compare(round_res, proj)
    (out / f"projection_check{'_dry' if a.dry_run else ''}.json").write_text(json.dumps(rows, indent=1))
    print(table(rows, round_res.get("gpu") or round_res.get("device", "?"), a.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
