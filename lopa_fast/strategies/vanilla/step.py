"""The vanilla step (LLaDA's `generate`, Dream's `diffusion_generate`): ONE function of the step state
(lopa_fast.strategies.steps), run eagerly at exact sizes by the driver (lopa_fast.strategies.vanilla.driver) and
compiled / captured at bucket sizes.

"block_topk" (LLaDA): the cache-free forward (cfg_scale > 0: the conditional and the prompt-masked unconditional
rows in one forward of 2) on rows [fm, e), `llada_choice`, and the top-k commit of the schedule's count k over the
full-length confidence row. "timestep" (Dream): the forward on rows [min(fm, L - 1), L), then `origin`'s keyed
reveal with probability 1 - s/t, or the top-n (or, with alg_temp, a keyed draw without replacement) of its
confidence, n = the step's transfer count. `parts` splits a step around its forward (a batch shares the forward).
"""
from __future__ import annotations

import torch

from lopa_fast import keyed
from lopa_fast.strategies import steps
from lopa_fast.decode.shapes import divided, scaled
from lopa_fast.strategies.steps import StepGeometry
from lopa_fast.sampling import gumbel_argmax, token_stats
from lopa_fast.strategies.vanilla.spec import DREAM_CONFIDENCE


def parts(geo: StepGeometry, kind: str, sizes: tuple, s: int | None = None, head=None):
    """(pre, post) of the step of `kind` ("block_topk" | "timestep") on `sizes` ((Rb, k) | (Rb, n)) split around
    its forward: pre(st, T) -> (its `forward_requests` part, ctx), post(st, T, ctx, logits, k_win, v_win) ->
    (st, {"logits"}). s: unused (vanilla's forwards are cache-free; threshold_step.parts' signature)."""
    if kind == "block_topk":
        return (lambda st, T: llada_pre(st, T, geo, sizes)), (lambda st, T, c, *o: llada_post(st, T, geo, sizes, c,
                                                                                               *o))
    return ((lambda st, T: dream_pre(st, T, geo, sizes)),
            (lambda st, T, c, *o: dream_post(st, T, geo, sizes, c, *o, head=head)))


def llada_choice(logits: torch.Tensor, geo: StepGeometry, temperature, token_keys, remask_keys) -> tuple:
    """Vanilla LLaDA's token choice and confidence from the (cfg-mixed) logits [n, V] of n candidate rows:
    (x0 [n], x0_p [n]): the EOS (logits_eos_inf) and mask (suppress_mask_token) ids at -inf, x0 = argmax or the
    keyed Gumbel-max at T > 0 (temperature: a float, or the tables' 0-d knob; token_keys [n]), x0_p =
    softmax(logits)[x0] (low_confidence) or a keyed uniform (random: remask_keys [n]); blocked ids get confidence
    -1 (committed last, as the reference). Callers run the numerics guard on the logits before this."""
    if geo.eos_inf is not None:
        logits = logits.clone()
        logits[:, geo.eos_inf] = float("-inf")
    if geo.suppress_mask:
        logits = logits.clone()
        logits[:, geo.mask_id] = float("-inf")
    x0 = gumbel_argmax(logits, temperature, keys=token_keys)
    if geo.remasking == "low_confidence":
        x0_p = torch.softmax(logits, dim=-1).gather(-1, x0[:, None]).squeeze(-1)
    else:
        x0_p = keyed.uniform(remask_keys)
    for t in geo.blocked:
        x0_p = torch.where(x0 == t, torch.full_like(x0_p, -1.0), x0_p)
    return x0, x0_p


def llada_pre(st: dict, T: dict, geo: StepGeometry, sizes: tuple) -> tuple[dict, dict]:
    """Vanilla LLaDA's forward arguments: x (cfg_scale > 0: and its prompt-masked twin) on rows [fm, e)."""
    x, L, dev = st["x"], geo.L, st["x"].device
    pos, valid, raw = steps.rows(st["fm"], st["e"], sizes[0], L, False)
    if geo.guidance:  # conditional and unconditional (prompt masked) rows in one forward
        un_x = torch.where(torch.arange(L, device=dev) < T["P"], geo.mask_id, x)
        return steps.full_args(st, torch.stack([x, un_x]), torch.cat([raw, raw + L]), geo), dict(pos=pos, valid=valid)
    return steps.full_args(st, x[None], raw, geo), dict(pos=pos, valid=valid)


def llada_post(st: dict, T: dict, geo: StepGeometry, sizes: tuple, ctx: dict, logits, k_win=None, v_win=None):
    """Vanilla LLaDA's step after its forward (raw logits [Rb or 2 Rb, V]): the choice, the top-k commit."""
    Rb, k = sizes
    x, L, dev, mask_id = st["x"], geo.L, st["x"].device, geo.mask_id
    pos, valid = ctx["pos"], ctx["valid"]
    if geo.guidance:
        cond, un = logits[:Rb], logits[Rb:]
        logits = un + scaled(cond - un, T["cfg_scale"] + 1)  # as upstream's `(cfg_scale + 1) * (cond - un)`
    fwd = st["fwd"] + 1
    pos_c = pos.clamp(max=L - 1)
    cand = (x.index_select(0, pos_c) == mask_id) & valid
    temperature = steps.temperature(geo, T)
    bad = steps.first_bad_row(logits, cand, temperature)
    token_keys = steps.keys(T, keyed.TOKEN, fwd, pos) if geo.sampling else None
    remask_keys = steps.keys(T, keyed.REMASK, fwd, pos) if geo.remasking == "random" else None
    x0, x0_p = llada_choice(logits, geo, temperature, token_keys, remask_keys)
    # full-length rows, so torch.topk sees the reference's vector (its order among exact ties)
    minus_inf = torch.full((L,), float("-inf"), dtype=x0_p.dtype, device=dev)
    conf = steps.scatter(minus_inf, pos_c, valid, torch.where(cand, x0_p, float("-inf")))
    sel = torch.topk(conf, k).indices
    x0_full = steps.scatter(x, pos_c, valid, x0)
    st["fwd"] = fwd
    st["transferred"] = st["transferred"] + k
    return steps.finish(st, x.index_copy(0, sel, x0_full.index_select(0, sel)), bad, geo, logits)


def dream_pre(st: dict, T: dict, geo: StepGeometry, sizes: tuple) -> tuple[dict, dict]:
    """Vanilla Dream's forward arguments: x on rows [min(fm, L - 1), L) (no mask left: one row no rule reads)."""
    pos, valid, raw = steps.rows(st["fm"].clamp(max=geo.L - 1), geo.L, sizes[0], geo.L, True)
    return steps.full_args(st, st["x"][None], raw, geo), dict(pos=pos, valid=valid)


def dream_post(st: dict, T: dict, geo: StepGeometry, sizes: tuple, ctx: dict, logits, k_win=None, v_win=None,
               head=None):
    """Vanilla Dream's step after its forward (raw logits [Rb, V]; with geo.fused_head the final-normed rows [Rb, H]
    and head the LM-head weight): its alg's reveal or top-n commit."""
    Rb, n = sizes
    x, L, dev, mask_id = st["x"], geo.L, st["x"].device, geo.mask_id
    pos, valid = ctx["pos"], ctx["valid"]
    fwd = st["fwd"] + 1
    pos_c = pos.clamp(max=L - 1)
    cand = (x.index_select(0, pos_c) == mask_id) & valid
    temperature = steps.temperature(geo, T)
    if geo.fused_head:  # T = 0, no top-p / top-k, no race: the arg-max and the alg's confidence of each row
        hc = steps.head_stats(logits, head, geo, entropy=geo.alg == "entropy")
        bad = steps.first_bad(hc.finite, cand)
    else:
        bad = steps.first_bad_row(logits, cand, temperature)
        keys = steps.keys(T, keyed.TOKEN, fwd, pos) if geo.sampling else None
        kw = dict(temperature=temperature, top_p=T["top_p"] if geo.nucleus else None, top_k=geo.top_k,
                  suppress_token=mask_id if geo.suppress_mask else None)

    def stats(strategy: str = "default"):
        """(conf [Rb], x0 [Rb], p [Rb]) of the rows: `token_stats`' fields, or the fused head's."""
        if geo.fused_head:
            return {"default": hc.p_max, "margin": hc.margin, "neg_entropy": hc.neg_entropy}[strategy], hc.token, \
                hc.p_max
        return token_stats(logits, sampling_strategy=strategy, **kw, keys=keys)

    i = st["i"]
    if geo.alg == "origin":
        # in range whatever the state (a CUDA capture's warm-up runs on the workspace's last state, possibly a
        # finished request's i = steps: an out-of-range index would be a device assert)
        ic = i.clamp(max=geo.n_steps - 1).reshape(1)
        t, s = T["ts"].index_select(0, ic)[0], T["ts"].index_select(0, ic + 1)[0]
        p_transfer = torch.where(i < geo.n_steps - 1, 1 - s / t, torch.ones_like(t))
        reveal = cand & (keyed.uniform(steps.keys(T, keyed.REVEAL, fwd, pos)) < p_transfer)
        _, tok, _ = stats()
        x = steps.scatter(x, pos_c, reveal, tok)
        st["transferred"] = st["transferred"] + reveal.sum()
    else:
        conf, x0, _ = stats(DREAM_CONFIDENCE[geo.alg])
        cdt = head.dtype if geo.fused_head else logits.dtype  # the logits' dtype, as the reference's row
        minus_inf = torch.full((L,), float("-inf"), dtype=cdt, device=dev)
        full_conf = steps.scatter(minus_inf, pos_c, valid, torch.where(cand, conf.to(cdt), float("-inf")))
        if n > 0:
            masks = torch.full((L,), mask_id, dtype=x.dtype, device=dev)
            x0_full = steps.scatter(masks, pos_c, valid, torch.where(cand, x0, mask_id))
            if not geo.race:
                sel = torch.topk(full_conf, n).indices
                x = x.index_copy(0, sel, x0_full.index_select(0, sel))
            else:  # n of L without replacement, p ~ softmax(conf / alg_temp), keyed
                race = keyed.top_n_race(torch.softmax(divided(full_conf, T["alg_temp"]), -1), n,
                                        steps.keys(T, keyed.ORDER, fwd, torch.arange(L, device=dev)))
                x = torch.where(race, x0_full, x)
        st["transferred"] = st["transferred"] + n
    st["fwd"] = fwd
    st["i"] = i + 1
    return steps.finish(st, x, bad, geo, logits, head)
