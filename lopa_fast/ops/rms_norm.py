"""`rms_norm` / `add_rms_norm`: the decoder's pre-norm (and the residual add before it).
See reference.ops.rms_norm / add_rms_norm.

The Triton launchers are registered as torch custom ops (`lopa_fast::triton_rms_norm`,
`lopa_fast::triton_add_rms_norm`, with fake implementations), so torch.compile(fullgraph=True) and
graph capture trace through the public op without a graph break.
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch
import torch.nn.functional as F

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref

_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FLOATS = _KERNEL_FLOATS + (torch.float64,)


def _check(op, x, weight, eps, residual=None):
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: x must be a [..., H] tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{op}: x.dtype={x.dtype}; allowed: {_FLOATS}")
    H = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (H,):
        raise ValueError(f"{op}: weight must be [H={H}], got {getattr(weight, 'shape', type(weight))}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight.dtype={weight.dtype} must equal x.dtype={x.dtype} (the scale is in x.dtype)")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, "
                             f"got {getattr(residual, 'shape', type(residual))}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise TypeError(f"{op}: residual is {residual.dtype} on {residual.device}; "
                            f"x is {x.dtype} on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps={eps!r} must be a float >= 0")
    _backend.check_last_dim_contiguous(op, x=x, residual=residual)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch backend: fp32 x and weight through torch's own F.rms_norm (one call instead of the reference's 7
    ops: 25 -> 16 us on a tiny CPU layer), bitwise `ref.rms_norm` there (the same upcast / mean / rsqrt / cast /
    scale; tests/test_rms_norm.py); every other dtype through the reference itself (F.rms_norm scales half types in
    fp32 and keeps fp64 in fp64, the model's formula does not)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return ref.rms_norm(x, weight, eps)


def rms_norm_cpp(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The C++ kernel (lopa_fast._C.rms_norm_cpu, float32, csrc/rms_norm_cpu.cpp): (rms_norm(x + residual), x +
    residual) in one pass a row, or (rms_norm(x), None) without a residual; fresh contiguous outputs. Within ~2 ulp
    of the torch formula (mean(x^2) summed in another order), not bitwise."""
    norm, add_norm = cpp_norms(eps)
    return (norm(x, weight), None) if residual is None else add_norm(x, residual, weight)


@functools.lru_cache(maxsize=64)
def cpp_norms(eps: float) -> tuple[Callable, Callable]:
    """(norm(x, w) -> rms_norm(x) * w, add_norm(x, residual, w) -> (rms_norm(x + residual) * w, x + residual)) on the
    C++ kernel with eps bound: `rms_norm_cpp`'s glue, one Python frame a call (a tiny CPU forward makes ~10: the layer
    loop takes these, lopa_fast.models.static_forward). float32 tensors on the CPU, weight [H]; fresh outputs. The
    module is looked up at each call, as every C++ op does (what tests spy on to see that no C++ op ran)."""
    e = float(eps)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)  # (x contiguous; empty_like: ~1 us, torch.empty(shape, dtype=, device=): ~3)
        H = x.shape[-1]
        _backend.cpp_module().rms_norm_cpu([x.data_ptr(), 0, w.data_ptr(), out.data_ptr(), 0],  # (0: no sum)
                                           [x.numel() // max(H, 1), H], e)
        return out

    def add_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_contiguous():
            x = x.contiguous()
        if not residual.is_contiguous():
            residual = residual.contiguous()
        out, s = torch.empty_like(x), torch.empty_like(x)
        H = x.shape[-1]
        _backend.cpp_module().rms_norm_cpu([x.data_ptr(), residual.data_ptr(), w.data_ptr(), out.data_ptr(),
                                            s.data_ptr()], [x.numel() // max(H, 1), H], e)
        return out, s

    return norm, add_norm


def _kernel_dtype(op, b, x):
    if x.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"{op}: x.dtype={x.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, check: bool = True, backend: str | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., H] (last dim contiguous) with weight [H] (x.dtype), HF order: in fp32
    x * rsqrt(mean(x^2) + eps), cast to x.dtype, then times weight in x.dtype. Returns [..., H] in x.dtype.
    backend: None (auto: triton on CUDA; on CPU `cpp` for float32 when lopa_fast._C is built, else torch) |
    "triton" | "cpp" (float32) | "torch" (the reference twin, bitwise the model's formula). The Triton and C++
    kernels differ only in the sum order of mean(x^2)."""
    if check:
        _check("rms_norm", x, weight, eps)
    b = _backend.float32_cpp("rms_norm", _backend.resolve("rms_norm", backend, x.device), backend, x, weight)
    if b == "torch":
        return torch_rms_norm(x, weight, eps)
    if b == "cpp":
        return rms_norm_cpp(x, None, weight, eps)[0]
    _kernel_dtype("rms_norm", b, x)
    if b == "cuda":
        return _backend.kernel("rms_norm", b)(x, weight, eps)
    return torch.ops.lopa_fast.triton_rms_norm(x, weight, float(eps))


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    check: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual step before a pre-norm: s = x + residual in x.dtype, returns (rms_norm(s), s),
    bitwise the add followed by rms_norm on the torch backend; one read of x and residual on Triton."""
    if check:
        _check("add_rms_norm", x, weight, eps, residual)
    b = _backend.float32_cpp("add_rms_norm", _backend.resolve("add_rms_norm", backend, x.device), backend, x,
                             weight)
    if b == "torch":
        s = x + residual  # ref.add_rms_norm's add
        return torch_rms_norm(s, weight, eps), s
    if b == "cpp":
        return rms_norm_cpp(x, residual, weight, eps)
    _kernel_dtype("add_rms_norm", b, x)
    if b == "cuda":
        return _backend.kernel("add_rms_norm", b)(x, residual, weight, eps)
    return torch.ops.lopa_fast.triton_add_rms_norm(x, residual, weight, float(eps))


# ------------------------------------------------------------------------------ torch custom ops (Triton)
def _triton(name):
    # both launchers live in kernels/triton/rms_norm.py (imported on first use: triton is optional)
    return getattr(importlib.import_module("lopa_fast.kernels.triton.rms_norm"), name)


@torch.library.custom_op("lopa_fast::triton_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _triton("rms_norm")(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("lopa_fast::triton_add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton("add_rms_norm")(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))
