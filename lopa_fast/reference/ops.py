"""Plain-PyTorch references of the engine's ops (the semantics the Triton/CUDA kernels must match).

Every op here has the same signature as its public op in `lopa_fast.ops`; these compute in float32
(or float64 where noted) whatever the input dtype, and are written for clarity, not speed.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lopa_fast.reference.attention_modes import window_key_mask
from lopa_fast.sampling import Confidence, HeadConfidence, chunk_rows, finite_rows, is_on, softmax_stats


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
        )
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


def head_confidence(hidden: torch.Tensor, weight: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10,
                    entropy: bool = True, chunk: int | None = None, keep_logits: bool = False) -> HeadConfidence:
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
    finite bool [R], logits: with keep_logits the raw logits [R, V] in hidden.dtype, pass 1's chunks, else None);
    a row with finite False has meaningless statistics (the round raises on it).
    Equal to `confidence` of the unfused logits up to the order of the softmax's sums
    (tests/test_head_confidence.py)."""
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
    kept = torch.empty(R, V, dtype=hidden.dtype, device=dev) if keep_logits else None

    def logits(v0, keep=False):
        raw = torch.nn.functional.linear(hidden, weight[v0 : v0 + C])
        if keep:
            kept[:, v0 : v0 + raw.shape[1]] = raw
        z = raw.to(cd)
        ok = torch.isfinite(z).all(-1)
        if suppress_token is not None and v0 <= suppress_token < v0 + z.shape[1]:
            z[:, suppress_token - v0] = ninf
        return z, ok

    for v0 in range(0, V, C):
        z, ok = logits(v0, keep_logits)
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
    return HeadConfidence(i1, p_max, margin, neg_entropy, lse, finite, kept)

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


NORM_LINEAR_EPILOGUES = ("swiglu", "rope")


def norm_linear(x: torch.Tensor, weight: torch.Tensor, epilogue: str, norm_weight: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, eps: float = 1e-6, bias: torch.Tensor | None = None,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, rot_heads: int = 0,
                rope_fp32: bool = False, positions: torch.Tensor | None = None,
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder layer's pre-norm GEMM with its neighbours: s = x + residual (when given), h = rms_norm(s,
    norm_weight) (when given), y = F.linear(h, weight, bias), then the epilogue:
    "swiglu": weight is the merged gate/up [2F, K] (gate rows first) -> silu_mul(gate, up) [..., F];
    "rope": weight is the merged q/k/v [H D, K], x [..., n, K], cos / sin fp32 [n, D] or [..., n, D] -> y [..., H D]
    with its first rot_heads heads of D columns rotated (`rope`'s formula; rope_fp32 as its fp32); instead of cos / sin,
    positions int [n] or [..., n] and inv_freq fp32 [D / 2]: the tables DecoderLM.rope_tables forms from them.
    Returns (out, s), s None without a residual: bit for bit the model's add, norm, projection and activation /
    RoPE as separate ops."""
    s = x + residual if residual is not None else None
    h = s if s is not None else x
    if norm_weight is not None:
        h = rms_norm(h, norm_weight, eps)
    y = torch.nn.functional.linear(h, weight, bias)
    if epilogue == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return silu_mul(gate, up), s
    if positions is not None:
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    D = cos.shape[-1]
    heads = y.view(*y.shape[:-1], -1, D)
    rot = _rope_one(heads[..., :rot_heads, :], cos.unsqueeze(-2), sin.unsqueeze(-2), rope_fp32)
    return torch.cat([rot, heads[..., rot_heads:, :]], dim=-2).reshape(y.shape), s


# ------------------------------------------------------------------------------------- the round's commit
def commit_round(cache_k: torch.Tensor, cache_v: torch.Tensor, cache_len: torch.Tensor, k_win: torch.Tensor,
                 v_win: torch.Tensor, winner: torch.Tensor, u: torch.Tensor, last_logit: torch.Tensor | None = None,
                 logits: torch.Tensor | None = None, last_row: torch.Tensor | None = None) -> None:
    """A D2F / LoPA round's commit, in place (`ops.commit_round`, whose oracle this is): the winner's first u window
    rows of K and V (k_win / v_win [layers, NB, Nb, Hkv, D], winner 0-d) into cache_k / cache_v [layers, Lc, Hkv, D]
    rows cache_len + i (0-d; rows past u go to the trash row Lc - 1); under Dream's shift (last_logit [V] given) the
    next last_logit: logits [R, V] row last_row - 1 when u > 0 and last_row > 0, else it stays."""
    W = winner.reshape(1)
    k_span, v_span = k_win.index_select(1, W)[:, 0], v_win.index_select(1, W)[:, 0]
    i = torch.arange(k_span.shape[1], device=k_span.device)
    dst = torch.where(i < u, cache_len + i, cache_k.shape[1] - 1)
    cache_k.index_copy_(1, dst, k_span)
    cache_v.index_copy_(1, dst, v_span)
    if last_logit is not None:
        new = logits.index_select(0, (last_row - 1).clamp(min=0).reshape(1))[0]
        last_logit.copy_(torch.where((u > 0) & (last_row > 0), new, last_logit))


# ------------------------------------------------------------------------------------- the round's numerics guard
def first_nonfinite(logits: torch.Tensor, rows: torch.Tensor, n_real, none: int, temperature=0.0) -> torch.Tensor:
    """The D2F / LoPA round's numerics guard (lopa_fast/strategies/lopa/round.py; `ops.first_nonfinite`, whose oracle
    this is). 0-d long: the flat window row (rows[r]) of the first of the n_real real logits rows [Rb, V] holding
    NaN / inf (at T > 0 also: overflowing when divided by T, a float or the tables' 0-d knob), else -1 (none:
    any value > every flat row). In row chunks (`sampling.STATS_CHUNK`): no [Rb, V] temporary."""
    step = chunk_rows(logits.shape[-1])
    oks = []
    for part in (logits,) if logits.shape[0] <= step else logits.split(step):
        ok = finite_rows(part)
        if is_on(temperature):
            ok = ok & finite_rows(part.float() / temperature)
        oks.append(ok)
    return first_bad(oks[0] if len(oks) == 1 else torch.cat(oks), rows, n_real, none)


def first_bad(ok: torch.Tensor, rows: torch.Tensor, n_real, none: int) -> torch.Tensor:
    """0-d long: rows[r] of the first of the n_real real rows r with ok[r] False, else -1 (`first_nonfinite`).
    n_real: a 0-d tensor, or a host int (an eager round: when it covers every row, 4 ops instead of 8)."""
    if isinstance(n_real, int) and n_real >= ok.shape[0]:
        first = torch.where(ok, none, rows).min()  # rows ascend: the first bad row's flat row, or `none`
        return torch.where(first < none, first, -1)
    real = torch.arange(ok.shape[0], device=ok.device) < n_real
    bad = real & ~ok
    return torch.where(bad.any(), torch.where(bad, rows, none).min(), -1)


# ------------------------------------------------------------------------------------- the round's selection
# `select_round`: everything of a D2F / LoPA round after its token statistics (lopa_fast/strategies/lopa/round.py
# is the fast path that calls it; docs/fast_decoder.md "select_round"). The torch code below IS the op's oracle:
# the C++ (csrc/select_round_cpu.cpp), Triton and CUDA kernels reproduce its every output bit for bit.

ACTIVE, TO_CACHE, IN_CACHE = 0, 1, 2  # block states (shared by every slot of a request)
# the round's counters, in the order of the `counts` [8] long tensor of the round state
ROUND_COUNTERS = ("thresh", "fallback", "eos_fills", "multi", "look_wins", "growth_split", "winner_grew",
                  "max_branches")


class RoundPlan(NamedTuple):
    """The plan of a coming round (`plan_round`): n_blocks [NB] long (after growth), complete [NB, G + 1] bool,
    exists / active [NB, G + 1] bool, running / done [NB] bool, is_mask / need [NB, Lb + 1] bool, lens /
    window_lens [NB] long, to_cache [G + 1] bool, shared_end / layout_slot / start / commit_len 0-d long, and
    head [7] long: (every alive slot done, alive count nA, start s, commit_len u, window width n, LM-head rows R,
    ragged)."""

    n_blocks: torch.Tensor
    complete: torch.Tensor
    exists: torch.Tensor
    active: torch.Tensor
    running: torch.Tensor
    done: torch.Tensor
    is_mask: torch.Tensor
    need: torch.Tensor
    lens: torch.Tensor
    window_lens: torch.Tensor
    to_cache: torch.Tensor
    shared_end: torch.Tensor
    layout_slot: torch.Tensor
    start: torch.Tensor
    commit_len: torch.Tensor
    head: torch.Tensor


# what `select_round` returns: the round's decision, the next state, then the next round's plan (RoundPlan's fields)
SelectRound = NamedTuple("SelectRound", [(f, torch.Tensor) for f in (
    "winner", "score", "last_row", "accepted", "tokens", "x", "eos", "alive", "creation_conf", "look_pos",
    "block_state", "counts", *RoundPlan._fields)])
SelectRound.__doc__ = """What `select_round` returns: the round's decision (winner 0-d long; score [NB] float64,
    the branch scores (zeros when not scored: one slot without a trace); last_row 0-d long, the statistics-table row of
    the winner's raw row u - 1 (Dream's next last_logit; 0 without the shift); accepted [Nb] bool and tokens [Nb] long,
    the winner's fills and its chosen token per window column), the next state (x [NB, Lb + 1], eos / alive [NB] bool,
    creation_conf [NB] float64, look_pos [NB] long, block_state [G + 1] long, counts [8] long) and the next round's plan
    (the `RoundPlan` fields)."""


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[i] for a 0-d device index without a host read (indexing with a 0-d tensor would call .item())."""
    return t.index_select(0, i.reshape(1)).squeeze(0)


def plan_round(x, n_blocks, block_state, complete, eos, alive, prompt_len, gen_pos, block_start, block_end,
               grow_table, activate_table, *, bs: int, mask_id: int, shift: bool) -> RoundPlan:
    """Grow, activation, termination, shared-prefix end and the to-cache span of the coming round (no host read).

    x [NB, Lb + 1] long (column Lb: the trash column), n_blocks [NB] long, block_state [G + 1] long, complete
    [NB, G + 1] bool, eos / alive [NB] bool; tables: prompt_len 0-d long, gen_pos [G * bs] long (the generated
    positions), block_start / block_end [G + 1] long (block 0 = the prompt), grow_table / activate_table [bs + 1]
    bool (the decoded-fraction tests by mask count: upstream's Python float maths, tabulated)."""
    NB, Lb1 = x.shape
    G = block_state.shape[0] - 1
    Lb = Lb1 - 1
    dev = x.device
    state = block_state
    ismask_all = x == mask_id  # [NB, Lb + 1]; positions past a row's length hold masks too
    mc = F.pad((x.index_select(1, gen_pos) == mask_id).view(NB, G, bs).sum(-1), (1, 0))  # [NB, G + 1]
    # 1. grow: the last block's decoded fraction >= tau_add (lookup table, exact Python float maths)
    last_mc = mc.gather(1, n_blocks[:, None]).squeeze(1)
    grow = alive & (n_blocks < G) & ~eos & grow_table[last_mc]
    nblk = n_blocks + grow
    exists = torch.arange(G + 1, device=dev)[None, :] <= nblk[:, None]  # [NB, G + 1]
    # 2. activation: block j >= tau_act decoded -> block j+1 fully activated (sticky, per branch)
    complete = complete.clone()
    complete[:, 1:] |= activate_table[mc[:, :-1]] & exists[:, 1:]
    # 3. done: no mask and no active block
    active = exists & (state == ACTIVE)[None, :]
    lens = prompt_len + nblk * bs
    pos = torch.arange(Lb1, device=dev)
    ismask = ismask_all & (pos[None, :] < lens[:, None]) & alive[:, None]
    done = alive & ~ismask.any(1) & ~active.any(1)
    rem = alive & ~done
    # 4. shared-prefix end: the leading run of non-active blocks (a non-active block never holds a mask,
    # so upstream's min over branches is this one run of the shared state row)
    lead = (state != ACTIVE).cumprod(0).sum()
    spe = _at(block_end, lead - 1)
    # 5. the to-cache span: to_cache blocks (all end <= spe), contiguous from the cache end
    tc = state == TO_CACHE
    has_tc = tc.any()
    s = torch.where(has_tc, torch.where(tc, block_start, Lb).min(), spe)
    u = torch.where(has_tc, torch.where(tc, block_end, 0).max() - s, 0)
    wl = lens - s
    n = torch.where(rem, wl, 0).max()
    # the layout branch (the anchor if still running, else the first running one): its row length tells
    # branch-specific growth apart (counters only)
    nA = alive.sum()
    first_rem = torch.where(rem, torch.arange(NB, device=dev), NB - 1).min()
    lay = torch.where(_at(rem, nA - 1), nA - 1, first_rem)
    ragged = (torch.where(alive, wl, n) != n).any()
    # LM-head rows: raw row q is needed iff it predicts a masked position (q+1 with the Dream shift, q
    # without), or q = s+u-1, the last cached position (its logit becomes last_logit); q >= s.
    if shift:
        last = (pos == s + u - 1) & (u > 0)
        need = (F.pad(ismask[:, 1:], (0, 1)) | last[None, :]) & alive[:, None]
        need &= (pos >= s)[None, :]
    else:
        need = ismask
    head = torch.stack([~rem.any(), nA, s, u, n, need.sum(), ragged]).long()
    return RoundPlan(nblk, complete, exists, active, rem, done, ismask, need, lens, wl, tc, spe, lay, s, u, head)


def select_round(conf, token, p, x, n_blocks, block_state, complete, eos, alive, creation_conf, look_pos, counts,
                 exists, active, running, is_mask, lens, to_cache, shared_end, layout_slot, commit_len, win_pos,
                 win_valid, need_flat, prompt_len, gen_pos, block_start, block_end, pos_block, in_block, lowest_k,
                 grow_table, activate_table, skip_threshold, alpha, *, bs: int, mask_id: int, eos_id: int, n_look: int,
                 shift: bool, blend: bool, score_all: bool) -> SelectRound:
    """One D2F / LoPA round's selection and bookkeeping after its token statistics, as ONE op: the branch scores
    and the winner, the D2F fill on the winner, the lookahead spawn, the block-state transitions, the counters and
    the plan of the next round (`plan_round`). No host read; every shape is fixed by the request and the bucket.

    Statistics table (S rows: row 0 the stale last_logit's under the shift, then the needed window rows in
    ascending flat order): conf [S] float32 (the confidence ranked by), token [S] long (the chosen token), p [S]
    float32 (its probability).
    Round state (NB slots: lookaheads first in rank order, the anchor last among the alive; Lb + 1 row positions,
    the last a trash column; G + 1 blocks, block 0 the prompt): x [NB, Lb + 1] long, n_blocks [NB] long,
    block_state [G + 1] long (ACTIVE / TO_CACHE / IN_CACHE), complete [NB, G + 1] bool, eos / alive [NB] bool,
    creation_conf [NB] float64, look_pos [NB] long, counts [8] long (ROUND_COUNTERS).
    This round's plan (`plan_round`'s): exists / active [NB, G + 1] bool, running [NB] bool, is_mask [NB, Lb + 1]
    bool, lens [NB] long, to_cache [G + 1] bool, shared_end / layout_slot / commit_len 0-d long.
    Window (Nb columns from the start): win_pos [Nb] long (padding -> Lb), win_valid [Nb] bool, need_flat
    [NB * Nb] bool (LM-head rows needed, slot-major).
    Tables: prompt_len 0-d long, gen_pos [G * bs], block_start / block_end [G + 1], pos_block [Lb + 1] long,
    in_block [Lb + 1, G + 1] bool, lowest_k [Lb + 1] long (k(c) = max(1, int(c * branch_topp))), grow_table /
    activate_table [bs + 1] bool, skip_threshold / alpha 0-d float64.
    Statics: bs, mask_id, eos_id (-1: none), n_look (lookaheads spawned: NB - 1 for LoPA, 0 for D2F), shift (Dream's
    logit shift), blend (scores blend creation_conf by alpha), score_all (score every slot even when NB = 1: a
    trace asks for scores).

    Arithmetic (what the kernels reproduce): a branch score is the mean of its lowest k confidences, summed in
    float64 (exact for the grid's values; rounded once to float32), divided by k in float32, then widened:
    alpha * creation_conf + (1 - alpha) * future in float64; the winner is the first maximum over running slots
    (NaN scores: the last slot, refused by the driver's numerics guard); the threshold test is p > skip_threshold
    in float32; the fallback picks the first most confident candidate per fully activated block; the spawn ranks
    the remaining candidates by conf descending, stable (NaN first, as torch.sort)."""
    NB, Lb1 = x.shape
    Lb = Lb1 - 1
    G = block_state.shape[0] - 1
    Nb = win_pos.shape[0]
    dev = x.device
    i = torch.arange(Nb, device=dev)
    slot = torch.arange(NB, device=dev)

    # ---- select: the table row predicting each window position, the scores, the winner
    csum = need_flat.long().cumsum(0).view(NB, Nb)  # 1-based rank of each needed raw row
    sidx = F.pad(csum[:, :-1], (1, 0)) if shift else (csum - 1).clamp(min=0)
    c_w = conf[sidx]  # [NB, Nb]: the confidence predicting window position i, per slot
    masked = is_mask.index_select(1, win_pos) & win_valid[None, :]
    if NB == 1 and not score_all:  # D2F (k = 1): one slot, the winner is slot 0 and there is nothing to score
        score = torch.zeros(NB, dtype=torch.float64, device=dev)
        W = torch.zeros((), dtype=torch.long, device=dev)
    else:
        # mean of the lowest k = max(1, int(m * topp)) confidences over all its masks (all >= spe); 1.0 with
        # none; 1.0 outright with nothing past spe
        m = masked.sum(1)
        kk = lowest_k[m]
        asc = torch.sort(torch.where(masked, c_w, float("inf")), dim=1).values
        low = torch.where(i[None, :] < kk[:, None], asc.double(), 0.0).sum(1).float() / kk
        future = torch.where(m > 0, low.double(), 1.0)
        score = alpha * creation_conf + (1.0 - alpha) * future if blend else future
        score = torch.where(lens <= shared_end, 1.0, score)
        keyw = torch.where(running, score, float("-inf"))
        # first max = upstream's tie order; clamped so NaN scores (a broken round the driver refuses after its
        # host read) cannot index out of range first
        W = torch.where(keyw == keyw.max(), slot, NB).min().clamp(max=NB - 1)
    if shift:
        last_row = _at(csum.index_select(1, (commit_len - 1).clamp(min=0).reshape(1))[:, 0], W)
    else:
        last_row = torch.zeros((), dtype=torch.long, device=dev)
    W1 = W.reshape(1)

    # ---- the D2F fill rule on the winner only (its own block states and logits)
    sW = sidx.index_select(0, W1)[0]
    mW = masked.index_select(0, W1)[0]
    cW, tokW, pW = conf[sW], token[sW], p[sW]  # [Nb]
    actWb = active.index_select(0, W1)[0]  # [G + 1]
    onehot = in_block.index_select(0, win_pos)  # [Nb, G + 1]: window position i lies in block j
    candW = mW & actWb[pos_block.index_select(0, win_pos).clamp(max=G)]
    thr = candW & (pW > skip_threshold)  # strict, as upstream (a runtime knob, rounded to pW's float32)
    # fallback: a fully activated active block with masks and no accept fills its most confident mask
    # (first index on exact ties)
    cand_b = candW[:, None] & onehot
    key = torch.where(cand_b, cW[:, None], float("-inf"))
    best = key.max(0).values
    firstpos = torch.where(cand_b & (key == best), i[:, None], Nb).min(0).values  # [G + 1]
    need_fb = complete.index_select(0, W1)[0] & actWb & cand_b.any(0) & ~(thr[:, None] & onehot).any(0)
    fb = ((firstpos[None, :] == i[:, None]) & need_fb[None, :]).any(1)
    accW = thr | fb
    xW = x.index_select(0, W1)[0]
    xW = xW.scatter(0, win_pos, torch.where(accW, tokW, xW.index_select(0, win_pos)))
    eos_hit = accW & (tokW == eos_id) if eos_id >= 0 else torch.zeros_like(accW)
    eosW = _at(eos, W) | eos_hit.any()
    nA = alive.sum()
    if NB == 1:
        multi = (accW.sum() >= 2).long()
        look_win = grew = torch.zeros((), dtype=torch.long, device=dev)
    else:
        is_look = (W != nA - 1).long()  # the anchor is the last alive slot
        grew = (_at(lens, W) != _at(lens, layout_slot)).long()
        look_win = is_look
        # tokens accepted this round: the anchor-rule fills plus the winning lookahead's token
        multi = ((accW.sum() + is_look) >= 2).long()
    zero = torch.zeros((), dtype=torch.long, device=dev)
    counts = counts + torch.stack([thr.sum(), fb.sum(), eos_hit.sum(), multi, look_win, zero, grew, zero])

    # ---- winner's block table after the fill
    existsW = exists.index_select(0, W1)[0]
    mcW = F.pad((xW.index_select(0, gen_pos) == mask_id).view(G, bs).sum(-1), (1, 0))
    base_done = actWb & (mcW == 0)  # upstream's base_completed_blocks

    # ---- spawn: lookaheads at the winner's top-n_look remaining masks (ranked by c, stable)
    # repeat, not expand().clone(): fresh strides, so eager and compiled rounds hand over identically strided state
    # (a stride-0 dim would recompile)
    x_new = xW.repeat(NB, 1)
    eos_new = eosW.reshape(1).repeat(NB)
    cconf_new = torch.ones(NB, dtype=torch.float64, device=dev)
    new_look = torch.full((NB,), -1, dtype=torch.long, device=dev)
    if n_look > 0:
        rest = candW & ~accW
        keyl = torch.where(rest, cW, float("-inf"))
        order = torch.sort(keyl, descending=True, stable=True).indices[:n_look]
        valid = rest[order]
        if Nb < n_look:  # fewer window positions than lookaheads (static: known per bucket)
            order = F.pad(order, (0, n_look - Nb))
            valid = F.pad(valid, (0, n_look - Nb))
        n_valid = valid.sum()
        lpos = win_pos[order]
        ltok = tokW[order]
        # flat index slot * (Lb + 1) + pos; an invalid slot rewrites its own token
        flat = slot[:n_look] * (Lb + 1) + lpos
        x_flat = x_new.view(-1)
        x_new = x_flat.scatter(0, flat, torch.where(valid, ltok, x_flat.gather(0, flat))).view(NB, Lb + 1)
        cconf_new = torch.cat([torch.where(valid, cW[order].double(), 1.0), cconf_new[n_look:]])
        if eos_id >= 0:
            eos_new = eos_new | F.pad(valid & (ltok == eos_id), (0, NB - n_look))
        new_look = torch.cat([torch.where(valid, lpos, -1), new_look[n_look:]])
    else:
        n_valid = torch.zeros((), dtype=torch.long, device=dev)

    # ---- new block tables: cached span -> in_cache; a block becomes to_cache only if the anchor rule
    # completed it (base_done), it has no mask, and every lower block is non-active after its own update
    # (upstream's in-order loop = a cumulative AND). A lookahead token always lands on a mask of a block the
    # anchor did NOT complete, so every new branch gets the same table: computed once.
    stt = torch.where(to_cache, IN_CACHE, block_state)
    act = existsW & (stt == ACTIVE)
    retire = act & base_done
    chain = (~act | retire).long().cumprod(0).bool()
    stt = torch.where(retire & chain, TO_CACHE, stt)
    alive_new = slot <= n_valid
    nblk = _at(n_blocks, W).reshape(1).repeat(NB)
    complete_new = complete.index_select(0, W1).repeat(NB, 1)
    pl = plan_round(x_new, nblk, stt, complete_new, eos_new, alive_new, prompt_len, gen_pos, block_start, block_end,
                    grow_table, activate_table, bs=bs, mask_id=mask_id, shift=shift)
    return SelectRound(W, score, last_row, accW, tokW, x_new, eos_new, alive_new, cconf_new, new_look, stt, counts,
                       *pl)


# ------------------------------------------------------------------------------------- select_step
# The threshold step's selection and bookkeeping after its token statistics (Fast-dLLM v1 / dParallel), one op:
# the candidates, the numerics guard's row, the commit rule, the commit, the counters and the step's head. Vanilla
# steps keep torch.topk (docs/fast_decoder.md: its choice among exactly tied confidences is the implementation's,
# so only the same call on the same vector is exact).
STEP_RULES = ("threshold", "entropy_threshold", "factor", "first")


class SelectStep(NamedTuple):
    x: torch.Tensor  # [L] long: the canvas after the commit
    fm: torch.Tensor  # 0-d long: its first mask (L when none)
    multi: torch.Tensor  # 0-d long: steps that committed >= 2 tokens, so far
    noop: torch.Tensor  # 0-d long: steps that committed nothing, so far
    head: torch.Tensor  # [4] long: (first non-finite read row or -1, block full, first mask, masks left)


def rank_desc(key: torch.Tensor) -> torch.Tensor:
    """rank [n] long of each entry in a descending stable sort of key [n] (0 = the largest; exact ties: the
    lower index first; NaN above every number)."""
    order = torch.sort(key, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(key.numel(), device=key.device))


def select_by_rule(conf: torch.Tensor, ent: torch.Tensor, cand: torch.Tensor, factor=None, entropy_threshold=None,
                   threshold=None) -> torch.Tensor:
    """bool [n]: the candidates (cand [n]) a threshold step commits, from conf [n] and entropy [n] (no host read);
    the rule knobs (one of them not None) are floats, or 0-d float64 tensors (the step's runtime inputs): the
    formulas round a tensor exactly as they round a float.

    Rank 1 (the highest conf, or the lowest entropy; first index on exact ties; a NaN first) is always committed;
    the rule adds the others: threshold: conf >= tau (upstream drops conf < tau, so equality commits; tau compared
    in conf's dtype, as upstream's tensor-vs-float comparison); entropy_threshold: H <= h; factor: the top `count`
    ranks, count = the first 0-based rank b with c(b) < 1 - f/(b+2) (rank 0's threshold is -1), or every
    candidate when there is none or b is the last rank (upstream's edge case), in float64."""
    any_c = cand.any()
    idx = torch.arange(cand.numel(), device=cand.device)
    if factor is not None:
        c = torch.where(cand, conf, float("-inf"))
        rank = rank_desc(c)
        desc = torch.sort(c, descending=True, stable=True).values.double()
        n = cand.sum()
        # (idx + 2).reciprocal() * f: what `f / tensor` computes for a Python float f (Tensor.__rtruediv__), written
        # out so that a tensor f (a true division otherwise) rounds the same
        th = torch.where(idx == 0, -1.0, 1 - (idx + 2).double().reciprocal() * factor)
        viol = (desc < th) & (idx < n)
        b = torch.where(viol.any(), viol.long().argmax(), n)
        count = torch.where(b < n - 1, b, n)
        return cand & (rank < count)
    if entropy_threshold is not None:
        first = idx == torch.where(cand, ent, float("inf")).argmin()
        keep = cand & ~(ent > entropy_threshold)
    else:
        first = idx == torch.where(cand, conf, float("-inf")).argmax()
        keep = cand & ~(conf < threshold)
    return (keep | (first & cand)) & any_c


def select_step(x: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor,
                ent: torch.Tensor, finite: torch.Tensor, multi: torch.Tensor, noop: torch.Tensor, s: torch.Tensor,
                knob: torch.Tensor, *, rule: str, mask_id: int, B: int) -> SelectStep:
    """A threshold step after its token statistics (lopa_fast.strategies.threshold.step), all on the device.

    x [L] long: the canvas; pos [n] long: the rows' positions (padding rows may point past L - 1: clamped, never
    read, never written); valid [n] bool: real rows; x0 [n] long, conf [n] float32 / float64, ent [n] float64:
    each row's token, confidence and entropy (`sampling.threshold_stats`); finite [n] bool: its logits are finite
    (the numerics guard's test); multi, noop: 0-d long counters; s: 0-d long, the block start; knob: 0-d float64,
    the rule's value (ignored by "first").
    rule: "threshold" | "entropy_threshold" | "factor" (`select_by_rule` over the candidates: valid rows whose
    position holds a mask) | "first" (a Dream refresh: every valid row, unconditionally; the counters stay).
    B: the block length (0: no block, "full" is False).
    The guard's row: the first row r read by the rule (a candidate; "first": valid) whose logits are not finite,
    else -1. Returns SelectStep (the head is what the host reads once per step)."""
    L = x.numel()
    pos_c = pos.clamp(max=L - 1)
    cand = (x.index_select(0, pos_c) == mask_id) & valid
    read = valid if rule == "first" else cand
    bad = read & ~finite
    r = torch.arange(bad.numel(), device=x.device)
    bad_row = torch.where(bad.any(), torch.where(bad, r, bad.numel()).min(), -1)
    if rule == "first":
        sel = valid
    else:
        sel = select_by_rule(conf, ent, cand, **{rule: knob})
        nsel = sel.sum()
        multi = multi + (nsel >= 2).long()
        noop = noop + (nsel == 0).long()
    # the commit: unselected and padding rows write to a trash slot L of an [L + 1] scratch row
    ext = torch.cat([x, x[:1]])
    x = ext.index_copy(0, torch.where(sel & valid, pos_c, L), x0.to(x.dtype))[:L]
    is_mask = x == mask_id
    fm = torch.where(is_mask.any(), is_mask.long().argmax(), L)
    full = torch.zeros((), dtype=torch.bool, device=x.device)
    if B:
        blk = (s + torch.arange(B, device=x.device)).clamp(max=L - 1)
        full = ~is_mask.index_select(0, blk).any()
    head = torch.stack([bad_row, full.long(), fm, is_mask.sum()]).long()
    return SelectStep(x, fm, multi, noop, head)


# ------------------------------------------------------------------------------------- window_inputs
class WindowInputs(NamedTuple):
    """A D2F / LoPA round's forward inputs on its bucket (`window_inputs`)."""

    win_pos: torch.Tensor  # [Nb] long: the window's positions (columns past the request: Lb, the trash column)
    win_valid: torch.Tensor  # [Nb] bool: the column is a real position (< total_len)
    tokens: torch.Tensor  # [NB, Nb] long: every slot's window
    win_block: torch.Tensor  # [Nb] long: each column's block id (block_causal attention; empty when not asked)
    win_lens: torch.Tensor  # [NB] long: each slot's window length (a dead slot: Nb, its ignored whole window)
    need: torch.Tensor  # [NB, Nb] bool: the LM-head rows the round reads
    rows: torch.Tensor  # [Rb] long: the needed flat rows (slot * Nb + column) first, ascending, then the others
    counts: torch.Tensor  # [8] long: ROUND_COUNTERS with the LoPA-only growth_split / max_branches bumped


def window_inputs(x: torch.Tensor, need_all: torch.Tensor, alive: torch.Tensor, window_lens: torch.Tensor,
                  running: torch.Tensor, lens: torch.Tensor, layout_slot: torch.Tensor, counts: torch.Tensor,
                  start: torch.Tensor, total_len: torch.Tensor, pos_block: torch.Tensor, *, Nb: int, Rb: int,
                  blocks: bool) -> WindowInputs:
    """The forward inputs of a round whose plan is in the state (the host read its head and chose the bucket Nb,
    Rb). x / need_all [NB, Lb + 1] (long, bool), alive / running [NB] bool, window_lens / lens [NB] long, layout_slot
    / start / total_len 0-d long, counts [8] long, pos_block [Lb + 1] long (the tables'). blocks: fill win_block
    (block_causal attention), else it is empty. With NB > 1 the LoPA-only counters read the plan: growth_split
    (+1 when a running slot's length differs from the layout slot's) and max_branches (the most running slots)."""
    NB, Lb1 = x.shape
    Lb = Lb1 - 1
    i = torch.arange(Nb, device=x.device)
    wpos = start + i
    wvalid = wpos < total_len
    wpos = torch.where(wvalid, wpos, Lb)  # padding columns read / write the trash column
    if NB > 1:
        split = (running & (lens != lens.index_select(0, layout_slot.reshape(1)))).any().long()
        counts = torch.cat([counts[:5], counts[5:6] + split, counts[6:7],
                            torch.maximum(counts[7:], running.sum().reshape(1))])
    tokens = x.index_select(1, wpos)
    win_block = pos_block.index_select(0, wpos) if blocks else pos_block.new_empty(0)
    win_lens = torch.where(alive, window_lens, Nb)
    need = need_all.index_select(1, wpos) & wvalid[None, :]
    # the needed rows in ascending flat order, without a host read: a stable sort puts them first
    rows = torch.sort((~need.reshape(-1)).to(torch.uint8), stable=True).indices[:Rb]
    return WindowInputs(wpos, wvalid, tokens, win_block, win_lens, need, rows, counts)
