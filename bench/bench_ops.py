"""Microbenchmarks of the ops at Dream-7B shapes: Triton vs the torch reference, and attention vs
torch SDPA, FlexAttention and flash-attn (import-guarded; not installed on the H200 machine).

    python -m pytest bench/bench_ops.py -m bench --benchmark-group-by=param:shape \
        --benchmark-json=bench/results/bench_ops.json

GPU only (bench/conftest.py skips without CUDA). Inputs are built outside the timed call. extra_info
holds the CUDA-event median (us), bytes / FLOPs as counted below, GB/s and TFLOP/s and their fraction
of the H200 ceilings (~4.3 TB/s, ~790 TFLOP/s bf16), GPU, versions and git sha.

Attention baselines get the work in their own layout, prepared outside the timed call (in favour of
the baselines: a real SDPA/Flex decoder would also pay the per-layer concat of prefix and window K/V):
[B, H, L + n, D] K/V with the prefix repeated per branch and a boolean / block mask.
"""
from __future__ import annotations

import pytest
import torch

from bench.shapes import ATTENTION, ATTENTION_POOLED, CONFIDENCE, DREAM_7B, REAL_SHAPES
from lopa_fast import ops
from lopa_fast.reference import attention_modes

pytestmark = pytest.mark.bench

DEV = "cuda"
DT = torch.bfloat16
ATTN_PROVIDERS = ["triton", "torch", "sdpa", "flex", "flash_attn"]


def _attn_inputs(B, n, L):
    Hq, Hkv, D = DREAM_7B["num_heads"], DREAM_7B["num_kv_heads"], DREAM_7B["head_dim"]
    r = lambda *s: torch.randn(*s, dtype=DT, device=DEV)  # noqa: E731
    q, kc, vc, kw, vw = r(B, n, Hq, D), r(L + 256, Hkv, D), r(L + 256, Hkv, D), r(B, n, Hkv, D), r(B, n, Hkv, D)
    win_lens = torch.full((B,), n, device=DEV)
    win_lens[-1] = max(1, n - 32)  # one ragged branch (a lookahead that did not grow)
    block_ids = (torch.arange(n, device=DEV) // 32).expand(B, n).contiguous()
    return q, kc, vc, kw, vw, win_lens, block_ids


def _dense_layout(q, kc, vc, L, kw, vw, win_lens, block_ids):
    """[B, H, n, D] queries, [B, Hkv, L+n, D] keys/values and a bool mask [B, 1, n, L+n] (True = visible)."""
    B, n = q.shape[:2]
    k = torch.cat([kc[:L].unsqueeze(0).expand(B, -1, -1, -1), kw], dim=1).transpose(1, 2).contiguous()
    v = torch.cat([vc[:L].unsqueeze(0).expand(B, -1, -1, -1), vw], dim=1).transpose(1, 2).contiguous()
    vis = attention_modes.window_key_mask(n, win_lens, block_ids, "block_causal", B, q.device)
    mask = torch.cat([torch.ones(B, n, L, dtype=torch.bool, device=q.device), vis], dim=-1)[:, None]
    return q.transpose(1, 2).contiguous(), k, v, mask


def _attn_fn(provider, q, kc, vc, L, kw, vw, win_lens, block_ids):
    if provider in ("triton", "torch"):
        return lambda: ops.branch_attention(q, kc, vc, L, kw, vw, win_lens, block_ids, "block_causal",
                                            check=False, backend=provider)
    qd, k, v, mask = _dense_layout(q, kc, vc, L, kw, vw, win_lens, block_ids)
    if provider == "sdpa":
        F = torch.nn.functional
        return lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, enable_gqa=True)
    if provider == "flex":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:
            pytest.skip("FlexAttention is not available in this torch")
        B, n = q.shape[:2]
        bid, wl = block_ids, win_lens

        def mask_mod(b, h, qi, ki):
            kw_i = (ki - L).clamp(min=0)
            return (ki < L) | ((ki - L < wl[b]) & (bid[b, kw_i] <= bid[b, qi]))

        bm = create_block_mask(mask_mod, B, None, n, L + n, device=q.device)
        flex = torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention
        return lambda: flex(qd, k, v, block_mask=bm, enable_gqa=True)
    if provider == "flash_attn":
        try:
            from flash_attn import flash_attn_with_kvcache
        except ImportError:
            pytest.skip("flash-attn is not installed (no wheel; docs/toolchain.md section 5)")
        # flash-attn has no block-causal mask: time its full-attention kvcache call over the same keys
        kk, vv = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        return lambda: flash_attn_with_kvcache(q, kk, vv, causal=False)
    raise ValueError(provider)


@pytest.mark.parametrize("provider", ATTN_PROVIDERS)
@pytest.mark.parametrize("shape", list(ATTENTION))
def test_bench_branch_attention(gpu_timer, benchmark, shape, provider):
    B, n, L = ATTENTION[shape]
    benchmark.group = f"branch_attention {shape}"
    q, kc, vc, kw, vw, win_lens, block_ids = _attn_inputs(B, n, L)
    fn = _attn_fn(provider, q, kc, vc, L, kw, vw, win_lens, block_ids)
    Hq, Hkv, D = q.shape[2], kw.shape[2], q.shape[3]
    esz = q.element_size()
    # the fused op's compulsory traffic: prefix K/V once, window K/V, q in, o out
    nbytes = (2 * L * Hkv * D + 2 * kw.numel() + 2 * q.numel()) * esz
    flops = 4 * B * n * Hq * D * (L + n)  # QK^T and PV over every (unmasked upper bound) key
    gpu_timer(fn, nbytes=nbytes, flops=flops)


@pytest.mark.parametrize("provider", ["triton"])  # the torch backend's pooled form is the row-loop reference
@pytest.mark.parametrize("shape", list(ATTENTION_POOLED))
def test_bench_branch_attention_pooled(gpu_timer, benchmark, shape, provider):
    """The pooled form: R requests' rows in one call over a [R, L + 256, Hkv, D] pool (bench_cuda.py adds the
    CUDA kernel and the per-request loop it replaces)."""
    from bench.bench_cuda import pooled_inputs

    R, k1, n, L = ATTENTION_POOLED[shape]
    benchmark.group = f"branch_attention pooled {shape}"
    q, kp, vp, cl, kw, vw, wl, bid, idx = pooled_inputs(R, k1, n, L, DEV, DT)
    fn = lambda: ops.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, "block_causal", check=False,  # noqa: E731
                                      backend=provider, cache_index=idx)
    Hq, Hkv, D = q.shape[2], kw.shape[2], q.shape[3]
    nbytes = (2 * int(cl.sum()) * Hkv * D + 2 * kw.numel() + 2 * q.numel()) * q.element_size()
    gpu_timer(fn, nbytes=nbytes, flops=4 * q.shape[0] * n * Hq * D * (int(cl.float().mean()) + n))


@pytest.mark.parametrize("provider", ["triton", "torch"])
@pytest.mark.parametrize("shape", list(CONFIDENCE))
def test_bench_confidence(gpu_timer, benchmark, shape, provider):
    N, V = CONFIDENCE[shape]
    benchmark.group = f"confidence {shape}"
    logits = (torch.randn(N, V, device=DEV) * 4).to(DT)
    fn = lambda: ops.confidence(logits, 151666, check=False, backend=provider)  # noqa: E731 - Dream mask id
    gpu_timer(fn, nbytes=N * V * logits.element_size())  # one read of the logits is the floor


# norm_linear at Dream-7B's layer (H 3,584, I 18,944, 28 q / 4 kv heads of 128): the fused add + norm + GEMM +
# epilogue beside the unfused ops it replaces (the Triton add_rms_norm, cuBLAS F.linear, the Triton silu_mul / rope);
# rows: D2F (33), LoPA k = 4 (161) and k = 8 (289: past models/static_forward.NORM_LINEAR_MAX_ROWS, where the layer
# loop keeps the unfused ops) rounds' windows
@pytest.mark.parametrize("provider", ["triton", "unfused"])
@pytest.mark.parametrize("rows,epilogue", [(33, "swiglu"), (161, "swiglu"), (289, "swiglu"), (33, "rope")])
def test_bench_norm_linear(gpu_timer, benchmark, rows, epilogue, provider):
    shape = REAL_SHAPES["dream7b"]
    K, D = shape["hidden_size"], shape["hidden_size"] // shape["num_heads"]
    Hq, Hkv = shape["num_heads"], shape["num_kv_heads"]
    N = 2 * shape["intermediate_size"] if epilogue == "swiglu" else (Hq + 2 * Hkv) * D
    benchmark.group = f"norm_linear {epilogue} M={rows}"
    x, r = (torch.randn(1, rows, K, device=DEV).to(DT) for _ in range(2))
    nw = torch.ones(K, device=DEV, dtype=DT)
    w = (torch.randn(N, K, device=DEV) / K**0.5).to(DT)
    bias = torch.zeros(N, device=DEV, dtype=DT) if epilogue == "rope" else None
    cos, sin = ops.rope_cos_sin(torch.arange(1024, 1024 + rows, device=DEV), D, 1e6) if epilogue == "rope" \
        else (None, None)
    if provider == "triton":
        fn = lambda: ops.norm_linear(x, w, epilogue, norm_weight=nw, residual=r, bias=bias, cos=cos, sin=sin,  # noqa: E731
                                     rot_heads=Hq + Hkv, check=False, backend="triton")
    else:
        def fn():
            h, s = ops.add_rms_norm(x, r, nw, 1e-6, check=False)
            y = torch.nn.functional.linear(h, w, bias)
            if epilogue == "swiglu":
                return ops.silu_mul(*y.chunk(2, dim=-1), check=False), s
            y = y.view(1, rows, Hq + 2 * Hkv, D)
            return ops.rope(y[:, :, :Hq], y[:, :, Hq : Hq + Hkv], cos, sin, check=False), s
    gpu_timer(fn, nbytes=w.numel() * w.element_size(), flops=2 * rows * N * K)  # the weight read once: the floor
