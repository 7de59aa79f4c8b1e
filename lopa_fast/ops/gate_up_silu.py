"""`gate_up_silu`: SwiGLU's gate/up projection with the activation fused into the GEMM (one launch, the [.., 2F]
projection never written). See reference.ops.gate_up_silu.

The Triton launcher is registered as the torch custom op `lopa_fast::triton_gate_up_silu` (with a fake
implementation), so torch.compile(fullgraph=True) and graph capture trace through the public op.
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref

_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FLOATS = _KERNEL_FLOATS + (torch.float64,)


def _check(x, weight):
    op = "gate_up_silu"
    for name, t, dims in (("x", x, "[..., K]"), ("weight", weight, "[2F, K]")):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"{op}: {name} must be a {dims} tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{op}: {name}.dtype={t.dtype}; allowed: {_FLOATS}")
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight {tuple(weight.shape)} must be [2F, K] with K = x.shape[-1] = {x.shape[-1]}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"{op}: x is {x.dtype} on {x.device}; weight is {weight.dtype} on {weight.device}")
    _backend.check_last_dim_contiguous(op, x=x, weight=weight)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, *, check: bool = True,
                 backend: str | None = None) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T) for x [..., K] and the merged gate/up weight [2F, K] (gate rows first), one
    dtype, last dims contiguous. Returns a contiguous [..., F] in that dtype.
    backend: None (auto: triton on CUDA, torch on CPU) | "triton" | "torch" (the reference: F.linear, then
    silu_mul, bitwise the model's MLP). The kernel accumulates in fp32 in its own order (as a GEMM library does)
    and rounds the projection and the activation as the reference does."""
    if check:
        _check(x, weight)
    b = _backend.resolve("gate_up_silu", backend, x.device)
    if b == "torch":
        return ref.gate_up_silu(x, weight)
    if x.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"gate_up_silu: x.dtype={x.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    return torch.ops.lopa_fast.triton_gate_up_silu(x, weight)


# ------------------------------------------------------------------------------ torch custom op (Triton)
@torch.library.custom_op("lopa_fast::triton_gate_up_silu", mutates_args=())
def _gate_up_silu_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _backend.kernel("gate_up_silu", "triton")(x, weight)


@_gate_up_silu_op.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))
