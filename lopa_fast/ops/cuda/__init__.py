"""CUDA kernels of `kernels/cuda/*.cu`: compiled at first use with NVRTC (through CuPy), launched on
torch tensors.

The hook of lopa_fast.ops._backend: `available(op)`, `unsupported(op, *args)` and one function per op with the
public op's signature (`branch_attention`, `confidence`, `head_confidence`). Without a CUDA device or CuPy,
`available()` is False and `why_unavailable()` says why (logged once at INFO on logger "lopa_fast.ops.cuda");
the dispatch then picks triton / torch. A call the kernels cannot take (a head dim other than 64/128, a window
over 1024 positions, a dtype without an instantiation, CPU tensors) raises a ValueError naming why: an explicit
backend="cuda" never silently runs something else.

Modules, one job each:
  constants    tile sizes, instantiated dtypes / head dims, and the -D defines every .cu compile receives
  source       the .cu sources, NVRTC compile, on-disk cubin cache
  probe        whether the CUDA path can run here (and why not)
  launch       grids, splits, shared memory, workspaces, argument packing (shared by GPU and emulation)
  device       the CuPy launcher on torch's current stream
  custom_ops   the GPU entry points as torch custom ops (torch.compile / CUDA graphs see opaque ops)
  emulation    the same .cu run on CPU through kernels/cuda/host_emu.cuh (tests only)
"""
from __future__ import annotations

import torch

from lopa_fast.ops.cuda.constants import DTYPE_NAMES, HEAD_DIMS, OPS
from lopa_fast.ops.cuda.custom_ops import branch_attention_op, confidence_op, head_confidence_op, select_round_op
from lopa_fast.ops.cuda.probe import available, why_unavailable

__all__ = ["OPS", "available", "why_unavailable", "unsupported", "branch_attention", "confidence", "head_confidence",
           "select_round"]


def unsupported(op: str, *args) -> str | None:
    """Why the CUDA kernel of `op` cannot take these public-op arguments (shape / dtype), or None.
    Device and availability are the dispatcher's checks (lopa_fast.ops._backend)."""
    if op == "branch_attention":
        q = args[0]
        D = q.shape[-1]
        if D not in HEAD_DIMS:
            return f"head dim D={D} has no CUDA kernel (D in {HEAD_DIMS})"
        t = q
    elif op in ("confidence", "head_confidence"):
        t = args[0]
    elif op == "select_round":
        return None  # fixed dtypes, any shape (checked by the public op)
    else:
        return f"no CUDA kernel for op {op!r} (ops: {OPS})"
    if t.dtype not in DTYPE_NAMES:
        return f"dtype {t.dtype} has no CUDA kernel ({tuple(DTYPE_NAMES)})"
    return None


def _require(op: str, *args) -> None:
    why = unsupported(op, *args)
    dev = args[0].device
    if why is None and dev.type != "cuda":
        why = f"tensors are on {dev}"
    if why is not None:
        raise ValueError(f"cuda {op}: {why}")


def branch_attention(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens=None, block_ids=None, mode="full",
                     scale=None, return_lse=False, *, cache_index=None):
    """lopa_fast.ops.branch_attention on the CUDA kernels (inputs already checked by the public op)."""
    _require("branch_attention", q)
    scale = None if scale is None else float(scale)
    if cache_index is not None:  # pooled: [S] slot lengths and [B] slots, both read by the kernel
        o, lse = branch_attention_op(q, k_cache, v_cache, k_cache.shape[1], k_win, v_win, win_lens, block_ids, mode,
                                     scale, cache_len, cache_index)
    elif isinstance(cache_len, torch.Tensor):  # device length: read by the kernel, no host sync (graph-safe)
        o, lse = branch_attention_op(q, k_cache, v_cache, k_cache.shape[0], k_win, v_win, win_lens, block_ids, mode,
                                     scale, cache_len)
    else:
        o, lse = branch_attention_op(q, k_cache, v_cache, int(cache_len), k_win, v_win, win_lens, block_ids, mode,
                                     scale)
    return (o, lse) if return_lse else o


def confidence(logits, suppress_token=None, eps=1e-10):
    """lopa_fast.ops.confidence on the CUDA kernel; returns the 5 fields of lopa_fast.sampling.Confidence."""
    _require("confidence", logits)
    return confidence_op(logits, suppress_token, float(eps))


def head_confidence(hidden, weight, suppress_token=None, eps=1e-10, entropy=True, keep_logits=False):
    """lopa_fast.ops.head_confidence on the CUDA kernels; returns the 7 fields of lopa_fast.sampling.HeadConfidence
    (neg_entropy: zeros without entropy; logits: [0, V] unless kept)."""
    _require("head_confidence", hidden)
    return head_confidence_op(hidden, weight, suppress_token, float(eps), bool(entropy), bool(keep_logits))


def select_round(*args, bs, mask_id, eos_id, n_look, shift, blend, score_all):
    """lopa_fast.ops.select_round on the CUDA kernel (one launch); returns the 28 SelectRound fields."""
    _require("select_round", args[3])
    return select_round_op(list(args), bs, mask_id, eos_id, n_look, shift, blend, score_all)
