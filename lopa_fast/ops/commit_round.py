"""`commit_round`: a D2F / LoPA round's commit in place, the winner's span of window K/V into the cache and (under
Dream's shift) the next last_logit row. See reference.ops.commit_round (the oracle, and the `torch` backend).

Backends: `triton` (one launch: kernels/triton/commit_round.py, where a captured round's torch form is ~15 graph
nodes) and `torch`. The Triton launcher is the torch custom op `lopa_fast::triton_commit_round` (mutating its
cache and last_logit arguments), so compiled and captured rounds trace through it. Both write the same values
(copies); only the trash row differs (the kernel writes none).
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref

OP = "commit_round"


def commit_round(cache_k: torch.Tensor, cache_v: torch.Tensor, cache_len: torch.Tensor, k_win: torch.Tensor,
                 v_win: torch.Tensor, winner: torch.Tensor, u: torch.Tensor, last_logit: torch.Tensor | None = None,
                 logits: torch.Tensor | None = None, last_row: torch.Tensor | None = None, *, check: bool = True,
                 backend: str | None = None) -> None:
    """In place: cache_k / cache_v [layers, Lc, Hkv, D] rows cache_len + i (i < u) <- the winner's window rows i of
    k_win / v_win [layers, NB, Nb, Hkv, D]; with last_logit [V] (Dream's shift): last_logit <- logits [R, V] row
    last_row - 1 when u > 0 and last_row > 0. cache_len, winner, u, last_row: 0-d int tensors on the device (no host
    read). backend: None (auto: triton on CUDA, torch on CPU) | "triton" | "torch"."""
    if check:
        _check(cache_k, cache_v, cache_len, k_win, v_win, winner, u, last_logit, logits, last_row)
    b = _backend.resolve(OP, backend, k_win.device)
    if b == "torch":
        return ref.commit_round(cache_k, cache_v, cache_len, k_win, v_win, winner, u, last_logit, logits, last_row)
    torch.ops.lopa_fast.triton_commit_round(cache_k, cache_v, cache_len, k_win, v_win, winner, u, last_logit, logits,
                                            last_row)
    return None


def _check(cache_k, cache_v, cache_len, k_win, v_win, winner, u, last_logit, logits, last_row) -> None:
    for name, t in (("cache_k", cache_k), ("cache_v", cache_v), ("k_win", k_win), ("v_win", v_win)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a tensor, got {type(t).__name__}")
    if cache_k.dim() != 4 or cache_v.shape != cache_k.shape:
        raise ValueError(f"{OP}: cache_k / cache_v must be one [layers, Lc, Hkv, D] shape, got "
                         f"{tuple(cache_k.shape)} / {tuple(cache_v.shape)}")
    want = (cache_k.shape[0], cache_k.shape[2], cache_k.shape[3])
    if k_win.dim() != 5 or v_win.shape != k_win.shape or (k_win.shape[0], *k_win.shape[3:]) != want:
        raise ValueError(f"{OP}: k_win / v_win must be one [layers, NB, Nb, Hkv, D] shape matching the cache "
                         f"{tuple(cache_k.shape)}, got {tuple(k_win.shape)} / {tuple(v_win.shape)}")
    if k_win.dtype != cache_k.dtype or v_win.dtype != cache_k.dtype or cache_v.dtype != cache_k.dtype:
        raise TypeError(f"{OP}: the caches and windows must share one dtype, got {cache_k.dtype}, {cache_v.dtype}, "
                        f"{k_win.dtype}, {v_win.dtype}")
    for name, t in (("cache_len", cache_len), ("winner", winner), ("u", u)) + \
            ((("last_row", last_row),) if last_logit is not None else ()):
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype not in (torch.int32, torch.int64) \
                or t.device != k_win.device:
            raise ValueError(f"{OP}: {name} must be a 0-d int tensor on {k_win.device}, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if last_logit is not None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or last_logit.dim() != 1 \
                or logits.shape[1] != last_logit.shape[0] or logits.dtype != last_logit.dtype:
            raise ValueError(f"{OP}: last_logit [V] needs logits [R, V] of its dtype, got "
                             f"{tuple(last_logit.shape)} {last_logit.dtype} / {tuple(getattr(logits, 'shape', ()))} "
                             f"{getattr(logits, 'dtype', None)}")
    _backend.check_last_dim_contiguous(OP, cache_k=cache_k, cache_v=cache_v, k_win=k_win, v_win=v_win,
                                       last_logit=last_logit, logits=logits)
    for name, t in (("cache_k", cache_k), ("cache_v", cache_v), ("k_win", k_win), ("v_win", v_win)):
        if t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]:  # a row's Hkv x D values in one run
            raise ValueError(f"{OP}: {name}'s [Hkv, D] rows must be contiguous, got strides {t.stride()}")


# ------------------------------------------------------------------------------ torch custom op (Triton)
@torch.library.custom_op("lopa_fast::triton_commit_round", mutates_args=("cache_k", "cache_v", "last_logit"))
def _commit_round_op(cache_k: torch.Tensor, cache_v: torch.Tensor, cache_len: torch.Tensor, k_win: torch.Tensor,
                     v_win: torch.Tensor, winner: torch.Tensor, u: torch.Tensor, last_logit: torch.Tensor | None,
                     logits: torch.Tensor | None, last_row: torch.Tensor | None) -> None:
    _backend.kernel(OP, "triton")(cache_k, cache_v, cache_len, k_win, v_win, winner, u, last_logit, logits, last_row)


@_commit_round_op.register_fake
def _(cache_k, cache_v, cache_len, k_win, v_win, winner, u, last_logit, logits, last_row):
    return None
