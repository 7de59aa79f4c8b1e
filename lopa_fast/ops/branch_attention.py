"""`branch_attention`: B branch windows over one shared prefix KV cache. See reference.ops.branch_attention."""
from __future__ import annotations

import torch

from lopa_fast.reference import ops as ref
from lopa_fast.reference.ops import ATTENTION_MODES


def _check(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode):
    if q.dim() != 4:
        raise ValueError(f"branch_attention: q must be [B, n, Hq, D], got shape {tuple(q.shape)}")
    B, n, Hq, D = q.shape
    if k_win.shape[:2] != (B, n) or k_win.shape[3] != D or k_win.shape != v_win.shape:
        raise ValueError(
            f"branch_attention: k_win/v_win must be [B={B}, n={n}, Hkv, D={D}], got {tuple(k_win.shape)} / "
            f"{tuple(v_win.shape)}"
        )
    Hkv = k_win.shape[2]
    if Hq % Hkv:
        raise ValueError(f"branch_attention: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if k_cache.dim() != 3 or k_cache.shape[1:] != (Hkv, D) or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"branch_attention: k_cache/v_cache must be [Lmax, Hkv={Hkv}, D={D}], got {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}"
        )
    if not 0 <= int(cache_len) <= k_cache.shape[0]:
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
            raise ValueError(f"branch_attention: {name}.dtype={t.dtype} differs from q.dtype={q.dtype}")
        if t.device != q.device:
            raise ValueError(f"branch_attention: {name} is on {t.device}, q on {q.device}")


def branch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    win_lens: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    mode: str = "full",
    scale: float | None = None,
    return_lse: bool = False,
    check: bool = True,
):
    """q [B, n, Hq, D] attends to k/v_cache[:cache_len] ([Lmax, Hkv, D], shared) + its own window
    k/v_win [B, n, Hkv, D] under `mode` (full | block_causal | causal, from win_lens [B] / block_ids [B, n]).
    Returns o [B, n, Hq, D] (and lse [B, n, Hq] fp32). Matches lopa_fast.reference.ops.branch_attention."""
    if check:
        _check(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode)
    return ref.branch_attention(
        q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, scale, return_lse
    )
