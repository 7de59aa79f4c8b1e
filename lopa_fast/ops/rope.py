"""`rope`: rotate-half rotary embedding of q and k (one launch), and `rope_cos_sin`, its per-forward
cos/sin table. See reference.ops.rope / rope_cos_sin.

The table is computed once per forward from a positions *tensor* with the reference's torch ops
(bitwise the model's formula; a replayed graph reads new positions, no position is a Python int);
`rope` then rotates every layer's q and k from it. The Triton launcher is registered as the torch custom
op `lopa_fast::triton_rope` (with a fake implementation), so torch.compile(fullgraph=True) and graph
capture trace through the public op without a graph break.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref

_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FLOATS = _KERNEL_FLOATS + (torch.float64,)


def _check(q, k, cos, sin, fp32):
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"rope: {name} must be a [B, n, H, D] tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"rope: {name}.dtype={t.dtype}; allowed: {_FLOATS}")
    B, n, _, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, n, D):
        raise ValueError(f"rope: k {tuple(k.shape)} must match q {tuple(q.shape)} in B, n and D")
    if k.dtype != q.dtype or k.device != q.device:
        raise TypeError(f"rope: k is {k.dtype} on {k.device}; q is {q.dtype} on {q.device}")
    if D % 2:
        raise ValueError(f"rope: head dim D={D} must be even (rotate-half)")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) not in ((n, D), (B, n, D)):
            raise ValueError(f"rope: {name} must be [n={n}, D={D}] or [B={B}, n, D], "
                             f"got {getattr(t, 'shape', type(t))}")
        if t.dtype != torch.float32 and not (t.dtype == torch.float64 and q.dtype == torch.float64):
            raise TypeError(f"rope: {name}.dtype={t.dtype}; expected float32 (from rope_cos_sin)")
        if t.device != q.device:
            raise ValueError(f"rope: {name} is on {t.device}, q on {q.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if not isinstance(fp32, bool):
        raise TypeError(f"rope: fp32={fp32!r} must be a bool")
    _backend.check_last_dim_contiguous("rope", q=q, k=k, cos=cos, sin=sin)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [..., head_dim] for integer positions [n] (or [B, n]): the table `rope` takes, computed
    once per forward (torch ops on the positions' device; no host read)."""
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        got = getattr(positions, "dtype", type(positions))
        raise TypeError(f"rope_cos_sin: positions must be an int32/int64 tensor, got {got}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_cos_sin: head_dim={head_dim!r} must be a positive even int")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"rope_cos_sin: theta={theta!r} must be a number > 0")
    return ref.rope_cos_sin(positions, head_dim, theta)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fp32: bool = False,
    *,
    check: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [B, n, Hq, D] and k [B, n, Hkv, D] (last dims contiguous; other strides free,
    e.g. slices of a merged qkv projection) with cos, sin fp32 [n, D] or [B, n, D] from rope_cos_sin.
    fp32=False: Qwen2 (cos/sin cast to the dtype, rotate in the dtype); fp32=True: LLaDA (rotate in fp32,
    cast back). Returns (q_rot, k_rot) in q's dtype.
    backend: None (auto: triton on CUDA; on CPU `cpp` for float32 when lopa_fast._C is built, else torch) |
    "triton" | "cpp" (float32 only) | "torch" (the reference twin, bitwise the model's formula). The Triton and C++
    kernels perform the same roundings in the same order (no FMA): bitwise too."""
    if check:
        _check(q, k, cos, sin, fp32)
    b = _backend.float32_cpp("rope", _backend.resolve("rope", backend, q.device), backend, q, k, cos, sin)
    if b == "torch":
        return ref.rope(q, k, cos, sin, fp32)
    if b == "cpp":
        return rope_cpp(q, k, cos, sin)
    if q.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"rope: q.dtype={q.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    if b == "cuda":
        return _backend.kernel("rope", b)(q, k, cos, sin, fp32)
    return torch.ops.lopa_fast.triton_rope(q, k, cos, sin, bool(fp32))


def rope_cpp(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ kernel (lopa_fast._C.rope_cpu, float32; its checks the caller's): q and k read through their strides,
    written as fresh contiguous [B, n, Hq, D] and [B, n, Hkv, D] (the glue is most of the call on tiny shapes: ~1.5 us
    of kernel). k_out: None, or a contiguous float32 tensor of k's numel that receives the rotated k instead (e.g.
    the cache rows of an in-cache forward: lopa_fast.models.static_forward; returned as given)."""
    return _launch(q, q.data_ptr(), q.stride(), k.data_ptr(), k.stride(), k.shape[2], cos, sin, k_out)


def rope_cpp_heads(qkv: torch.Tensor, Hq: int, Hkv: int, cos: torch.Tensor, sin: torch.Tensor,
                   k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cpp` of q and k = the first Hq and the next Hkv heads of a merged projection qkv [B, n, Hq + 2 Hkv, D]
    (float32, last dim contiguous), read in place: no slice views (two fewer torch calls a layer in the CPU fast
    forward's loop)."""
    if qkv.shape[2] != Hq + 2 * Hkv or qkv.stride(-1) != 1:
        raise ValueError(f"rope: qkv {tuple(qkv.shape)} (strides {qkv.stride()}) must be [B, n, Hq + 2 Hkv = "
                         f"{Hq + 2 * Hkv}, D] with a contiguous last dim")
    st, p = qkv.stride(), qkv.data_ptr()
    return _launch(qkv, p, st, p + Hq * st[2] * qkv.element_size(), st, Hkv, cos, sin, k_out, Hq)


def _launch(q, q_ptr: int, qs: tuple, k_ptr: int, ks: tuple, Hkv: int, cos, sin, k_out,
            Hq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """lopa_fast._C.rope_cpu on q (or the merged projection it is the first Hq heads of) and k given by pointer and
    strides; fresh contiguous outputs (k into k_out when given)."""
    B, n, H, D = q.shape
    Hq = H if Hq is None else Hq
    q_out = q.new_empty((B, n, Hq, D))
    if k_out is None:
        k_out = q.new_empty((B, n, Hkv, D))
    elif not (k_out.is_contiguous() and k_out.numel() == B * n * Hkv * D and k_out.dtype == q.dtype):
        raise ValueError(f"rope: k_out must be a contiguous {q.dtype} tensor of {B * n * Hkv * D} elements, got "
                         f"{k_out.dtype} {tuple(k_out.shape)}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    _backend.cpp_module().rope_cpu(
        [q_ptr, k_ptr, cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr()],
        [B, n, Hq, Hkv, D, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], n * D if cos.dim() == 3 else 0])
    return q_out, k_out


# ------------------------------------------------------------------------------ the torch backend, per forward
class RopeRotation(NamedTuple):
    """The per-forward form of the table for `rope_heads` (the torch backend of a layer loop)."""

    cos: torch.Tensor  # [n, 1, D] or [B, n, 1, D]: cos in the rotation's dtype
    sin: torch.Tensor  # the same shape: sin with its first half negated
    perm: torch.Tensor  # [D] long: the two halves swapped
    fp32: bool  # rotate in float32 (LLaDA), else in the heads' dtype (Qwen2)


@functools.lru_cache(maxsize=64)
def _swap_halves(D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sign [D] float32: -1 on the first half, +1 on the second; perm [D] long: the halves swapped), per head dim."""
    half = D // 2
    sign = torch.cat([torch.full((half,), -1.0), torch.ones(half)]).to(device)
    return sign, torch.cat([torch.arange(half, D), torch.arange(half)]).to(device)


def rope_rotation(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, fp32: bool) -> RopeRotation:
    """cos, sin [n, D] or [B, n, D] (rope_cos_sin) as a RopeRotation for heads of `dtype`, built once per forward
    (times -1 is exact: the negated half of sin is bitwise -sin)."""
    sign, perm = _swap_halves(cos.shape[-1], cos.device)
    dt = cos.dtype if fp32 else dtype
    return RopeRotation(cos.unsqueeze(-2).to(dt), (sin * sign.to(sin.dtype)).unsqueeze(-2).to(dt), perm, fp32)


def rope_heads(x: torch.Tensor, rot: RopeRotation) -> torch.Tensor:
    """RoPE of the heads x [B, n, H, D] (last dim contiguous; e.g. q and k side by side: the first Hq + Hkv heads
    of a merged q/k/v projection) in ONE pass: x * cos + x[..., perm] * sin', sin' = sin with its first half
    negated. Elementwise that is the reference's x * cos + rotate_half(x) * sin (rotate_half(x) = cat(-x[D/2:],
    x[:D/2]); moving the minus from x to sin is exact in IEEE arithmetic), so each head is bitwise `ref.rope`'s
    (tests/test_rope.py). Returns a contiguous [B, n, H, D] in x's dtype. 4 ops for q and k together instead of
    the reference's 14 (CPU, the tiny models' layer: 41 -> 16 us)."""
    xf = x.float() if rot.fp32 else x
    out = xf * rot.cos + xf.index_select(-1, rot.perm) * rot.sin
    return out.to(x.dtype) if rot.fp32 else out


# ------------------------------------------------------------------------------ torch custom op (Triton)
@torch.library.custom_op("lopa_fast::triton_rope", mutates_args=())
def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backend.kernel("rope", "triton")(q, k, cos, sin, fp32)


@_rope_op.register_fake
def _(q, k, cos, sin, fp32):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))
