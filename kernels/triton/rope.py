"""Triton `rope`: rotate-half RoPE of q and k in one launch, one program per (branch, position) token.

Each program loads the token's cos/sin row once (fp32 [D], from the per-forward table, so no position is
a launch argument) and rotates all Hq query heads and all Hkv key heads of that token:
    out[:D/2] = x1 * c1 - x2 * s1,   out[D/2:] = x2 * c2 + x1 * s2
ROPE_FP32=False (Qwen2): c, s rounded to x.dtype; each product and the sum rounded to x.dtype, as the
reference's separate elementwise ops do (fp16/bf16 products and sums formed in fp32 and rounded once
are the correctly rounded dtype results). ROPE_FP32=True (LLaDA): all in fp32, one cast at the end.
Launched with enable_fp_fusion=False: a fused multiply-add would round once where the reference rounds
twice, so the kernel's arithmetic is op for op the reference's.
q / k may be strided views (e.g. column slices of a merged qkv projection); the last dim must be
contiguous. Outputs are contiguous [B, n, H, D].
Bytes: reads and writes B * n * (Hq + Hkv) * D * elem, reads the table once per token.
Matches lopa_fast.reference.ops.rope.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton._common import is_interpreter


@triton.jit
def _rotate_heads(x_ptr, sxb, sxt, sxh, o_ptr, b, t, n, H, c1, c2, s1, s2, HALF,
                  ROPE_FP32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D2)[None, :]
    ok = (h < H) & (d < HALF)
    src = x_ptr + b * sxb + t * sxt + h * sxh + d
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if ROPE_FP32:
        o1 = (x1f * c1 - x2f * s1).to(dt)
        o2 = (x2f * c2 + x1f * s2).to(dt)
    else:
        c1d = c1.to(dt).to(tl.float32)
        c2d = c2.to(dt).to(tl.float32)
        s1d = s1.to(dt).to(tl.float32)
        s2d = s2.to(dt).to(tl.float32)
        o1 = ((x1f * c1d).to(dt).to(tl.float32) - (x2f * s1d).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2f * c2d).to(dt).to(tl.float32) + (x1f * s2d).to(dt).to(tl.float32)).to(dt)
    dst = o_ptr + ((b * n + t) * H + h) * (2 * HALF) + d
    tl.store(dst, o1, mask=ok)
    tl.store(dst + HALF, o2, mask=ok)


@triton.jit
def _rope_kernel(
    q_ptr, sqb, sqt, sqh, k_ptr, skb, skt, skh, cos_ptr, sin_ptr, scb, sct, qo_ptr, ko_ptr,
    n, Hq, Hkv, HALF,
    ROPE_FP32: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D2: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n
    t = pid % n
    d = tl.arange(0, BLOCK_D2)[None, :]
    dm = d < HALF
    row = b * scb + t * sct
    c1 = tl.load(cos_ptr + row + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, sqb, sqt, sqh, qo_ptr, b, t, n, Hq, c1, c2, s1, s2, HALF, ROPE_FP32, BLOCK_HQ, BLOCK_D2)
    _rotate_heads(k_ptr, skb, skt, skh, ko_ptr, b, t, n, Hkv, c1, c2, s1, s2, HALF, ROPE_FP32, BLOCK_HK, BLOCK_D2)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool = False):
    """q [B, n, Hq, D], k [B, n, Hkv, D] (last dims contiguous), cos / sin fp32 [n, D] or [B, n, D]
    (last dim contiguous, same strides) -> (q_rot, k_rot), contiguous, in the input dtypes."""
    B, n, Hq, D = q.shape
    Hkv = k.shape[2]
    qo = torch.empty((B, n, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, n, Hkv, D), dtype=k.dtype, device=k.device)
    if B * n == 0:
        return qo, ko
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    scb = cos.stride(0) if cos.dim() == 3 else 0
    sct = cos.stride(-2)
    half = D // 2
    BLOCK_D2 = triton.next_power_of_2(half)
    BLOCK_HQ, BLOCK_HK = triton.next_power_of_2(Hq), triton.next_power_of_2(Hkv)
    tile = max(BLOCK_HQ, BLOCK_HK) * BLOCK_D2
    warps = 1 if is_interpreter() else max(1, min(8, tile // 256))
    _rope_kernel[(B * n,)](
        q, q.stride(0), q.stride(1), q.stride(2), k, k.stride(0), k.stride(1), k.stride(2),
        cos, sin, scb, sct, qo, ko, n, Hq, Hkv, half,
        ROPE_FP32=bool(fp32), BLOCK_HQ=BLOCK_HQ, BLOCK_HK=BLOCK_HK, BLOCK_D2=BLOCK_D2,
        num_warps=warps, enable_fp_fusion=False,
    )
    return qo, ko
