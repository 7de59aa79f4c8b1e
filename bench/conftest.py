"""Benchmark helpers: every `bench` item under bench/ skips without CUDA (the interpreter is never
benchmarked); `gpu_timer` times a callable with CUDA events and stamps machine + versions into extra_info."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="benchmarks need a CUDA device (the Triton interpreter is not benchmarked)")
    for item in items:
        if getattr(getattr(item, "module", None), "RUNS_ON_CPU", False):  # CPU end-to-end benches opt out
            continue
        if "bench" in item.keywords and _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def machine_info() -> dict:
    import triton

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=_HERE).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "git": sha}


def event_us(fn, iters: int = 50, reps: int = 5) -> float:
    """Median over `reps` of the mean CUDA-event time of `iters` back-to-back calls (us)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / iters)
    return sorted(times)[len(times) // 2]


@pytest.fixture
def gpu_timer(benchmark):
    """gpu_timer(fn, nbytes=None, flops=None): pytest-benchmark timing (synchronised) plus a CUDA-event
    median, GB/s and TFLOP/s against the H200 ceilings in benchmark.extra_info."""
    from bench.shapes import H200_GBPS, H200_TFLOPS_BF16

    def run(fn, nbytes=None, flops=None, rounds=20):
        us = event_us(fn)
        info = dict(machine_info(), us_event=round(us, 2))
        if nbytes:
            gbps = nbytes / us / 1e3
            info.update(bytes=int(nbytes), gbps=round(gbps, 1), frac_hbm=round(gbps / H200_GBPS, 3))
        if flops:
            tflops = flops / us / 1e6
            info.update(flops=int(flops), tflops=round(tflops, 2), frac_bf16_peak=round(tflops / H200_TFLOPS_BF16, 3))
        benchmark.extra_info.update(info)

        def timed():
            fn()
            torch.cuda.synchronize()

        benchmark.pedantic(timed, rounds=rounds, warmup_rounds=3)
        return us

    return run
