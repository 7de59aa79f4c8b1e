"""CPU, one thread: `select_step` (the threshold step's selection as one op) on its C++ kernel vs its torch backend.

Two measurements, each side by side in one run:
* per call (pytest-benchmark): the op on steps recorded from the threshold parity grid's tiny models (every rule,
  Dream's refresh_first included), `cpp` vs `torch`, the same calls in the same order;
* end to end (`python bench/bench_select_step.py`): 96 threshold cases of the parity grid (every rule, cache, block
  length, model, T = 0 / 0.7) decoded by the fast path with select_step on each backend, interleaved, fastest of 5;
  the tokens are the reference's either way (tests/test_select_step.py).

    python -m pytest bench/bench_select_step.py -m bench -q --benchmark-group-by=param:backend
    python bench/bench_select_step.py > bench/results/select_step_cpu.md
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lopa_fast  # noqa: E402
from lopa_fast import ops  # noqa: E402
from tests import test_fast_steps as fs  # noqa: E402
from tests.utils import record_calls  # noqa: E402

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA
pytestmark = pytest.mark.bench


def _cases():
    return fs.threshold_cases()[::6]  # 96 cases: the product's every 6th (every rule, cache, model, T)


def _record(models, cases, max_calls: int = 8) -> list:
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c in cases:
                lopa_fast.generate(models[c["model"]], c["prompt"], "threshold", "fast", **c["kw"])

    return record_calls("select_step", run, lambda calls: len(calls) < max_calls * len(cases))


@pytest.fixture(scope="module")
def recorded():
    torch.set_num_threads(1)
    return _record(fs.step_models(), _cases()[:24])


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_select_step_per_call(benchmark, recorded, backend):
    def all_calls():
        for args, kw in recorded:
            ops.select_step(*args, **kw, check=False, backend=backend)

    benchmark.extra_info["calls"] = len(recorded)
    benchmark(all_calls)


def end_to_end(reps: int = 5) -> None:
    torch.set_num_threads(1)
    models, cases, real = fs.step_models(), _cases(), ops.select_step

    def run(backend: str) -> float:
        lopa_fast.ops.select_step = lambda *a, **kw: real(*a, **dict(kw, backend=backend))
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c in cases:
                lopa_fast.generate(models[c["model"]], c["prompt"], "threshold", "fast", **c["kw"])
        return time.perf_counter() - t

    times: dict = {"torch": [], "cpp": []}
    try:
        run("torch"), run("cpp")  # warm
        for _ in range(reps):
            for b in times:
                times[b].append(run(b))
    finally:
        lopa_fast.ops.select_step = real
    calls = _record(models, cases, max_calls=10**6)
    per = {}
    for b in ("torch", "cpp"):
        t = time.perf_counter()
        for args, kw in calls:
            ops.select_step(*args, **kw, check=False, backend=b)
        per[b] = (time.perf_counter() - t) / len(calls) * 1e6
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    t, c = min(times["torch"]), min(times["cpp"])
    print("# select_step on CPU: the C++ kernel vs the torch backend (tiny models, 1 thread)\n")
    print(f"Commit {sha.strip()}, torch {torch.__version__}, {platform.processor() or 'cpu'}, load average "
          f"{os.getloadavg()[0]:.1f}. {len(cases)} threshold cases of the parity grid, decoded by the fast path, "
          f"interleaved, fastest of {reps}; {len(calls)} select_step calls.\n")
    print("| measure | torch | cpp | torch / cpp |\n|---|---|---|---|")
    print(f"| {len(cases)} threshold decodes, s | {t:.3f} | {c:.3f} | **{t / c:.2f}x** |")
    print(f"| one select_step call (mean over the decodes' calls), us | {per['torch']:.1f} | {per['cpp']:.1f} | "
          f"**{per['torch'] / per['cpp']:.1f}x** |")
    print("\nCommand: `python bench/bench_select_step.py > bench/results/select_step_cpu.md`")


if __name__ == "__main__":
    end_to_end()
