"""Plain-PyTorch references of the engine's ops (the semantics the Triton/CUDA kernels must match).

Every op here has the same signature as its public op in `lopa_fast.ops`; these compute in float32
(or float64 where noted) whatever the input dtype, and are written for clarity, not speed.
"""
from __future__ import annotations

import math

import torch

ATTENTION_MODES = ("full", "block_causal", "causal")


def window_key_mask(
    n: int,
    win_lens: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    mode: str,
    batch: int,
    device,
) -> torch.Tensor:
    """Visibility of window keys: bool [B, n_query, n_key] (True = visible).

    Query (b, i) sees window key j iff j < win_lens[b] and
      full:          always
      block_causal:  block_ids[b, j] <= block_ids[b, i]
      causal:        j <= i
    Built from block ids and lengths; the prefix (cache) part is always fully visible.
    """
    j = torch.arange(n, device=device)
    if win_lens is None:
        valid = torch.ones(batch, n, dtype=torch.bool, device=device)
    else:
        valid = j[None, :] < win_lens.to(device).reshape(batch, 1)
    vis = valid[:, None, :].expand(batch, n, n)
    if mode == "causal":
        vis = vis & (j[None, :, None] >= j[None, None, :])
    elif mode == "block_causal":
        vis = vis & (block_ids[:, None, :] <= block_ids[:, :, None])
    return vis


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
):
    """Attention of B branch windows over a shared committed prefix plus each branch's own window.

    q:        [B, n, Hq, D]
    k_cache:  [Lmax, Hkv, D]  (one layer of the static cache; rows [0, cache_len) are read)
    v_cache:  [Lmax, Hkv, D]
    k_win:    [B, n, Hkv, D]  the branch windows' own keys (post-RoPE)
    v_win:    [B, n, Hkv, D]
    win_lens: [B] int or None (valid window length per branch, 1 <= len <= n; keys beyond are padding)
    block_ids:[B, n] int (required for block_causal; non-decreasing along n)
    mode:     "full" | "block_causal" | "causal" (window part; the prefix is always visible)
    Returns o [B, n, Hq, D] in q.dtype, and lse [B, n, Hq] float32 (natural log) if return_lse.
    Query head h reads kv head h // (Hq // Hkv) (GQA). Padding query rows (i >= win_lens[b]) are computed
    like valid rows and are to be ignored by callers.
    """
    B, n, Hq, D = q.shape
    Hkv = k_win.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().reshape(B, n, Hkv, group, D)
    kp = k_cache[:cache_len].float()
    vp = v_cache[:cache_len].float()
    kw, vw = k_win.float(), v_win.float()
    s_prefix = torch.einsum("bnhgd,lhd->bhgnl", qf, kp) * scale  # [B, Hkv, G, n, L]
    s_win = torch.einsum("bnhgd,bmhd->bhgnm", qf, kw) * scale  # [B, Hkv, G, n, n]
    vis = window_key_mask(n, win_lens, block_ids, mode, B, q.device)  # [B, n, n]
    s_win = s_win.masked_fill(~vis[:, None, None], float("-inf"))
    s = torch.cat([s_prefix, s_win], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, n]
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("bhgnl,lhd->bnhgd", p[..., :cache_len], vp) + torch.einsum(
        "bhgnm,bmhd->bnhgd", p[..., cache_len:], vw
    )
    o = o.reshape(B, n, Hq, D).to(q.dtype)
    if return_lse:
        return o, lse.permute(0, 3, 1, 2).reshape(B, n, Hq)
    return o
