"""`silu_mul`: SwiGLU's elementwise part, silu(gate) * up in the input dtype (the matmuls stay cuBLAS).
See reference.ops.silu_mul.

The Triton launcher is registered as the torch custom op `lopa_fast::triton_silu_mul` (with a fake
implementation), so torch.compile(fullgraph=True) and graph capture trace through the public op
without a graph break.
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref

_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FLOATS = _KERNEL_FLOATS + (torch.float64,)


def _check(gate, up):
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"silu_mul: {name} must be a [..., F] tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"silu_mul: {name}.dtype={t.dtype}; allowed: {_FLOATS}")
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype or gate.device != up.device:
        raise TypeError(f"silu_mul: gate is {gate.dtype} on {gate.device}; up is {up.dtype} on {up.device}")
    _backend.check_last_dim_contiguous("silu_mul", gate=gate, up=up)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, *, check: bool = True, backend: str | None = None
) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., F] of one dtype (last dims contiguous; row strides free, e.g. the
    halves of a merged gate/up projection). Returns a contiguous [..., F] in that dtype.
    backend: None (auto: triton on CUDA, torch on CPU) | "triton" | "torch" (the reference twin, bitwise
    the model's `F.silu(gate) * up`). The Triton kernel rounds as the reference does; only exp's last
    bit can differ."""
    if check:
        _check(gate, up)
    b = _backend.resolve("silu_mul", backend, gate.device)
    if b == "torch":
        return ref.silu_mul(gate, up)
    if gate.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"silu_mul: gate.dtype={gate.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    if b == "cuda":
        return _backend.kernel("silu_mul", b)(gate, up)
    return torch.ops.lopa_fast.triton_silu_mul(gate, up)


# ------------------------------------------------------------------------------ torch custom op (Triton)
@torch.library.custom_op("lopa_fast::triton_silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _backend.kernel("silu_mul", "triton")(gate, up)


@_silu_mul_op.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)
