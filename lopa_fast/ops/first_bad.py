"""`first_bad`: the fused LM head's numerics guard, rows[r] of the first real row whose logits were not all finite
(`ops.head_confidence`'s `finite`), else -1. See reference.ops.first_bad (the oracle, and the `torch` backend).

Backends: `triton` (one launch: kernels/triton/first_bad.py; the torch form is ~8 graph nodes of a captured round)
and `torch`. The Triton launcher is the torch custom op `lopa_fast::triton_first_bad` (with a fake), so compiled and
captured rounds trace through it. Both return the same value (an index or -1: exact).
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref

OP = "first_bad"


def first_bad(ok: torch.Tensor, rows: torch.Tensor, n_real, none: int, *, check: bool = True,
              backend: str | None = None) -> torch.Tensor:
    """0-d long: rows[r] of the first of the n_real real rows r with ok[r] False, else -1. ok [R] bool; rows [R]
    long (the rows' flat window rows, real rows first and ascending); n_real: a host int or a 0-d long tensor on
    ok's device (read by the kernel: no host read); none: an int above every flat row.
    backend: None (auto: triton on CUDA, torch on CPU) | "triton" | "torch"."""
    if check:
        _check(ok, rows, n_real, none)
    b = _backend.resolve(OP, backend, ok.device)
    if b == "torch":
        return ref.first_bad(ok, rows, n_real, none)
    if torch.is_tensor(n_real):
        return torch.ops.lopa_fast.triton_first_bad(ok, rows, n_real, 0, int(none))
    return torch.ops.lopa_fast.triton_first_bad(ok, rows, None, int(n_real), int(none))


def _check(ok, rows, n_real, none) -> None:
    if not isinstance(ok, torch.Tensor) or ok.dim() != 1 or ok.dtype != torch.bool:
        raise ValueError(f"{OP}: ok must be a [R] bool tensor, got {getattr(ok, 'dtype', type(ok))} "
                         f"{tuple(getattr(ok, 'shape', ()))}")
    if not isinstance(rows, torch.Tensor) or rows.shape != ok.shape or rows.dtype != torch.long \
            or rows.device != ok.device:
        raise ValueError(f"{OP}: rows must be a [R={ok.shape[0]}] long tensor on {ok.device}, got "
                         f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}")
    if torch.is_tensor(n_real):
        if n_real.dim() != 0 or n_real.dtype not in (torch.int32, torch.int64) or n_real.device != ok.device:
            raise ValueError(f"{OP}: a tensor n_real must be a 0-d int tensor on {ok.device}, got {n_real.dtype} "
                             f"{tuple(n_real.shape)} on {n_real.device}")
    elif isinstance(n_real, bool) or not isinstance(n_real, int) or n_real < 0:
        raise ValueError(f"{OP}: n_real={n_real!r}; allowed: an int >= 0 or a 0-d int tensor")
    if isinstance(none, bool) or not isinstance(none, int):
        raise ValueError(f"{OP}: none={none!r}; allowed: an int above every flat row")


# ------------------------------------------------------------------------------ torch custom op (Triton)
@torch.library.custom_op("lopa_fast::triton_first_bad", mutates_args=())
def _first_bad_op(ok: torch.Tensor, rows: torch.Tensor, n_t: torch.Tensor | None, n_int: int,
                  none: int) -> torch.Tensor:
    return _backend.kernel(OP, "triton")(ok, rows, n_t if n_t is not None else n_int, none)


@_first_bad_op.register_fake
def _(ok, rows, n_t, n_int, none):
    return ok.new_empty((), dtype=torch.long)
