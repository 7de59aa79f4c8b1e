"""Triton `silu_mul`: SwiGLU's elementwise part, silu(gate) * up, in the input dtype.

Grid (rows, column blocks); each program reads BLOCK_F values of gate and up and writes their product.
silu is formed in fp32 (g / (1 + exp(-g))) and rounded to the dtype, then multiplied by up (a product of
two fp16/bf16 values formed in fp32 and rounded once is the correctly rounded dtype product), as the
reference's two elementwise ops do; only exp's last-bit accuracy can differ from PyTorch's.
gate and up may be strided row views (e.g. the two halves of a merged gate/up projection); the last dim
must be contiguous. Output contiguous [..., F].
Bytes: reads 2 * M * F * elem, writes M * F * elem.
Matches lopa_fast.reference.ops.silu_mul.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton._common import is_interpreter


@triton.jit
def _silu_mul_kernel(g_ptr, stride_g, u_ptr, stride_u, o_ptr, F, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = offs < F
    g = tl.load(g_ptr + row * stride_g + offs, mask=ok, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    out = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(o_ptr + row * F + offs, out, mask=ok)


def _rows(t: torch.Tensor, F: int) -> torch.Tensor:
    t = t.reshape(-1, F)
    return t if t.stride(1) == 1 or F == 1 else t.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., F] (same shape and dtype, last dims contiguous) -> contiguous [..., F]."""
    F = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g2, u2 = _rows(gate, F), _rows(up, F)
    BLOCK_F = min(256 if is_interpreter() else 2048, triton.next_power_of_2(F))
    warps = 1 if is_interpreter() else max(1, min(8, BLOCK_F // 256))  # 8 values per thread
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(F, BLOCK_F))](
        g2, g2.stride(0), u2, u2.stride(0), out, F, BLOCK_F=BLOCK_F, num_warps=warps,
    )
    return out
