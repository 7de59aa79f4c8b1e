"""The LM head + confidence statistics at Dream-7B's head (hidden 3584, vocabulary 152,064), unfused vs fused:
peak memory above the inputs and time per call, on the CPU (fp32; the torch backends) or a GPU (bf16; every
backend that loads).

    unfused       F.linear(hidden, weight) -> [R, V] logits, then ops.confidence and the finite check (the round
                  without the fused head: ops.first_nonfinite + round.token_stats)
    fused         ops.head_confidence(hidden, weight, mask id, entropy=False): the default / margin strategies
    fused+entropy ops.head_confidence(..., entropy=True): neg_entropy (a second pass over the head)

R = 9 x 32 rows (a LoPA k=8 block-32 round's window rows) and 33 (a D2F block-32 round + the last_logit row).

    python bench/bench_head_confidence.py                # writes bench/results/head_confidence.md
    python -m pytest bench/bench_head_confidence.py -m bench  # the same cases as pytest-benchmark items

Each case runs in a fresh subprocess (the CPU peak is ru_maxrss after the call minus ru_maxrss after building the
inputs; on a GPU torch.cuda.max_memory_allocated above the inputs), one weight at a time (2.2 GB in fp32).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

RUNS_ON_CPU = True  # bench/conftest.py: these items run without CUDA
pytestmark = pytest.mark.bench

H, V, MASK = 3584, 152064, 151666
ROWS = {"lopa_k8_block32": 9 * 32, "d2f_block32": 33}
KINDS = ("unfused", "fused", "fused+entropy")
HERE = Path(__file__).resolve().parent


def _call(kind: str, h, w, backend):
    from lopa_fast import ops

    if kind == "unfused":
        logits = F.linear(h, w)
        ok = torch.isfinite(logits).all(-1)
        c = ops.confidence(logits, MASK, check=False, backend=backend)
        return c, ok
    return ops.head_confidence(h, w, MASK, entropy=kind == "fused+entropy", check=False, backend=backend)


def run_case(kind: str, R: int, device: str, backend: str | None, reps: int) -> dict:
    """One case in this process: inputs, one warm-up call, then `reps` timed calls; peak memory of the calls."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.empty(V, H, dtype=dt, device=device).normal_(0.0, 0.02, generator=g)  # in place: no temporary copy
    h = torch.empty(R, H, dtype=dt, device=device).normal_(0.0, 1.0, generator=g)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _call(kind, h, w, backend)  # warm-up (kernels compile; the peak is the same call's)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _call(kind, h, w, backend)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return dict(kind=kind, R=R, device=device, backend=backend or "auto", dtype=str(dt).replace("torch.", ""),
                peak_mb=round(peak / 2**20, 1), ms=round(sorted(times)[len(times) // 2] * 1000, 1),
                threads=torch.get_num_threads())


def run_isolated(kind: str, R: int, device: str, backend: str | None, reps: int) -> dict:
    code = (f"import json, torch, sys; sys.path.insert(0, {str(HERE.parent)!r}); torch.set_num_threads({THREADS}); "
            f"from bench.bench_head_confidence import run_case; "
            f"print(json.dumps(run_case({kind!r}, {R}, {device!r}, {backend!r}, {reps})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


THREADS = int(os.environ.get("BENCH_THREADS", "2"))
REPS = int(os.environ.get("BENCH_REPS", "2"))


def cases(device: str):
    backends = [None] if device == "cpu" else ["triton", "cuda"]
    for shape, R in ROWS.items():
        for kind in KINDS:
            for b in backends if kind != "unfused" else [None]:
                yield shape, R, kind, b


@pytest.mark.parametrize("shape,R,kind,backend", list(cases("cuda" if torch.cuda.is_available() else "cpu")))
def test_bench_head_confidence(benchmark, shape, R, kind, backend):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = benchmark.pedantic(lambda: run_isolated(kind, R, device, backend, 2), rounds=1, iterations=1)
    benchmark.extra_info.update(res)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape, R, kind, b in cases(device):
        res = run_isolated(kind, R, device, b, REPS)
        res["shape"] = shape
        rows.append(res)
        print(res, flush=True)
    logits_mb = {R: R * V * 4 / 2**20 for R in ROWS.values()}
    lines = [
        "# LM head + confidence statistics, unfused vs fused (`ops.head_confidence`)",
        "",
        f"Dream-7B's head: hidden {H}, vocabulary {V:,}, the mask id suppressed; random weights (x 0.02). "
        f"Device: {device}; {THREADS} intra-op threads on a shared machine (times are indicative).",
        f"Command: `nice -n 10 python bench/bench_head_confidence.py` (each case in a fresh subprocess; peak = "
        "ru_maxrss after the first call minus after building the inputs; the median of 3 timed calls).",
        "",
        "| round | R | path | backend | dtype | peak above inputs (MB) | ms / call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['R']} | {r['kind']} | {r['backend']} | {r['dtype']} | {r['peak_mb']} | "
                     f"{r['ms']} |")
    lines += ["", "fp32 logits the unfused path materialises: " +
              ", ".join(f"R = {R}: {mb:.1f} MB" for R, mb in logits_mb.items()) + "."]
    (HERE / "results" / "head_confidence.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
