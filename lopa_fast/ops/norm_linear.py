"""`norm_linear`: a decoder layer's pre-norm GEMM with its neighbours fused (the residual add and RMSNorm as the
prologue, SwiGLU or RoPE as the epilogue; one launch where the layer ran three). See reference.ops.norm_linear.

The Triton launcher is registered as the torch custom op `lopa_fast::triton_norm_linear` (with a fake
implementation), so torch.compile(fullgraph=True) and graph capture trace through the public op.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref

_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FLOATS = _KERNEL_FLOATS + (torch.float64,)
OP = "norm_linear"


class NormLinear(NamedTuple):
    out: torch.Tensor  # [..., F] ("swiglu") or [..., N] ("rope"), contiguous
    residual: torch.Tensor | None  # s = x + residual [..., K] (the next residual), or None without one


def _check(x, weight, epilogue, norm_weight, residual, eps, bias, cos, sin, rot_heads, positions=None,
           inv_freq=None):
    if epilogue not in ref.NORM_LINEAR_EPILOGUES:
        raise ValueError(f"{OP}: epilogue={epilogue!r}; allowed: {', '.join(ref.NORM_LINEAR_EPILOGUES)}")
    for name, t, dims in (("x", x, "[..., K]"), ("weight", weight, "[N, K]")):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"{OP}: {name} must be a {dims} tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{OP}: {name}.dtype={t.dtype}; allowed: {_FLOATS}")
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{OP}: weight {tuple(weight.shape)} must be [N, K] with K = x.shape[-1] = {K}")
    expect = {"norm_weight": (K,), "residual": tuple(x.shape), "bias": (weight.shape[0],)}
    for name, t in (("norm_weight", norm_weight), ("residual", residual), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != expect[name]:
            raise ValueError(f"{OP}: {name} must be None or a tensor of shape {expect[name]}, got "
                             f"{getattr(t, 'shape', type(t))}")
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(f"{OP}: x is {x.dtype} on {x.device}; {name} is {t.dtype} on {t.device}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"{OP}: x is {x.dtype} on {x.device}; weight is {weight.dtype} on {weight.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{OP}: eps={eps!r}; allowed: a float >= 0")
    if epilogue == "swiglu":
        if weight.shape[0] % 2:
            raise ValueError(f"{OP}: epilogue 'swiglu' needs the merged gate/up weight [2F, K], got {weight.shape[0]} "
                             "rows (odd)")
        if cos is not None or sin is not None or positions is not None or inv_freq is not None:
            raise ValueError(f"{OP}: cos / sin (or positions / inv_freq) belong to epilogue 'rope', not 'swiglu'")
    elif positions is not None or inv_freq is not None:
        _check_positions(x, weight, cos, sin, rot_heads, positions, inv_freq)
    else:
        _check_rope(x, weight, cos, sin, rot_heads)
    _backend.check_last_dim_contiguous(OP, x=x, weight=weight, residual=residual, cos=cos, sin=sin)


def _check_rope(x, weight, cos, sin, rot_heads):
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        raise ValueError(f"{OP}: epilogue 'rope' needs cos and sin tensors [n, D] or [B, n, D]")
    if x.dim() < 2:
        raise ValueError(f"{OP}: epilogue 'rope' needs x [..., n, K] (a token dim), got {tuple(x.shape)}")
    D = cos.shape[-1]
    n = x.shape[-2]
    ok_shape = cos.shape == sin.shape and (tuple(cos.shape) == (n, D) or (
        cos.dim() == 3 and x.dim() == 3 and tuple(cos.shape) == (x.shape[0], n, D)))
    if not ok_shape or D < 2 or D % 2:
        raise ValueError(f"{OP}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [n, D] or [B, n, D] "
                         f"with n = {n} (x {tuple(x.shape)}) and an even D")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.device != x.device:
        raise TypeError(f"{OP}: cos / sin must be float32 on {x.device}, got {cos.dtype} / {sin.dtype} on {cos.device}")
    if weight.shape[0] % D:
        raise ValueError(f"{OP}: weight has {weight.shape[0]} rows; epilogue 'rope' needs whole heads of D = {D}")
    heads = weight.shape[0] // D
    if isinstance(rot_heads, bool) or not isinstance(rot_heads, int) or not 0 <= rot_heads <= heads:
        raise ValueError(f"{OP}: rot_heads={rot_heads!r}; allowed: an int in [0, {heads}] (the weight's heads)")


def _check_positions(x, weight, cos, sin, rot_heads, positions, inv_freq):
    if cos is not None or sin is not None:
        raise ValueError(f"{OP}: pass cos / sin or positions / inv_freq, not both")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 \
            or inv_freq.device != x.device:
        raise ValueError(f"{OP}: inv_freq must be a float32 [D / 2] tensor on {x.device} (with positions), got "
                         f"{getattr(inv_freq, 'dtype', type(inv_freq))} {tuple(getattr(inv_freq, 'shape', ()))}")
    n = x.shape[-2] if x.dim() >= 2 else -1
    ok = isinstance(positions, torch.Tensor) and positions.dtype in (torch.int32, torch.int64) \
        and positions.device == x.device and (tuple(positions.shape) == (n,) or (
            positions.dim() == 2 and x.dim() == 3 and tuple(positions.shape) == (x.shape[0], n)))
    if not ok:
        raise ValueError(f"{OP}: positions must be an int [n] or [B, n] tensor on {x.device} with n = {n} "
                         f"(x {tuple(x.shape)}), got {getattr(positions, 'dtype', type(positions))} "
                         f"{tuple(getattr(positions, 'shape', ()))}")
    D = 2 * inv_freq.shape[0]
    if weight.shape[0] % D:
        raise ValueError(f"{OP}: weight has {weight.shape[0]} rows; epilogue 'rope' needs whole heads of D = {D}")
    heads = weight.shape[0] // D
    if isinstance(rot_heads, bool) or not isinstance(rot_heads, int) or not 0 <= rot_heads <= heads:
        raise ValueError(f"{OP}: rot_heads={rot_heads!r}; allowed: an int in [0, {heads}] (the weight's heads)")
    if positions.dim() and positions.shape[-1] > 1 and positions.stride(-1) != 1:
        raise ValueError(f"{OP}: positions needs a contiguous last dim, got strides {positions.stride()}")


def norm_linear(x: torch.Tensor, weight: torch.Tensor, epilogue: str, *, norm_weight: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, eps: float = 1e-6, bias: torch.Tensor | None = None,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, rot_heads: int = 0,
                rope_fp32: bool = False, positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                check: bool = True, backend: str | None = None) -> NormLinear:
    """s = x + residual (when given), h = rms_norm(s, norm_weight, eps) (when given), y = F.linear(h, weight, bias),
    then epilogue "swiglu" (weight = the merged gate/up [2F, K], gate rows first: out = silu(gate) * up [..., F]) or
    "rope" (weight = the merged q/k/v [H D, K], x [..., n, K], cos / sin fp32 [n, D] or [B, n, D]: out = y [..., H D]
    with its first rot_heads heads rotated, in float32 when rope_fp32; or, instead of cos / sin, positions int [n] or
    [B, n] and inv_freq fp32 [D / 2]: the kernel forms the tables itself, as DecoderLM.rope_tables does, so a round
    with a device window start needs no table kernels). One dtype, last dims contiguous.
    backend: None (auto: triton on CUDA, torch on CPU) | "triton" | "torch" (the reference: the model's separate ops,
    bit for bit). The kernel sums the norm's squares and the GEMM in its own order and rounds every intermediate as
    the reference does. Returns NormLinear(out, residual = s or None)."""
    if check:
        _check(x, weight, epilogue, norm_weight, residual, eps, bias, cos, sin, rot_heads, positions, inv_freq)
    b = _backend.resolve(OP, backend, x.device)
    if b == "torch":
        return NormLinear(*ref.norm_linear(x, weight, epilogue, norm_weight, residual, eps, bias, cos, sin, rot_heads,
                                           rope_fp32, positions, inv_freq))
    if x.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"{OP}: x.dtype={x.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    out, s = torch.ops.lopa_fast.triton_norm_linear(x, weight, epilogue, norm_weight, residual, float(eps), bias,
                                                     cos, sin, int(rot_heads), bool(rope_fp32), positions, inv_freq)
    return NormLinear(out, s if residual is not None else None)


# ------------------------------------------------------------------------------ torch custom op (Triton)
@torch.library.custom_op("lopa_fast::triton_norm_linear", mutates_args=())
def _norm_linear_op(x: torch.Tensor, weight: torch.Tensor, epilogue: str, norm_weight: torch.Tensor | None,
                    residual: torch.Tensor | None, eps: float, bias: torch.Tensor | None, cos: torch.Tensor | None,
                    sin: torch.Tensor | None, rot_heads: int, rope_fp32: bool, positions: torch.Tensor | None = None,
                    inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out, s = _backend.kernel(OP, "triton")(x, weight, epilogue, norm_weight, residual, eps, bias, cos, sin, rot_heads,
                                           rope_fp32, positions, inv_freq)
    return out, (s if s is not None else x.new_empty(0))  # (a custom op returns tensors: no residual -> [0])


@_norm_linear_op.register_fake
def _(x, weight, epilogue, norm_weight, residual, eps, bias, cos, sin, rot_heads, rope_fp32, positions=None,
      inv_freq=None):
    cols = weight.shape[0] // 2 if epilogue == "swiglu" else weight.shape[0]
    return x.new_empty((*x.shape[:-1], cols)), (x.new_empty(x.shape) if residual is not None else x.new_empty(0))
