"""The threshold step (Fast-dLLM v1 / dParallel): ONE function of the step state (lopa_fast.strategies.steps), run
eagerly at exact sizes by the driver (lopa_fast.strategies.threshold.driver) and compiled / captured at bucket sizes.

A step of `kind` (steps' table: full | refresh | refresh_first | prefix | dual) forwards its window, computes the
token statistics of its rows (`sampling.threshold_stats`, the reference's formula), commits by the rule
(`ops.select_step`, one op: rank 1 plus the threshold / factor / entropy rule; a Dream refresh commits the
block's first token unconditionally), counts multi-token and no-op steps, and ends in the head. `parts` splits it
around its forward (a batch shares the forward).
"""
from __future__ import annotations

import torch

from lopa_fast import keyed, ops
from lopa_fast.strategies import steps
from lopa_fast.strategies.steps import StepGeometry
from lopa_fast.sampling import threshold_stats


def parts(geo: StepGeometry, kind: str, sizes: tuple, s: int | None = None, head=None):
    """(pre, post) of the step of `kind` on `sizes` (module docstring) split around its forward:
    pre(st, T) -> (its forward's part, ctx), post(st, T, ctx, logits, k_win, v_win) -> (st, {"logits"}).
    s: the window start as a host int (eager: the driver knows it; the prefix is then sliced exactly, the dual
    window written with slices), or None (compiled: st["s"], a device value). head: the LM-head weight [V, H] with
    geo.fused_head (the forward then returns final-normed rows), else None."""
    return ((lambda st, T: pre(st, T, geo, kind, sizes, s)),
            (lambda st, T, ctx, *out: post(st, T, geo, kind, ctx, *out, head=head)))


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
                 rows=raw, attn_backend=geo.attn_backend, output="hidden" if geo.fused_head else "logits")
    elif kind == "prefix":
        cols = (sd + torch.arange(sizes[0], device=dev)).clamp(max=L - 1)
        a = steps.args(st, x.index_select(0, cols)[None], start, start, (L - sd).reshape(1), raw, geo)
    else:
        a = steps.full_args(st, x[None], raw, geo)
    return a, dict(pos=pos, valid=valid)


def post(st: dict, T: dict, geo: StepGeometry, kind: str, ctx: dict, logits, k=None, v=None,
         head=None) -> tuple[dict, dict]:
    """A step after its forward (raw logits [R, V]; with geo.fused_head the final-normed rows [R, H] and head the
    LM-head weight; a refresh's K/V [layers, 1, L, Hkv, D] become the cache): the statistics, then
    `ops.select_step` (one op: the candidates, the guard's row, the rule, the commit, the counters, the head)."""
    pos, valid = ctx["pos"], ctx["valid"]
    if kind in ("refresh", "refresh_first"):
        st["ck"].copy_(k[:, 0])  # all L rows: a "prefix" step reads only [0, s)
        st["cv"].copy_(v[:, 0])
    temperature = steps.temperature(geo, T)
    fwd = st["fwd"] + 1
    if geo.fused_head:  # T = 0, Dream family, threshold / factor rule: x0 = arg-max, conf = p_max; no entropy read
        hc = steps.head_stats(logits, head, geo)
        finite, x0, conf = hc.finite, hc.token, hc.p_max
        ent = torch.zeros_like(conf, dtype=torch.float64)
    else:
        finite = steps.rows_finite(logits, temperature)
        keys = steps.keys(T, keyed.TOKEN, fwd, pos) if geo.sampling else None
        x0, conf, ent = threshold_stats(logits, stats_in_float64=geo.stats_in_float64, temperature=temperature,
                                        top_p=T["top_p"] if geo.nucleus else None, top_k=geo.top_k,
                                        suppress_token=geo.mask_id if geo.suppress_mask else None,
                                        keys=keys)
    rule = "first" if kind == "refresh_first" else geo.rule  # Dream refresh: the block's first token, unconditionally
    r = ops.select_step(st["x"], pos, valid, x0, conf, ent, finite, st["multi"], st["noop"], st["s"], T[geo.rule],
                        rule=rule, mask_id=geo.mask_id, B=geo.B, check=False)
    st.update(x=r.x, fm=r.fm, multi=r.multi, noop=r.noop, head=r.head, fwd=fwd)
    return st, ({"logits": logits} if head is None else {"logits": logits, "head": head})
