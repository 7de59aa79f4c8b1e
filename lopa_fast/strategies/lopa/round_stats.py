"""The token statistics of a D2F / LoPA round (lopa_fast/strategies/lopa/round.py): the table its selection reads.

The statistics table has one row per needed LM-head row (in ascending flat window order, slot * Nb + column),
preceded under Dream's shift by the stale last_logit's row (table row 0). Two ways to fill it: from logits rows
(`token_stats`: the reference decoders' formula, or the fused `ops.confidence` kernel) or from the final-normed
hidden rows (`fused_head_stats`: `ops.head_confidence`, the [R, V] logits never exist). Plus the keyed sampler's
keys of the rows (`row_keys`); the numerics guard is the ops' (`ops.first_nonfinite`, `ops.first_bad`). Pure
functions of device tensors: eager, compiled and captured rounds (and lopa_fast.distributed's share of a round) run
the same code.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lopa_fast import keyed, ops
from lopa_fast.sampling import NEG_ENTROPY_EPS, chunk_rows
from lopa_fast.sampling import token_stats as softmax_token_stats


class TokenStats(NamedTuple):
    """The statistics table: per row the confidence the strategy ranks by (conf fp32: p, the top-2 margin or the
    negative entropy, by sampling_strategy), the chosen token (int64) and its probability p (fp32)."""

    conf: torch.Tensor
    token: torch.Tensor
    p: torch.Tensor


class HeadStats(NamedTuple):
    """What the fused LM head gives a round: the statistics table, finite [Rb] bool (each raw row's logits all
    finite: the numerics guard) and logits: the raw logits [Rb, V] (model dtype) the head kept from its one pass
    under Dream's shift (the next last_logit is one of its rows: no second GEMV over the head weight), else None."""

    table: TokenStats
    finite: torch.Tensor
    logits: torch.Tensor | None


def temperature(T: dict, cfg):
    """The temperature a round computes with: the tables' 0-d knob at T > 0, else 0.0 (greedy: another graph)."""
    return T["temperature"] if cfg.temperature > 0 else 0.0


def token_stats(logits, T: dict, cfg, use_kernel: bool, keys: torch.Tensor | None = None):
    """TokenStats (conf [R] fp32, token [R] int64, p [R] fp32) of logits rows [R, V], or of a list of row blocks
    read as their concatenation (e.g. the stale last_logit's row and the forward's rows: no [R + 1, V] copy); the
    temperature and top_p values come from the tables T (runtime knobs), whether they apply from cfg (the compile
    key).

    use_kernel=False: `lopa_fast.sampling.token_stats`, the reference decoders' own formula (CPU parity), in row
    chunks (`sampling.STATS_CHUNK`); at T > 0 it draws the token with the keyed sampler (keys [R]: `row_keys`), as the
    reference does.
    use_kernel=True (CUDA, T = 0, no top-p / top-k): the fused `ops.confidence` kernel (no [R, V] temporaries: one
    call on the rows), the same statistics within ~1e-6 (not bitwise)."""
    blocks = [logits] if isinstance(logits, torch.Tensor) else list(logits)
    if cfg.temperature > 0 and keys is None:
        raise ValueError("round.token_stats: temperature > 0 needs the keyed sampler's keys (row_keys)")
    if use_kernel:
        table = blocks[0] if len(blocks) == 1 else torch.cat(blocks, 0)
        suppress = cfg.mask_token_id if cfg.suppress_mask_token else None
        c = ops.confidence(table, suppress_token=suppress, check=False)
        conf = {"default": c.p_max, "margin": c.margin, "neg_entropy": c.neg_entropy}[cfg.sampling_strategy]
        return TokenStats(conf, c.token, c.p_max)
    if len(blocks) > 1 and sum(b.shape[0] for b in blocks) <= chunk_rows(blocks[0].shape[-1]):
        # a table within one chunk: ONE statistics pass over the blocks' concatenation (a pass is ~8 ops, ~35 us on
        # a tiny CPU round; the statistics are row-wise, so the same values)
        blocks = [torch.cat(blocks, 0)]
    pieces, off = [], 0
    for block in blocks:
        step = chunk_rows(block.shape[-1])
        for lo in range(0, block.shape[0], step):
            part = block[lo : lo + step]
            k = None if keys is None else keys[off + lo : off + lo + part.shape[0]]
            pieces.append(_softmax_stats(part, T, cfg, k))
        off += block.shape[0]
    if len(pieces) == 1:
        return pieces[0]
    return TokenStats(*(torch.cat(field) for field in zip(*pieces)))


def _softmax_stats(logits: torch.Tensor, T: dict, cfg, keys) -> TokenStats:
    """`lopa_fast.sampling.token_stats` of logits rows [r, V] with the round's knobs."""
    suppress = cfg.mask_token_id if cfg.suppress_mask_token else None
    top_p = T["top_p"] if cfg.top_p is not None and cfg.top_p < 1 else None
    t = T["temperature"] if cfg.temperature > 0 else 0.0
    return TokenStats(*softmax_token_stats(logits, temperature=t, top_p=top_p, top_k=cfg.top_k,
                                           sampling_strategy=cfg.sampling_strategy, suppress_token=suppress,
                                           keys=keys if cfg.temperature > 0 else None))


def row_keys(st: dict, T: dict, rows: torch.Tensor, s, Nb: int, shift: bool, cfg) -> torch.Tensor | None:
    """The keyed sampler's keys of the stats table rows at T > 0 (None at T = 0): the row predicting absolute
    position q in round r draws with key (seed, TOKEN, r, 0, q), as the reference decoders key it (no branch
    field: the Dream-shift row 0, the stale last_logit, is one row shared by every slot). rows [Rb]: the
    flat window rows (slot * Nb + column) of the raw logits; s: the window start (0-d tensor or int)."""
    if cfg.temperature == 0:
        return None
    pos = s + rows % Nb + (1 if shift else 0)  # the position a raw row predicts
    if shift:  # table row 0: last_logit predicts the window start
        pos = torch.cat([(torch.zeros_like(rows[:1]) + s), pos])
    return keyed.key(T["seed"], keyed.TOKEN, st["round"], 0, pos)


def fused_head_stats(st: dict, cfg, geo, hidden: torch.Tensor, head: torch.Tensor):
    """The statistics table of a round with the fused head (T = 0, no top-p / top-k: the FastDecoder's rule):
    `ops.head_confidence` over hidden [Rb, H] x head [V, H] (the entropy pass only for sampling_strategy
    "neg_entropy"), preceded under the shift by `ops.confidence` of the stale last_logit row (table row 0).
    Returns HeadStats: table (TokenStats [table rows]), finite [Rb] (each raw row finite), logits (kept under the
    shift)."""
    suppress = cfg.mask_token_id if cfg.suppress_mask_token else None
    entropy = cfg.sampling_strategy == "neg_entropy"
    # under the shift the head keeps its raw logits (hidden.dtype [Rb, V], written by the statistics pass): the
    # winner's next last_logit is one row of them, where a GEMV would read the head weight again (Dream-7B: 1.09 GB,
    # ~0.25 ms of a ~4.5 ms round on an H200)
    hc = ops.head_confidence(hidden, head, suppress, NEG_ENTROPY_EPS, entropy, keep_logits=geo.shift, check=False)
    pick = {"default": hc.p_max, "margin": hc.margin, "neg_entropy": hc.neg_entropy}[cfg.sampling_strategy]
    conf, x0, p = pick, hc.token, hc.p_max
    if geo.shift:
        c = ops.confidence(st["last_logit"][None, :], suppress, NEG_ENTROPY_EPS, check=False)
        c_conf = {"default": c.p_max, "margin": c.margin, "neg_entropy": c.neg_entropy}[cfg.sampling_strategy]
        conf, x0, p = torch.cat([c_conf, conf]), torch.cat([c.token, x0]), torch.cat([c.p_max, p])
    return HeadStats(TokenStats(conf, x0, p), hc.finite, hc.logits)
