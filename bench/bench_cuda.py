"""Microbenchmarks of the CUDA kernels vs the Triton kernels and the torch backend at Dream-7B shapes
(bench/shapes.py).

GPU (bench/conftest.py skips these without CUDA):
    python -m pytest bench/bench_cuda.py -m bench --benchmark-group-by=param:shape \
        --benchmark-json=$OUT/bench_cuda.json

Inputs are built outside the timed function; each timed GPU call ends with torch.cuda.synchronize().
extra_info carries a CUDA-event median over 100 back-to-back launches (us), the bytes the op must move and
the resulting GB/s, plus GPU name and versions.
"""
from __future__ import annotations

import pytest
import torch

from bench.conftest import event_us, machine_info
from bench.shapes import ATTENTION, ATTENTION_POOLED, CONFIDENCE, DREAM_7B
from lopa_fast import ops

pytestmark = pytest.mark.bench
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROVIDERS = ["cuda", "triton", "torch"]


def _run(benchmark, fn, nbytes, flops=None):
    us = event_us(fn, iters=100)
    benchmark.extra_info.update(machine_info(), us_event=us, bytes=nbytes, gbps=nbytes / us / 1e3)
    if flops:
        benchmark.extra_info.update(flops=flops, tflops=flops / us / 1e6)

    def timed():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=50, warmup_rounds=10)


@on_gpu
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(ATTENTION))
def test_bench_branch_attention(benchmark, shape, provider):
    B, n, L = ATTENTION[shape]
    Hq, Hkv, D = DREAM_7B["num_heads"], DREAM_7B["num_kv_heads"], DREAM_7B["head_dim"]
    dt, dev = torch.bfloat16, "cuda"
    q = torch.randn(B, n, Hq, D, dtype=dt, device=dev)
    kc, vc = torch.randn(L + 256, Hkv, D, dtype=dt, device=dev), torch.randn(L + 256, Hkv, D, dtype=dt, device=dev)
    kw, vw = torch.randn(B, n, Hkv, D, dtype=dt, device=dev), torch.randn(B, n, Hkv, D, dtype=dt, device=dev)
    wl = torch.full((B,), n, device=dev)
    wl[-1] = max(1, n - 32)  # one ragged branch, as bench_ops.py
    bid = torch.arange(n, device=dev).div(32, rounding_mode="floor").expand(B, n).contiguous()

    def fn():
        ops.branch_attention(q, kc, vc, L, kw, vw, wl, bid, "block_causal", backend=provider, check=False)

    nbytes = 2 * L * Hkv * D * 2 + 2 * q.numel() * 2 + 2 * kw.numel() * 2  # prefix K+V, q + o, window K+V
    _run(benchmark, fn, nbytes, flops=4 * B * n * Hq * (L + n) * D)  # QK^T + PV


def pooled_inputs(R, k1, n, L, dev="cuda", dt=torch.bfloat16):
    """(q, k_pool, v_pool, cache_len [R], k_win, v_win, win_lens, block_ids, cache_index) for R requests of k1 rows
    each over a [R, L + 256, Hkv, D] pool; request r's lengths L - 8 r (ragged prefixes), rows in request order."""
    Hq, Hkv, D = DREAM_7B["num_heads"], DREAM_7B["num_kv_heads"], DREAM_7B["head_dim"]
    B = R * k1
    r = lambda *s: torch.randn(*s, dtype=dt, device=dev)  # noqa: E731
    q, kw, vw = r(B, n, Hq, D), r(B, n, Hkv, D), r(B, n, Hkv, D)
    kp, vp = r(R, L + 256, Hkv, D), r(R, L + 256, Hkv, D)
    cl = torch.tensor([L - 8 * i for i in range(R)], device=dev)
    idx = torch.arange(R, device=dev).repeat_interleave(k1)
    wl = torch.full((B,), n, device=dev)
    bid = torch.arange(n, device=dev).div(32, rounding_mode="floor").expand(B, n).contiguous()
    return q, kp, vp, cl, kw, vw, wl, bid, idx


@on_gpu
@pytest.mark.parametrize("provider", ["cuda", "triton", "cuda-loop", "triton-loop"])  # torch: a row loop (reference)
@pytest.mark.parametrize("shape", list(ATTENTION_POOLED))
def test_bench_branch_attention_pooled(benchmark, shape, provider):
    """The pooled form (one call for R requests) vs `*-loop`: R single-request calls on the pool's slots (what a
    batched round would otherwise launch per layer)."""
    R, k1, n, L = ATTENTION_POOLED[shape]
    q, kp, vp, cl, kw, vw, wl, bid, idx = pooled_inputs(R, k1, n, L)
    backend = provider.removesuffix("-loop")
    if provider.endswith("-loop"):
        rows = [slice(i * k1, (i + 1) * k1) for i in range(R)]
        lens = [cl[i].reshape(()) for i in range(R)]

        def fn():
            for i, s in enumerate(rows):
                ops.branch_attention(q[s], kp[i], vp[i], lens[i], kw[s], vw[s], wl[s], bid[s], "block_causal",
                                     backend=backend, check=False)
    else:

        def fn():
            ops.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, "block_causal", backend=backend, check=False,
                                 cache_index=idx)

    Hq, Hkv, D = q.shape[2], kw.shape[2], q.shape[3]
    nbytes = (2 * int(cl.sum()) * Hkv * D + 2 * q.numel() + 2 * kw.numel()) * 2  # each slot's prefix once
    _run(benchmark, fn, nbytes, flops=4 * q.shape[0] * n * Hq * D * (int(cl.float().mean()) + n))


@on_gpu
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(CONFIDENCE))
def test_bench_confidence(benchmark, shape, provider):
    N, V = CONFIDENCE[shape]
    x = torch.randn(N, V, dtype=torch.bfloat16, device="cuda") * 4

    def fn():
        ops.confidence(x, None, backend=provider, check=False)

    _run(benchmark, fn, N * V * 2)
