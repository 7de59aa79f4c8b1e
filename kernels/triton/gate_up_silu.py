"""Triton `gate_up_silu`: SwiGLU's gate/up projection with its activation as the GEMM's epilogue.

out [M, F] = silu(x @ Wg^T) * (x @ Wu^T) for x [M, K] and the merged weight [2F, K] (gate rows first: the
`FusedLayer.gate_up_w` layout). Grid (row tiles, column tiles), row tiles fastest, so the programs that share a
weight tile run side by side and read it from L2; each program accumulates its gate and up tiles in fp32 over K
(one `tl.dot` each per K step), rounds both to the storage dtype (what F.linear returns), then applies the
reference's SwiGLU rounding: silu formed in fp32 and rounded, times up formed in fp32 and rounded
(kernels/triton/silu_mul.py). Bytes at a LoPA k = 4 round of Dream-7B (M = 160, K = 3,584, F = 18,944, bf16): the
weight 272 MB as before, out 6 MB written; the unfused pair wrote the [M, 2F] projection (12 MB) and read it back
to write the activation: 24 MB a layer less, 0.68 GB a round (~0.16 ms on an H200), and one kernel less a layer.
Matches lopa_fast.reference.ops.gate_up_silu.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton._common import is_interpreter

NUM_WARPS = 4


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, o_ptr, M, F, K, stride_x, stride_w,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < F
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(x_ptr + rm64[:, None] * stride_x + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        wg = tl.load(w_ptr + rn64[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_ptr + (rn64 + F)[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PREC)
    dt = o_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)  # the projection's values, as F.linear rounds them
    u = acc_u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt)
    out = (act.to(tl.float32) * u).to(dt)
    tl.store(o_ptr + rm64[:, None] * F + rn64[None, :], out, mask=mmask[:, None] & nmask[None, :])


def tiles_for(M: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). GPU: 16-64 rows (a round's M is 32-300), 64 x 64 weight tiles per operand
    (fp32: 32 x 32, its IEEE dot on the FMA units spilled at 64 x 32 on sm_90). Interpreter (CPU tests): wide tiles,
    each step a numpy matmul."""
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    if is_interpreter():
        return block_m, 64, 64
    return (block_m, 32, 32) if dtype == torch.float32 else (block_m, 64, 64)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, tiles=None) -> torch.Tensor:
    """x [..., K], weight [2F, K] (one dtype, last dims contiguous) -> contiguous [..., F] in that dtype.
    tiles (BLOCK_M, BLOCK_N, BLOCK_K): None = the launcher's choice (tests force them)."""
    K = x.shape[-1]
    F = weight.shape[0] // 2
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    M = x2.shape[0]
    out = torch.empty((*x.shape[:-1], F), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    BM, BN, BK = tiles or tiles_for(M, x.dtype)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: IEEE, not TF32 (parity with F.linear)
    _gate_up_silu_kernel[(triton.cdiv(M, BM), triton.cdiv(F, BN))](
        x2, weight, out, M, F, K, x2.stride(0), weight.stride(0),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, DOT_PREC=prec, num_warps=NUM_WARPS, num_stages=3,
    )
    return out
