"""Microbenchmarks of the CUDA kernels vs the Triton kernels and the torch backend at Dream-7B shapes.

    python -m pytest bench/bench_cuda.py -m bench --benchmark-group-by=param:shape \
        --benchmark-json=$OUT/bench_cuda.json

GPU only (skips without CUDA). Inputs are built outside the timed function; each timed call ends with
torch.cuda.synchronize(). extra_info carries a CUDA-event median over 100 back-to-back launches (us),
the bytes the op must move and the resulting GB/s, plus GPU name and versions.
Shapes: Dream-7B attention (Hq=28, Hkv=4, D=128) for 3 and 9 branch windows of 32 positions over a 1024 /
2048-token prefix; confidence over the 152,064-entry Dream vocabulary for 96 and 288 rows.
"""
from __future__ import annotations

import subprocess

import pytest
import torch

from lopa_fast import ops

pytestmark = [pytest.mark.bench, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROVIDERS = ["cuda", "triton", "torch"]
ATTN = {"B3_n32_L1024": (3, 32, 1024), "B3_n32_L2048": (3, 32, 2048), "B9_n32_L2048": (9, 32, 2048)}
CONF = {"N96_V152064": (96, 152064), "N288_V152064": (288, 152064)}


def _machine() -> dict:
    import triton  # noqa: PLC0415

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "git": sha}


def _event_us(fn, iters=100) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def _run(benchmark, fn, nbytes):
    us = _event_us(fn)
    benchmark.extra_info.update(_machine(), us_event=us, bytes=nbytes, gbps=nbytes / us / 1e3)

    def timed():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=50, warmup_rounds=10)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(ATTN))
def test_bench_branch_attention(benchmark, shape, provider):
    B, n, L = ATTN[shape]
    Hq, Hkv, D = 28, 4, 128
    dt, dev = torch.bfloat16, "cuda"
    q = torch.randn(B, n, Hq, D, dtype=dt, device=dev)
    kc, vc = torch.randn(L + 256, Hkv, D, dtype=dt, device=dev), torch.randn(L + 256, Hkv, D, dtype=dt, device=dev)
    kw, vw = torch.randn(B, n, Hkv, D, dtype=dt, device=dev), torch.randn(B, n, Hkv, D, dtype=dt, device=dev)
    wl = torch.full((B,), n, device=dev)
    bid = torch.arange(n, device=dev).div(32, rounding_mode="floor").expand(B, n).contiguous()

    def fn():
        ops.branch_attention(q, kc, vc, L, kw, vw, wl, bid, "block_causal", backend=provider, check=False)

    nbytes = 2 * L * Hkv * D * 2 + 2 * q.numel() * 2 + 2 * kw.numel() * 2  # prefix K+V, q + o, window K+V
    _run(benchmark, fn, nbytes)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(CONF))
def test_bench_confidence(benchmark, shape, provider):
    N, V = CONF[shape]
    x = torch.randn(N, V, dtype=torch.bfloat16, device="cuda") * 4

    def fn():
        ops.confidence(x, None, backend=provider, check=False)

    _run(benchmark, fn, N * V * 2)
