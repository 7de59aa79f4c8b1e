"""Triton `rms_norm` and `add_rms_norm`: the decoder's pre-norm, one program per row.

Per row of H values: upcast to fp32, sum of squares over the whole row (H fits one tile: 3584 for
Dream-7B, 4096 for LLaDA-8B), r = rsqrt(mean + eps), y = x * r rounded to x.dtype, then y * weight in
x.dtype (a product of two fp16/bf16 values formed in fp32 and rounded once is the correctly rounded
dtype product, as PyTorch's elementwise mul). `add_rms_norm` first forms s = x + residual the same way
(one rounding to x.dtype), writes s, and normalises it, so it equals the add followed by the norm.
The only difference to the PyTorch reference is the order of the fp32 sum of squares (a tree here).
Bytes: reads (1 or 2) * M * H * elem + H * elem, writes (1 or 2) * M * H * elem.
Matches lopa_fast.reference.ops.rms_norm / add_rms_norm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton._common import is_interpreter


@triton.jit
def _rms_norm_kernel(
    x_ptr, stride_x, r_ptr, stride_r, w_ptr, y_ptr, s_ptr, H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # the dtype add: one rounding
        tl.store(s_ptr + row * H + offs, x, mask=ok)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=0) / H
    r = tl.rsqrt(ms + eps)
    y = (xf * r).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    y = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(y_ptr + row * H + offs, y, mask=ok)


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    """[..., H] -> [M, H] with a contiguous last dim (a view when the leading dims merge)."""
    t = t.reshape(-1, H)
    return t if t.stride(1) == 1 or H == 1 else t.contiguous()


def _launch(x, residual, weight, eps):
    H = x.shape[-1]
    x2 = _rows(x, H)
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if M == 0 or H == 0:
        return y, s
    r2 = _rows(residual, H) if residual is not None else x2
    w = weight if weight.stride(0) == 1 or H == 1 else weight.contiguous()
    BLOCK_H = triton.next_power_of_2(H)
    warps = 1 if is_interpreter() else max(1, min(16, BLOCK_H // 256))  # ~8 fp32 values per thread
    _rms_norm_kernel[(M,)](
        x2, x2.stride(0), r2, r2.stride(0), w, y, s if s is not None else y, H, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK_H=BLOCK_H, num_warps=warps,
    )
    return y, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (last dim contiguous), weight [H] of x.dtype -> contiguous [..., H] in x.dtype."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual), x + residual), both contiguous [..., H] in x.dtype."""
    return _launch(x, residual, weight, eps)
