"""`select_round`: one D2F/LoPA selection round on the device. See reference.ops.select_round (the contract)."""
from __future__ import annotations

import importlib
import math

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.contracts import COMPARATORS, RoundSelection

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)
_MASKS = (torch.bool, torch.uint8, torch.int8)


def _check(accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp, alpha,
           creation_conf, branch_active):
    if not isinstance(conf, torch.Tensor) or conf.dim() != 2:
        raise ValueError(f"select_round: conf must be a [B, n] tensor, got {getattr(conf, 'shape', type(conf))}")
    B, n = conf.shape
    shaped = (("accept_value", accept_value), ("masked", masked), ("block_ids", block_ids))
    for name, t in shaped:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, n):
            raise ValueError(f"select_round: {name} must be [B={B}, n={n}], got {getattr(t, 'shape', type(t))}")
    if not isinstance(block_complete, torch.Tensor) or block_complete.dim() != 2 or block_complete.shape[0] != B:
        raise ValueError(
            f"select_round: block_complete must be [B={B}, nb], got {getattr(block_complete, 'shape', None)}"
        )
    for name, t in (("creation_conf", creation_conf), ("branch_active", branch_active)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (B,)):
            raise ValueError(f"select_round: {name} must be [B={B}] or None, got {getattr(t, 'shape', type(t))}")
    dtypes = (
        ("accept_value", accept_value, _FLOATS), ("conf", conf, _FLOATS), ("masked", masked, _MASKS),
        ("block_ids", block_ids, _INTS), ("block_complete", block_complete, _MASKS),
        ("creation_conf", creation_conf, _FLOATS), ("branch_active", branch_active, _MASKS),
    )
    _backend.check_tensors("select_round", "conf", conf, dtypes)
    if comparator not in COMPARATORS:
        raise ValueError(f"select_round: comparator={comparator!r}; allowed: {COMPARATORS}")
    if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not math.isfinite(tau):
        raise ValueError(f"select_round: tau={tau!r} must be a finite float")
    if isinstance(n_look, bool) or not isinstance(n_look, int) or not 0 <= n_look <= n:
        raise ValueError(f"select_round: n_look={n_look!r} must be an int in [0, n={n}]")
    if not isinstance(topp, (int, float)) or not 0 < topp <= 1:
        raise ValueError(f"select_round: topp={topp!r} must be in (0, 1]")
    if not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"select_round: alpha={alpha!r} must be in [0, 1]")
    _backend.check_last_dim_contiguous(
        "select_round", accept_value=accept_value, conf=conf, masked=masked, block_ids=block_ids,
        block_complete=block_complete,
    )


def select_round(accept_value: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor, block_ids: torch.Tensor,
                 block_complete: torch.Tensor, tau: float, comparator: str = "gt", n_look: int = 0, topp: float = 1.0,
                 alpha: float = 0.0, creation_conf: torch.Tensor | None = None,
                 branch_active: torch.Tensor | None = None, *, check: bool = True,
                 backend: str | None = None) -> RoundSelection:
    """Threshold accept + at-least-one fallback + top-n_look lookahead positions + branch score + winner for
    B branch windows of n positions, all on the device (no host sync).

    accept_value/conf [B, n] float, masked [B, n] bool, block_ids [B, n] int (-1 = not in an active block),
    block_complete [B, nb] bool, creation_conf [B] | None, branch_active [B] bool | None.
    comparator: "gt" (D2F p > tau) | "ge" (Fast-dLLM p >= tau) | "le" (dParallel H <= tau).
    Returns RoundSelection(accept bool [B, n], lookahead int64 [B, n_look] (-1 padded), score fp32 [B],
    winner int64 0-d (-1 if no branch is active)). The exact contract is the docstring of
    lopa_fast.reference.ops.select_round (the torch backend is that reference).
    backend: None (auto: triton on CUDA, torch on CPU) | "cuda" | "triton" | "torch"; an explicit kernel
    backend runs that kernel or raises a ValueError saying why (e.g. "cuda" takes windows of <= 1024 positions).
    """
    if check:
        _check(accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp, alpha,
               creation_conf, branch_active)
    args = (accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp, alpha,
            creation_conf, branch_active)
    b = _backend.resolve("select_round", backend, conf.device, args)
    if b == "torch":
        return ref.select_round(*args)
    for name, t in (("accept_value", accept_value), ("conf", conf), ("creation_conf", creation_conf)):
        if t is not None and t.dtype not in _KERNEL_FLOATS:
            raise TypeError(f"select_round: {name}.dtype={t.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    if b == "cuda":
        return RoundSelection(*_backend.kernel("select_round", b)(*args))
    return RoundSelection(*torch.ops.lopa_fast.triton_select_round(
        accept_value, conf, masked, block_ids, block_complete, float(tau), comparator, int(n_look), float(topp),
        float(alpha), creation_conf, branch_active))


# ------------------------------------------------------------------------------ torch custom op (Triton)
# Registered so that torch.compile(fullgraph=True) and CUDA-graph capture trace through the public op; the
# op returns plain tensors and the namedtuple is rebuilt outside it.
@torch.library.custom_op("lopa_fast::triton_select_round", mutates_args=())
def _select_round_op(accept_value: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor, block_ids: torch.Tensor,
                     block_complete: torch.Tensor, tau: float, comparator: str, n_look: int, topp: float,
                     alpha: float, creation_conf: torch.Tensor | None, branch_active: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    launch = importlib.import_module("lopa_fast.kernels.triton.select_round").select_round  # triton: optional
    accept, look, score, winner = launch(accept_value, conf, masked, block_ids, block_complete, tau, comparator,
                                         n_look, topp, alpha, creation_conf, branch_active)
    return accept, look, score, winner


@_select_round_op.register_fake
def _(accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp, alpha, creation_conf,
      branch_active):
    B, n = conf.shape
    return (conf.new_empty((B, n), dtype=torch.bool), conf.new_empty((B, n_look), dtype=torch.int64),
            conf.new_empty(B, dtype=torch.float32), conf.new_empty((), dtype=torch.int64))
