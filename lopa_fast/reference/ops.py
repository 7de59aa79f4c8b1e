"""Plain-PyTorch references of the engine's ops (the semantics the Triton/CUDA kernels must match).

Every op here has the same signature as its public op in `lopa_fast.ops`; these compute in float32
(or float64 where noted) whatever the input dtype, and are written for clarity, not speed.
"""
from __future__ import annotations

import math

import torch

from lopa_fast.attention_modes import window_key_mask
from lopa_fast.sampling import Confidence, HeadConfidence, softmax_stats


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for fp16/bf16/fp32 inputs, float64 for float64 inputs (tests use fp64 as the exact oracle)."""
    return torch.promote_types(t.dtype, torch.float32)


def branch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    win_lens: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    mode: str = "full",
    scale: float | None = None,
    return_lse: bool = False,
    *,
    cache_index: torch.Tensor | None = None,
):
    """Attention of B branch windows over a shared committed prefix plus each branch's own window.

    q:        [B, n, Hq, D]
    k_cache:  [Lmax, Hkv, D]  (one layer of the static cache; rows [0, cache_len) are read)
    cache_len: int, or a 0-d / [1] int tensor on q's device (no host read: rows >= cache_len are masked)
    v_cache:  [Lmax, Hkv, D]
    cache_index: None (one request: the shapes above), or [B] int tensor: the POOLED form (several requests
              in one call). k_cache / v_cache are then a pool [S, Lmax, Hkv, D] of S request slots (one layer),
              cache_len an [S] int tensor on q's device (slot s holds rows [0, cache_len[s])), and branch row b
              attends to slot cache_index[b]'s prefix plus its own window. Defined row by row: row b's result
              is this op on (q[b:b+1], k_cache[slot], v_cache[slot], cache_len[slot] as a 0-d tensor,
              k_win[b:b+1], ...), so rows of different requests never enter each other's sums.
    k_win:    [B, n, Hkv, D]  the branch windows' own keys (post-RoPE)
    v_win:    [B, n, Hkv, D]
    win_lens: [B] int or None (valid window length per branch, 1 <= len <= n; keys beyond are padding)
    block_ids:[B, n] int (required for block_causal; non-decreasing along n)
    mode:     "full" | "block_causal" | "causal" (window part; the prefix is always visible)
    Returns o [B, n, Hq, D] in q.dtype, and lse [B, n, Hq] float32 (natural log) if return_lse.
    Query head h reads kv head h // (Hq // Hkv) (GQA). Padding query rows (i >= win_lens[b]) are computed
    like valid rows and are to be ignored by callers. A row that sees no key at all (cache_len 0 and a
    zero-length window) is undefined (NaN here).
    Computes in float32 (float64 for float64 inputs).
    """
    if cache_index is not None:
        return _pooled_branch_attention(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode,
                                        scale, return_lse, cache_index)
    B, n, Hq, D = q.shape
    Hkv = k_win.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cdt = _compute_dtype(q)
    qf = q.to(cdt).reshape(B, n, Hkv, group, D)
    if isinstance(cache_len, torch.Tensor):
        # device-resident prefix length (a captured / compiled round): attend over the whole static buffer
        # with rows >= cache_len masked, so no shape depends on the value
        kp, vp = k_cache.to(cdt), v_cache.to(cdt)
        prefix_ok = torch.arange(k_cache.shape[0], device=q.device) < cache_len.reshape(())
    else:
        kp, vp = k_cache[:cache_len].to(cdt), v_cache[:cache_len].to(cdt)
        prefix_ok = None
    kw, vw = k_win.to(cdt), v_win.to(cdt)
    s_prefix = torch.einsum("bnhgd,lhd->bhgnl", qf, kp) * scale  # [B, Hkv, G, n, L]
    if prefix_ok is not None:
        s_prefix = s_prefix.masked_fill(~prefix_ok, float("-inf"))
    s_win = torch.einsum("bnhgd,bmhd->bhgnm", qf, kw) * scale  # [B, Hkv, G, n, n]
    vis = window_key_mask(n, win_lens, block_ids, mode, B, q.device)  # [B, n, n]
    s_win = s_win.masked_fill(~vis[:, None, None], float("-inf"))
    s = torch.cat([s_prefix, s_win], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, n]
    p = torch.exp(s - lse[..., None])
    Lp = kp.shape[0]
    o = torch.einsum("bhgnl,lhd->bnhgd", p[..., :Lp], vp) + torch.einsum("bhgnm,bmhd->bnhgd", p[..., Lp:], vw)
    o = o.reshape(B, n, Hq, D).to(q.dtype)
    if return_lse:
        return o, lse.permute(0, 3, 1, 2).reshape(B, n, Hq)
    return o



def _pooled_branch_attention(q, k_pool, v_pool, cache_len, k_win, v_win, win_lens, block_ids, mode, scale, return_lse,
                             cache_index):
    """The pooled form, literally as defined: one single-request call per branch row b on its slot
    (k_pool[slot] [Lmax, Hkv, D], cache_len[slot] as a 0-d tensor: the masked static-buffer path), outputs
    stacked along B. Slots are picked with index_select (no host read of cache_index or cache_len)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        slot = cache_index[b : b + 1]
        row = slice(b, b + 1)
        o, lse = branch_attention(
            q[row], k_pool.index_select(0, slot)[0], v_pool.index_select(0, slot)[0],
            cache_len.index_select(0, slot).reshape(()), k_win[row], v_win[row],
            None if win_lens is None else win_lens[row], None if block_ids is None else block_ids[row],
            mode, scale, return_lse=True,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    B, n, Hq, D = q.shape
    o = torch.cat(outs) if outs else q.new_empty(B, n, Hq, D)
    if return_lse:
        return o, torch.cat(lses) if lses else q.new_empty(B, n, Hq, dtype=_compute_dtype(q))
    return o

def confidence(logits: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10) -> Confidence:
    """Per-row vocabulary statistics of softmax(logits) computed in float32 (float64 for float64 input), with
    the one formula of the decoders' `lopa_fast.sampling.token_stats` (`sampling.softmax_stats`):
    probs = softmax(x), p_max / token = max / argmax of probs, margin = top1 - top2 of probs.

    logits:         [N, V] any float dtype (upcast before the softmax)
    suppress_token: a vocabulary id treated as logit -inf everywhere (argmax, probabilities, lse,
                    entropy), e.g. the mask id when the engine asks; None = nothing suppressed (upstream)
    eps:            inside the entropy log, as upstream: sum_v p_v * log(p_v + eps)
    Returns Confidence(
        token       int64 [N]  argmax of probs (ties -> lowest index),
        p_max       fp32  [N]  max_v p_v,
        margin      fp32  [N]  p_top1 - p_top2 (top-2 of the multiset: an exact tie gives 0),
        neg_entropy fp32  [N]  sum_v p_v * log(p_v + eps)  (<= 0; higher = more confident),
        lse         fp32  [N]  logsumexp_v logits (natural log))
    The three `sampling_strategy` confidences are p_max (default), margin and neg_entropy.
    """
    x = logits.to(_compute_dtype(logits))
    if suppress_token is not None:
        x = x.clone()
        x[:, suppress_token] = float("-inf")
    token, p_max, margin, neg_entropy = softmax_stats(x, eps)
    return Confidence(token, p_max, margin, neg_entropy, torch.logsumexp(x, dim=-1))


# the vocabulary columns per chunk of head_confidence's torch backend: [R, chunk] fp32 temporaries (9.4 MB at
# R = 288) instead of the [R, V] logits (175 MB at V = 152,064)
HEAD_CHUNK = 8192


def head_confidence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    suppress_token: int | None = None,
    eps: float = 1e-10,
    entropy: bool = True,
    chunk: int | None = None,
) -> HeadConfidence:
    """`confidence(F.linear(hidden, weight), suppress_token, eps)` and the rows' finiteness, computed over
    vocabulary chunks of `chunk` columns (default HEAD_CHUNK) without materialising the [R, V] logits.

    hidden [R, H] (final-normed rows), weight [V, H] (the LM head), both one float dtype. A logit is
    F.linear's (hidden.dtype, as the unfused head returns it), upcast to float32 (float64 for float64 input).
    Pass 1 per chunk: the logits, finite &= isfinite (raw logits, before the suppressed id is set to -inf),
    then an online merge of (max, first arg-max, second max of the multiset, sum exp(x - max)) in vocabulary
    order; lse = max + log(sum), p_max = exp(max - lse), margin = p_max - exp(second - lse).
    Pass 2 (entropy=True): the same chunks recomputed, sum_v p_v * log(p_v + eps) with the final lse (the eps
    inside the log needs p, so it cannot be folded into pass 1 exactly: the head is computed twice).
    Returns HeadConfidence(token int64 [R], p_max, margin, neg_entropy (None if not entropy), lse fp32 [R],
    finite bool [R]); a row with finite False has meaningless statistics (the round raises on it).
    Equal to `confidence` of the unfused logits up to the order of the softmax's sums (tests/test_head_confidence.py)."""
    cd = _compute_dtype(hidden)
    R, V = hidden.shape[0], weight.shape[0]
    C = max(1, int(chunk or HEAD_CHUNK))
    dev = hidden.device
    ninf = float("-inf")
    m1 = torch.full((R,), ninf, dtype=cd, device=dev)
    m2 = torch.full((R,), ninf, dtype=cd, device=dev)
    i1 = torch.zeros(R, dtype=torch.long, device=dev)
    s = torch.zeros(R, dtype=cd, device=dev)
    finite = torch.ones(R, dtype=torch.bool, device=dev)

    def logits(v0):
        z = torch.nn.functional.linear(hidden, weight[v0 : v0 + C]).to(cd)
        ok = torch.isfinite(z).all(-1)
        if suppress_token is not None and v0 <= suppress_token < v0 + z.shape[1]:
            z[:, suppress_token - v0] = ninf
        return z, ok

    for v0 in range(0, V, C):
        z, ok = logits(v0)
        finite &= ok
        if z.shape[1] >= 2:
            top = torch.topk(z, 2, dim=-1)  # the two largest of the chunk (multiset)
            cmax, c2 = top.values[:, 0], top.values[:, 1]
        else:
            cmax, c2 = z[:, 0], torch.full_like(m2, ninf)
        cidx = z.argmax(-1) + v0  # first index of the chunk's max
        m2 = torch.maximum(torch.minimum(m1, cmax), torch.maximum(m2, c2))
        i1 = torch.where(cmax > m1, cidx, i1)  # strict: an equal later max keeps the earlier index
        m_new = torch.maximum(m1, cmax)
        m_safe = torch.where(m_new == ninf, 0.0, m_new)
        s = s * torch.exp(m1 - m_safe) + torch.exp(z - m_safe[:, None]).sum(-1)
        m1 = m_new
    lse = torch.where(m1 == ninf, 0.0, m1) + torch.log(s)
    p_max = torch.exp(m1 - lse)
    margin = p_max - torch.exp(m2 - lse)
    neg_entropy = None
    if entropy:
        neg_entropy = torch.zeros(R, dtype=cd, device=dev)
        for v0 in range(0, V, C):
            p = torch.exp(logits(v0)[0] - lse[:, None])
            neg_entropy += (p * torch.log(p + eps)).sum(-1)
    return HeadConfidence(i1, p_max, margin, neg_entropy, lse, finite)

# ------------------------------------------------------------------------------------- layer ops
# The decoder layer's elementwise / row-wise parts. Unlike the ops above these do NOT upcast their
# result: each formula is exactly the model's (lopa_fast.models.transformer), op for op, so the CPU
# path that runs these twins stays bitwise identical to the model's own code.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, HF Qwen2 / LLaDA order: x [..., H] upcast to fp32, x * rsqrt(mean(x^2) + eps), cast
    back to x.dtype, then times weight [H] (in x.dtype when weight.dtype == x.dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step: s = x + residual in x.dtype (one rounding), then (rms_norm(s), s)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [..., D] for integer positions [...] (e.g. [n], or [B, n] for per-request offsets):
    inv_freq = 1 / theta ** (arange(0, D, 2) / D) in fp32, angles = positions * inv_freq, duplicated
    along the last dim (rotate-half layout)."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_one(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, fp32: bool) -> torch.Tensor:
    if fp32:
        xf = x.float()
        return (xf * c + _rotate_half(xf) * s).to(x.dtype)
    c, s = c.to(x.dtype), s.to(x.dtype)
    return x * c + _rotate_half(x) * s


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [B, n, Hq, D] and k [B, n, Hkv, D] with cos, sin fp32 [n, D] or [B, n, D]
    (from rope_cos_sin): x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]).
    fp32=False (Qwen2 family): cos/sin cast to x.dtype, then rotated in x.dtype.
    fp32=True (LLaDA): rotated in fp32, then cast back to x.dtype.
    Returns (q_rot, k_rot) in the input dtypes."""
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return _rope_one(q, c, s, fp32), _rope_one(k, c, s, fp32)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise part: silu(gate) * up in the input dtype (gate, up [..., F])."""
    return torch.nn.functional.silu(gate) * up
