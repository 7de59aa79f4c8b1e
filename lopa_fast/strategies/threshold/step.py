"""The threshold step (Fast-dLLM v1 / dParallel): ONE function of the step state (lopa_fast.decode.steps), run
eagerly at exact sizes by the driver (lopa_fast.strategies.threshold.driver) and compiled / captured at bucket sizes.

A step of `kind` (steps' table: full | refresh | refresh_first | prefix | dual) forwards its window, computes the
token statistics of its rows (`sampling.threshold_stats`, the reference's formula), commits by the rule
(`select_by_rule`: rank 1 plus the threshold / factor / entropy rule, as tensor ops; a Dream refresh commits the
block's first token unconditionally), counts multi-token and no-op steps, and ends in the head. `parts` splits it
around its forward (a batch shares the forward).
"""
from __future__ import annotations

import torch

from lopa_fast import keyed
from lopa_fast.decode import steps
from lopa_fast.decode.steps import RULES, StepGeometry
from lopa_fast.sampling import threshold_stats


def parts(geo: StepGeometry, kind: str, sizes: tuple, s: int | None = None):
    """(pre, post) of the step of `kind` on `sizes` (module docstring) split around its forward:
    pre(st, T) -> (its forward's part, ctx), post(st, T, ctx, logits, k_win, v_win) -> (st, {"logits"}).
    s: the window start as a host int (eager: the driver knows it; the prefix is then sliced exactly, the dual
    window written with slices), or None (compiled: st["s"], a device value)."""
    return ((lambda st, T: pre(st, T, geo, kind, sizes, s)),
            (lambda st, T, ctx, *out: post(st, T, geo, kind, ctx, *out)))  # fmt: skip


def pre(st: dict, T: dict, geo: StepGeometry, kind: str, sizes: tuple, s: int | None = None) -> tuple[dict, dict]:
    """A step's forward arguments and its rows (positions [n], valid [n]): full / refresh: rows [fm, e) of the
    cache-free forward; refresh_first: the row predicting the block start; prefix: the block's rows of the window
    x[s : s + Nb] over the cached prefix; dual: the block x[s : s + B] (a `model.forward_dual` part, its K/V written
    over cache rows [s, s + B), attending to the whole cache [0, L))."""
    x, sd, L, dev = st["x"], st["s"], geo.L, st["x"].device
    start = sd if s is None else s
    if kind in ("full", "refresh"):  # candidates: every mask in [fm, e)
        pos, valid, raw = steps.rows(st["fm"], st["e"], sizes[0], L, geo.shift)
    elif kind == "refresh_first":  # the row predicting the block start
        pos, valid, raw = steps.rows(sd, sd + 1, 1, L, geo.shift)
    else:  # "prefix" / "dual": the block [s, s + B) of a window starting at s
        pos, valid, raw = steps.rows(sd, sd + geo.B, geo.B, L, geo.shift, win_start=sd)
    if kind == "dual":
        a = dict(tokens=x.index_select(0, pos)[None], start=start, cache_k=st["ck"], cache_v=st["cv"], prefix_len=L,
                 rows=raw, attn_backend=geo.attn_backend)  # fmt: skip
    elif kind == "prefix":
        cols = (sd + torch.arange(sizes[0], device=dev)).clamp(max=L - 1)
        a = steps.args(st, x.index_select(0, cols)[None], start, start, (L - sd).reshape(1), raw)
    else:
        a = steps.full_args(st, x[None], raw)
    return a, dict(pos=pos, valid=valid)


def post(st: dict, T: dict, geo: StepGeometry, kind: str, ctx: dict, logits, k=None, v=None) -> tuple[dict, dict]:
    """A step after its forward (raw logits [R, V]; a refresh's K/V [layers, 1, L, Hkv, D] become the cache):
    statistics, the rule, the commit, the head."""
    x, L = st["x"], geo.L
    pos, valid = ctx["pos"], ctx["valid"]
    if kind in ("refresh", "refresh_first"):
        st["ck"].copy_(k[:, 0])  # all L rows: a "prefix" step reads only [0, s)
        st["cv"].copy_(v[:, 0])
    pos_c = pos.clamp(max=L - 1)
    cand = (x.index_select(0, pos_c) == geo.mask_id) & valid
    only_first = kind == "refresh_first"  # Dream refresh: the block's first token, unconditionally
    temperature = steps.temperature(geo, T)
    bad = steps.first_bad_row(logits, valid if only_first else cand, temperature)
    fwd = st["fwd"] + 1
    keys = steps.keys(T, keyed.TOKEN, fwd, pos) if geo.sampling else None
    x0, conf, ent = threshold_stats(logits, stats_in_float64=geo.stats_in_float64, temperature=temperature,
                                    top_p=T["top_p"] if geo.nucleus else None, top_k=geo.top_k,
                                    suppress_token=geo.mask_id if geo.suppress_mask else None, keys=keys)  # fmt: skip
    if only_first:
        sel = valid
    else:
        sel = select_by_rule(conf, ent, cand, **{r: T[r] if r == geo.rule else None for r in RULES})
        nsel = sel.sum()
        st["multi"] = st["multi"] + (nsel >= 2).long()
        st["noop"] = st["noop"] + (nsel == 0).long()
    st["fwd"] = fwd
    return steps.finish(st, steps.scatter(x, pos_c, sel & valid, x0), bad, geo, logits)


# ---- the commit rule -----------------------------------------------------------------------------------------
def rank_desc(key: torch.Tensor) -> torch.Tensor:
    """rank [n] long of each entry in a descending stable sort of key [n] (0 = the largest; exact ties: the
    lower index first)."""
    order = torch.sort(key, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(key.numel(), device=key.device))


def select_by_rule(conf: torch.Tensor, ent: torch.Tensor, cand: torch.Tensor, factor=None, entropy_threshold=None,
                   threshold=None) -> torch.Tensor:
    """bool [n]: the candidates (cand [n]) this step commits, from conf [n] and entropy [n] (no host read); the rule
    knobs (one of them not None) are floats, or 0-d float64 tensors (the step's runtime inputs, the tables): the
    formulas round a tensor exactly as they round a float.

    Rank 1 (the highest conf, or the lowest entropy; first index on exact ties) is always committed; the rule
    adds the others: threshold: conf >= tau (upstream drops conf < tau, so equality commits; tau compared in
    conf's dtype, as upstream's tensor-vs-float comparison); entropy_threshold: H <= h; factor: the top
    `count` ranks, count = the first 0-based rank b with c(b) < 1 - f/(b+2) (rank 0's threshold is -1), or
    every candidate when there is none or b is the last rank (upstream's edge case), in float64."""
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
