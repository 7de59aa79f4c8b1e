"""`branch_attention`: B branch windows over one shared prefix KV cache. See reference.ops.branch_attention.

The Triton launcher is registered as a torch custom op (`lopa_fast::triton_branch_attention`, with a fake
implementation), so torch.compile(fullgraph=True) and CUDA-graph capture trace through the public op with no
graph break. cache_len may be a 0-d device tensor (graph-safe: the kernel reads it).
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.reference.attention_modes import ATTENTION_MODES

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


def _check(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, cache_index=None):
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
    if cache_index is not None:
        _check_pool(q, k_cache, v_cache, cache_len, cache_index, Hkv)
    elif k_cache.dim() != 3 or k_cache.shape[1:] != (Hkv, D) or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"branch_attention: k_cache/v_cache must be [Lmax, Hkv={Hkv}, D={D}] (a pool [S, Lmax, Hkv, D] needs "
            f"cache_index), got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    elif isinstance(cache_len, torch.Tensor):
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


def _check_pool(q, k_cache, v_cache, cache_len, cache_index, Hkv):
    """The pooled form's extra contract: cache_index [B] int on q's device with values in [0, S); k/v_cache a pool
    [S, Lmax, Hkv, D]; cache_len an [S] int tensor on q's device with the referenced slots' lengths in [0, Lmax].
    The value checks read the device (once, here at the API boundary; check=False skips them)."""
    B, D = q.shape[0], q.shape[3]
    if not isinstance(cache_index, torch.Tensor) or tuple(cache_index.shape) != (B,):
        raise ValueError(f"branch_attention: cache_index must be a [B={B}] int tensor, got "
                         f"{tuple(getattr(cache_index, 'shape', ())) or type(cache_index).__name__}")
    if cache_index.dtype not in _INTS or cache_index.device != q.device:
        raise ValueError(f"branch_attention: cache_index must be an int tensor on {q.device}, got {cache_index.dtype} "
                         f"on {cache_index.device}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (Hkv, D) or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"branch_attention: with cache_index, k_cache/v_cache must be a pool [S, Lmax, Hkv={Hkv}, D={D}], got "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    S, Lmax = k_cache.shape[:2]
    if (not isinstance(cache_len, torch.Tensor) or tuple(cache_len.shape) != (S,) or cache_len.dtype not in _INTS
            or cache_len.device != q.device):
        got = repr(cache_len)
        if isinstance(cache_len, torch.Tensor):
            got = f"{tuple(cache_len.shape)} {cache_len.dtype} on {cache_len.device}"
        raise ValueError(f"branch_attention: with cache_index, cache_len must be an [S={S}] int tensor on {q.device} "
                         f"(one prefix length per pool slot), got {got}")
    if B == 0:
        return
    lo, hi = int(cache_index.min()), int(cache_index.max())
    if lo < 0 or hi >= S:
        raise ValueError(f"branch_attention: cache_index values must be in [0, S={S}), got min {lo} max {hi}")
    used = cache_len.index_select(0, cache_index.long())
    lo, hi = int(used.min()), int(used.max())
    if lo < 0 or hi > Lmax:
        raise ValueError(f"branch_attention: cache_len of the indexed slots must be in [0, Lmax={Lmax}], got min "
                         f"{lo} max {hi}")


def branch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor,
                     k_win: torch.Tensor, v_win: torch.Tensor, win_lens: torch.Tensor | None = None,
                     block_ids: torch.Tensor | None = None, mode: str = "full", scale: float | None = None,
                     return_lse: bool = False, check: bool = True, backend: str | None = None, *,
                     cache_index: torch.Tensor | None = None):
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
    Pooled form (several requests in one call; one request is S = 1): cache_index [B] int selects each row's
    slot of a pool k/v_cache [S, Lmax, Hkv, D] (one layer), cache_len is then an [S] int tensor on q's device
    (per-slot prefix length, read by the kernels, never on the host: graph-safe). Row b's result is bitwise
    the single-request call for that row alone on its slot (q[b:b+1], k_cache[slot], cache_len[slot] as a 0-d
    tensor) on the same backend: the kernels split every row's prefix exactly as a B = 1 call would, so a
    request's sums never depend on which other requests share the call (tests/test_branch_attention.py).
    check=True validates shapes, dtypes, devices and (one host read) the index and length ranges.
    Matches lopa_fast.reference.ops.branch_attention (the torch backend is that reference).
    """
    if check:
        _check(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, cache_index)
    args = (q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, scale, return_lse)
    b = _backend.resolve("branch_attention", backend, q.device, args)
    if b == "torch":
        return ref.branch_attention(*args, cache_index=cache_index)
    if q.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"branch_attention: q.dtype={q.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    if b == "cuda":
        return _backend.kernel("branch_attention", b)(*args, cache_index=cache_index)
    if isinstance(cache_len, torch.Tensor):
        cl_t, cl = cache_len, k_cache.shape[-3]
    else:
        cl_t, cl = None, int(cache_len)
    o, lse = torch.ops.lopa_fast.triton_branch_attention(
        q, k_cache, v_cache, cl_t, cl, k_win, v_win, win_lens, block_ids, mode,
        None if scale is None else float(scale), bool(return_lse), cache_index)
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------------------ torch custom op (Triton)
def _triton():
    return importlib.import_module("lopa_fast.kernels.triton.branch_attention").branch_attention  # triton: optional


@torch.library.custom_op("lopa_fast::triton_branch_attention", mutates_args=())
def _branch_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cache_len_t: torch.Tensor | None, cache_len: int, k_win: torch.Tensor, v_win: torch.Tensor,
                         win_lens: torch.Tensor | None, block_ids: torch.Tensor | None, mode: str,
                         scale: float | None, return_lse: bool,
                         cache_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of the Triton launcher; cache_len_t (device length, graph-safe) wins over cache_len when given.
    cache_index [B] (pooled form): k/v_cache are a pool [S, Lmax, Hkv, D] and cache_len_t the [S] lengths.
    lse is an empty fp32 tensor when not return_lse (an output must not alias another)."""
    cl = cache_len if cache_len_t is None else cache_len_t
    if return_lse:
        o, lse = _triton()(q, k_cache, v_cache, cl, k_win, v_win, win_lens, block_ids, mode, scale, True,
                           cache_index=cache_index)
        return o, lse
    o = _triton()(q, k_cache, v_cache, cl, k_win, v_win, win_lens, block_ids, mode, scale, False,
                  cache_index=cache_index)
    return o, q.new_empty(0, dtype=torch.float32)


@_branch_attention_op.register_fake
def _(q, k_cache, v_cache, cache_len_t, cache_len, k_win, v_win, win_lens, block_ids, mode, scale, return_lse,
      cache_index=None):
    B, n, Hq, _ = q.shape
    lse = q.new_empty((B, n, Hq) if return_lse else (0,), dtype=torch.float32)
    return torch.empty_like(q), lse


def sdpa_mask(vis: torch.Tensor, cache_len, lmax: int) -> torch.Tensor:
    """branch_attention_sdpa's key mask, built once per forward: bool [B, 1, n, Lp + n] = [the prefix rows ; the
    window keys' visibility vis [B, n, n]]. A host-int cache_len: its Lp = cache_len sliced rows, all visible; a
    device one (0-d): the static buffer's Lp = lmax rows, those >= cache_len hidden (no host read)."""
    B, n = vis.shape[:2]
    if torch.is_tensor(cache_len):
        ok = (torch.arange(lmax, device=vis.device) < cache_len.reshape(())).expand(B, n, lmax)
    else:
        ok = vis.new_ones(B, n, cache_len)
    return torch.cat([ok, vis], dim=-1)[:, None]


def window_in_cache_sdpa(q, k, v, mask, scale=None) -> torch.Tensor:
    """`branch_attention_sdpa` for one row (B = 1) whose window K/V already sit in the cache after the prefix: k, v
    [1, Hkv, cache_len + n, D] (the cache's first rows as SDPA reads them: `cache[:, None].transpose(1, 2)` views),
    mask None or [1, 1, n, cache_len + n]. The same SDPA call on the same keys in the same layout as the
    concatenation's (bitwise), without copying the prefix. Returns o [1, n, Hq, D] in q.dtype."""
    Hq = q.shape[2]
    if q.dtype != torch.promote_types(q.dtype, torch.float32):  # half types: in float32, as branch_attention_sdpa
        o = window_in_cache_sdpa(q.float(), k.float(), v.float(), mask, scale)
        return o.to(q.dtype)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != Hq).transpose(1, 2)


def branch_attention_sdpa(q, k_cache, v_cache, cache_len, k_win, v_win, mask, scale=None) -> torch.Tensor:
    """The torch backend of `branch_attention` as upstream computes attention: ONE F.scaled_dot_product_attention
    over the concatenated [prefix ; window] keys (GQA via enable_gqa), `mask` = sdpa_mask(...) [B, 1, n, Lp + n]
    (Lp = cache_len for an int, else the buffer's Lmax rows). One aten call a layer instead of the split formula's
    ~20 (prefix and window scores, two masks, a concat, logsumexp, two output GEMMs); equal to it within float
    rounding, NOT bitwise: another summation order (docs/fast_decoder.md "Parity").
    Returns o [B, n, Hq, D] in q.dtype."""
    B, n, Hq, D = q.shape
    cdt = torch.promote_types(q.dtype, torch.float32)
    up = (lambda t: t) if q.dtype == cdt else (lambda t: t.to(cdt))  # fp32 / fp64: no cast (7 calls a layer saved)
    kp, vp = (k_cache, v_cache) if torch.is_tensor(cache_len) else (k_cache[:cache_len], v_cache[:cache_len])
    k = torch.cat([up(kp).expand(B, *kp.shape), up(k_win)], dim=1).transpose(1, 2)  # [B, Hkv, Lp + n, D]
    v = torch.cat([up(vp).expand(B, *vp.shape), up(v_win)], dim=1).transpose(1, 2)
    o = F.scaled_dot_product_attention(up(q).transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=k.shape[1] != Hq).transpose(1, 2)
    return o if q.dtype == cdt else o.to(q.dtype)
