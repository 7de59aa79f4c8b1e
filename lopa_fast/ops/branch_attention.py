"""`branch_attention`: B branch windows over one shared prefix KV cache. See reference.ops.branch_attention.

The Triton launcher is registered as a torch custom op (`lopa_fast::triton_branch_attention`, with a fake
implementation), so torch.compile(fullgraph=True) and CUDA-graph capture trace through the public op with no
graph break. cache_len may be a 0-d device tensor (graph-safe: the kernel reads it).
"""
from __future__ import annotations

import importlib
import math

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.contracts import ATTENTION_MODES

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


def _check(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode):
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"branch_attention: q must be a [B, n, Hq, D] tensor, got {getattr(q, 'shape', type(q))}")
    if q.dtype not in _FLOATS:
        raise TypeError(f"branch_attention: q.dtype={q.dtype}; allowed: {_FLOATS}")
    B, n, Hq, D = q.shape
    if k_win.shape[:2] != (B, n) or k_win.shape[3] != D or k_win.shape != v_win.shape:
        raise ValueError(
            f"branch_attention: k_win/v_win must be [B={B}, n={n}, Hkv, D={D}], got {tuple(k_win.shape)} / "
            f"{tuple(v_win.shape)}"
        )
    Hkv = k_win.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"branch_attention: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if k_cache.dim() != 3 or k_cache.shape[1:] != (Hkv, D) or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"branch_attention: k_cache/v_cache must be [Lmax, Hkv={Hkv}, D={D}], got {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}"
        )
    if isinstance(cache_len, torch.Tensor):
        if cache_len.numel() != 1 or cache_len.dtype not in _INTS or cache_len.device != q.device:
            raise ValueError(
                f"branch_attention: a tensor cache_len must be one int on {q.device}, got shape "
                f"{tuple(cache_len.shape)} {cache_len.dtype} on {cache_len.device}"
            )
    elif not 0 <= int(cache_len) <= k_cache.shape[0]:
        raise ValueError(f"branch_attention: cache_len={cache_len} not in [0, {k_cache.shape[0]}]")
    if mode not in ATTENTION_MODES:
        raise ValueError(f"branch_attention: mode={mode!r}; allowed: {ATTENTION_MODES}")
    if mode == "block_causal" and (block_ids is None or tuple(block_ids.shape) != (B, n)):
        got = None if block_ids is None else tuple(block_ids.shape)
        raise ValueError(f"branch_attention: mode='block_causal' needs block_ids [B={B}, n={n}], got {got}")
    if win_lens is not None and tuple(win_lens.shape) != (B,):
        raise ValueError(f"branch_attention: win_lens must be [B={B}], got {tuple(win_lens.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_win", k_win), ("v_win", v_win)):
        if t.dtype != q.dtype:
            raise TypeError(f"branch_attention: {name}.dtype={t.dtype} differs from q.dtype={q.dtype}")
    _backend.check_tensors("branch_attention", "q", q, [
        ("k_cache", k_cache, (q.dtype,)), ("v_cache", v_cache, (q.dtype,)), ("k_win", k_win, (q.dtype,)),
        ("v_win", v_win, (q.dtype,)), ("win_lens", win_lens, _INTS), ("block_ids", block_ids, _INTS)])
    _backend.check_last_dim_contiguous(
        "branch_attention", q=q, k_cache=k_cache, v_cache=v_cache, k_win=k_win, v_win=v_win, block_ids=block_ids
    )


def branch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor,
                     k_win: torch.Tensor, v_win: torch.Tensor, win_lens: torch.Tensor | None = None,
                     block_ids: torch.Tensor | None = None, mode: str = "full", scale: float | None = None,
                     return_lse: bool = False, check: bool = True, backend: str | None = None):
    """Attention of B branch windows over a shared committed prefix plus each branch's own window.

    q [B, n, Hq, D] attends to k/v_cache[:cache_len] ([Lmax, Hkv, D], shared by all branches, always fully
    visible) plus its own window k/v_win [B, n, Hkv, D] under `mode`:
      full: every valid window key | block_causal: key j iff block_ids[b, j] <= block_ids[b, i] |
      causal: key j iff j <= i;  window keys j >= win_lens[b] are padding (never visible).
    GQA: query head h reads kv head h // (Hq // Hkv). softmax(q k^T * scale), scale = 1/sqrt(D) by default.
    dtypes: fp16 | bf16 | fp32 (fp64 on the torch backend); fp32 accumulation.
    Returns o [B, n, Hq, D] in q.dtype, and lse [B, n, Hq] fp32 (natural log) if return_lse.
    backend: None (auto: triton on CUDA, torch on CPU) | "cuda" | "triton" | "torch"; an explicit kernel
    backend runs that kernel or raises a ValueError saying why (e.g. "cuda" has head dims 64 and 128 only).
    Matches lopa_fast.reference.ops.branch_attention (the torch backend is that reference).
    """
    if check:
        _check(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode)
    args = (q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, scale, return_lse)
    b = _backend.resolve("branch_attention", backend, q.device, args)
    if b == "torch":
        return ref.branch_attention(*args)
    if q.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"branch_attention: q.dtype={q.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    if b == "cuda":
        return _backend.kernel("branch_attention", b)(*args)
    if isinstance(cache_len, torch.Tensor):
        cl_t, cl = cache_len, k_cache.shape[0]
    else:
        cl_t, cl = None, int(cache_len)
    o, lse = torch.ops.lopa_fast.triton_branch_attention(
        q, k_cache, v_cache, cl_t, cl, k_win, v_win, win_lens, block_ids, mode,
        None if scale is None else float(scale), bool(return_lse))
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------------------ torch custom op (Triton)
def _triton():
    return importlib.import_module("lopa_fast.kernels.triton.branch_attention").branch_attention  # triton: optional


@torch.library.custom_op("lopa_fast::triton_branch_attention", mutates_args=())
def _branch_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cache_len_t: torch.Tensor | None, cache_len: int, k_win: torch.Tensor, v_win: torch.Tensor,
                         win_lens: torch.Tensor | None, block_ids: torch.Tensor | None, mode: str,
                         scale: float | None, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of the Triton launcher; cache_len_t (device length, graph-safe) wins over cache_len when given.
    lse is an empty fp32 tensor when not return_lse (an output must not alias another)."""
    cl = cache_len if cache_len_t is None else cache_len_t
    if return_lse:
        o, lse = _triton()(q, k_cache, v_cache, cl, k_win, v_win, win_lens, block_ids, mode, scale, True)
        return o, lse
    o = _triton()(q, k_cache, v_cache, cl, k_win, v_win, win_lens, block_ids, mode, scale, False)
    return o, q.new_empty(0, dtype=torch.float32)


@_branch_attention_op.register_fake
def _(q, k_cache, v_cache, cache_len_t, cache_len, k_win, v_win, win_lens, block_ids, mode, scale, return_lse):
    B, n, Hq, _ = q.shape
    lse = q.new_empty((B, n, Hq) if return_lse else (0,), dtype=torch.float32)
    return torch.empty_like(q), lse


def prefix_visibility(cache_len, lmax: int, device) -> torch.Tensor | None:
    """bool [Lmax] (row < cache_len) for a device-tensor cache_len, None for an int (the prefix is sliced)."""
    if isinstance(cache_len, torch.Tensor):
        return torch.arange(lmax, device=device) < cache_len.reshape(())
    return None


def branch_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    vis: torch.Tensor,
    prefix_ok: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """The torch backend of `branch_attention` for a layer loop: the masks come in precomputed (built once
    per forward, not per layer: `vis` = contracts.window_key_mask(...) [B, n, n], `prefix_ok` =
    prefix_visibility(...)), and each contraction is the one batched matmul the reference's einsum runs,
    so the result is bitwise the reference's (tests/test_branch_attention.py) with about a third of its
    ops. Returns o [B, n, Hq, D] in q.dtype (no lse)."""
    B, n, Hq, D = q.shape
    Hkv = k_win.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cdt = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(cdt).reshape(B, n, Hkv, G, D)
    if prefix_ok is None:
        kp, vp = k_cache[:cache_len].to(cdt), v_cache[:cache_len].to(cdt)
    else:
        kp, vp = k_cache.to(cdt), v_cache.to(cdt)
    Lp = kp.shape[0]
    kw, vw = k_win.to(cdt), v_win.to(cdt)
    # scores: [Hkv, B*G*n, D] @ [Hkv, D, Lp] (prefix) and [B*Hkv, G*n, D] @ [B*Hkv, D, n] (window)
    # einsum takes another path for a one-row prefix (measured: not bitwise the bmm); use it there
    one_row = Lp == 1
    if one_row:
        s_prefix = torch.einsum("bnhgd,lhd->bhgnl", qf, kp) * scale
    else:
        s_prefix = (qf.permute(2, 0, 3, 1, 4).reshape(Hkv, B * G * n, D) @ kp.permute(1, 2, 0)).view(
            Hkv, B, G, n, Lp).permute(1, 0, 2, 3, 4) * scale  # fmt: skip
    if prefix_ok is not None:
        s_prefix = s_prefix.masked_fill(~prefix_ok, float("-inf"))
    s_win = (qf.permute(0, 2, 3, 1, 4).reshape(B * Hkv, G * n, D) @ kw.permute(0, 2, 3, 1).reshape(B * Hkv, D, n)
             ).view(B, Hkv, G, n, n) * scale  # fmt: skip
    s_win = s_win.masked_fill(~vis[:, None, None], float("-inf"))
    s = torch.cat([s_prefix, s_win], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    if one_row:
        o_prefix = torch.einsum("bhgnl,lhd->bnhgd", p[..., :Lp], vp)
    else:
        o_prefix = (p[..., :Lp].permute(1, 0, 2, 3, 4).reshape(Hkv, B * G * n, Lp) @ vp.permute(1, 0, 2)).view(
            Hkv, B, G, n, D).permute(1, 3, 0, 2, 4)  # fmt: skip
    o_win = (p[..., Lp:].reshape(B * Hkv, G * n, n) @ vw.permute(0, 2, 1, 3).reshape(B * Hkv, n, D)).view(
        B, Hkv, G, n, D).permute(0, 3, 1, 2, 4)  # fmt: skip
    return (o_prefix + o_win).reshape(B, n, Hq, D).to(q.dtype)
