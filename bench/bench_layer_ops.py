"""Microbenchmarks of the fused layer ops (rms_norm, add_rms_norm, rope, silu_mul) at Dream-7B shapes:
the Triton kernel vs the torch reference twin (several eager kernels each).

    python -m pytest bench/bench_layer_ops.py -m bench --benchmark-group-by=param:shape \
        --benchmark-json=bench/results/bench_layer_ops.json

GPU only (bench/conftest.py skips without CUDA). Inputs are built outside the timed call, with
check=False (the decoder validates once per request). extra_info holds the CUDA-event median (us), the
bytes each op must move at least (one read of every input, one write of every output), GB/s and the
fraction of the H200's ~4.3 TB/s. At decode shapes (32-2048 token rows) these ops are launch-bound:
the number that matters is us per call, times ~4 calls per layer per forward.
"""
from __future__ import annotations

import pytest
import torch

from bench.shapes import DREAM_7B
from lopa_fast import ops

pytestmark = pytest.mark.bench

DEV = "cuda"
DT = torch.bfloat16
HIDDEN, INTERMEDIATE, EPS = 3584, 18944, 1e-6  # Dream-7B (Qwen2.5-7B) geometry
# name -> (branches B, window n): token rows B * n of one window forward
ROWS = {
    "dream7b_B1_n32": (1, 32),  # plain D2F round
    "dream7b_B9_n32": (9, 32),  # LoPA branching_factor 8
    "dream7b_B16_n128": (16, 128),
}
PROVIDERS = ["triton", "torch"]


def _r(*s, scale=1.0):
    return torch.randn(*s, dtype=DT, device=DEV) * scale


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(ROWS))
def test_bench_rms_norm(gpu_timer, benchmark, shape, provider):
    B, n = ROWS[shape]
    benchmark.group = f"rms_norm {shape}"
    x, w = _r(B, n, HIDDEN), _r(HIDDEN)
    gpu_timer(lambda: ops.rms_norm(x, w, EPS, check=False, backend=provider),
              nbytes=(2 * x.numel() + w.numel()) * x.element_size())


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(ROWS))
def test_bench_add_rms_norm(gpu_timer, benchmark, shape, provider):
    B, n = ROWS[shape]
    benchmark.group = f"add_rms_norm {shape}"
    x, r, w = _r(B, n, HIDDEN), _r(B, n, HIDDEN), _r(HIDDEN)
    gpu_timer(lambda: ops.add_rms_norm(x, r, w, EPS, check=False, backend=provider),
              nbytes=(4 * x.numel() + w.numel()) * x.element_size())


@pytest.mark.parametrize("fp32", [False, True], ids=["qwen2", "llada"])
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(ROWS))
def test_bench_rope(gpu_timer, benchmark, shape, provider, fp32):
    B, n = ROWS[shape]
    benchmark.group = f"rope {shape} fp32={fp32}"
    Hq, Hkv, D = DREAM_7B["num_heads"], DREAM_7B["num_kv_heads"], DREAM_7B["head_dim"]
    # q and k as head slices of one merged qkv projection, as a fused layer produces them
    qkv = _r(B, n, (Hq + 2 * Hkv) * D)
    q = qkv[..., : Hq * D].unflatten(-1, (Hq, D))
    k = qkv[..., Hq * D : (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    cos, sin = ops.rope_cos_sin(torch.arange(1024, 1024 + n, device=DEV), D, 1e6)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * 4
    gpu_timer(lambda: ops.rope(q, k, cos, sin, fp32, check=False, backend=provider), nbytes=nbytes)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(ROWS))
def test_bench_silu_mul(gpu_timer, benchmark, shape, provider):
    B, n = ROWS[shape]
    benchmark.group = f"silu_mul {shape}"
    gu = _r(B, n, 2 * INTERMEDIATE, scale=4.0)  # merged gate/up projection output
    gate, up = gu[..., :INTERMEDIATE], gu[..., INTERMEDIATE:]
    gpu_timer(lambda: ops.silu_mul(gate, up, check=False, backend=provider),
              nbytes=3 * gate.numel() * gate.element_size())
