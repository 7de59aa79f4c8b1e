"""compile=True for the fast vanilla and threshold decoders: each step as a function of static shapes.

The eager steps (lopa_fast.decode.{vanilla,threshold}) slice with host ints: the LM head runs on rows
[first mask, block end), the prefix window is x[s:], the dual window writes cache rows [s, s + B). A compiled
(CPU: torch.compile fullgraph) or captured (CUDA graph) step cannot take those as shapes without one graph per
value, so here every per-step value is a 0-d device tensor of the state and every shape is a bucket constant:

  kind             forward (lopa_fast.models.DecoderLM.forward_static unless noted)     bucket sizes
  "full"           x [L] (cfg_scale > 0: [2, L]) with no cache; LM head on Rb rows from   (Rb,)
                   the first mask fm (rows past the block end e are padding)
  "refresh"        the same forward, its K/V of all L positions become the cache (a      (Rb,)
                   "prefix" step masks the rows >= s it does not own); LLaDA threshold
  "refresh_first"  the refresh with the one row predicting the block start s (Dream)   (1,)
  "prefix"         window x[s : s + Nb] over the cached prefix [0, s) (a masked static  (Nb,)
                   buffer); columns past L are padding (masked keys, unread rows)
  "dual"           window x[s : s + B] whose K/V overwrite cache rows [s, s + B) in      ()
                   place (index_copy_), attending to the whole cache
  "block_topk"     vanilla LLaDA: "full" + the top-k commit, k = the schedule's count   (Rb, k)
  "timestep"       vanilla Dream: "full" over rows [min(fm, L - 1), L) + its commit,    (Rb, n)
                   n = the step's transfer count

k and n stay bucket constants (not device values) because the commit is `torch.topk` over the full-length
confidence row, as in the eager path and the reference: its choice among exactly tied confidences (common:
saturated probabilities of 1.0, LLaDA's blocked EOS at -1) is the implementation's, so only the same call
on the same vector is exact. LLaDA's schedule has at most two counts; Dream's counts vary with the step
(a bucket each; a CUDA capture costs one eager step). Rb = shapes.pow2_bucket(rows): a power of two >= 16.

Every index is in range whatever the state (positions clamped to L - 1, writes of padding to the trash slot):
a CUDA capture's warm-up runs on the workspace's last state, possibly a finished request's.
Padding: rows of positions outside [lo, hi) are `valid = False`: never candidates, never committed (their
writes go to a trash slot L of an [L + 1] scratch row), never read by the numerics guard. The host reads
the step's `head` [4] = (first non-finite read row or -1, block full, first mask, masks left) ONCE per step,
as the eager step does; the logits are returned (graph-owned under CUDA graphs) only for the error message.

State (`init`, per request; the CUDA workspace of CompiledRounds per StepGeometry):
  x [L] long; fwd (forwards so far: the keyed sampler's step), i (Dream's step index), fm, s, e 0-d long;
  transferred, multi, noop 0-d long counters; head [4] long; ck, cv [layers, L or 1, Hkv, D] the cache.
Tables T: P (prompt length), seed (the keyed sampler's, as int64 bits), ts (Dream's timesteps, float32), and the
float knobs (`step_knobs`: temperature, top_p, threshold, factor, entropy_threshold, cfg_scale, alg_temp) as 0-d
float64 runtime inputs: a step's graph serves every value; only whether a knob is on is in the StepGeometry.
The host writes s and e in place (`fill_`) at each block start: a kernel launch, not a host read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lopa_fast import keyed, ops
from lopa_fast.decode import steps
from lopa_fast.decode.shapes import divided, knob, scaled
from lopa_fast.models.transformer import rms_norm
from lopa_fast.sampling import gumbel_argmax

HEAD = ("bad", "full", "first_mask", "masks_left")
# the threshold strategy's rules (GenerateConfig's names), in `steps.select_by_rule`'s order of precedence
RULES = ("factor", "entropy_threshold", "threshold")
KNOBS = ("temperature", "top_p", *RULES, "cfg_scale", "alg_temp")  # float knobs: runtime inputs (tables)
LLADA_EOT_ID = 126348  # LLaDA's <|eot_id|>, hard-coded upstream for confidence_eos_eot_inf
DREAM_CONF = {"maskgit_plus": "default", "topk_margin": "margin", "entropy": "neg_entropy"}


@dataclass(frozen=True)
class StepGeometry:
    """Every Python constant a compiled step of one request reads (it keys the compiled callables and the CUDA
    workspace: two requests share a step's graph iff their geometries are equal). Float knobs are not constants:
    the geometry says whether each is on, its value is a runtime input in the tables (`step_knobs`)."""

    strategy: str  # "vanilla" | "threshold"
    stats_in_float64: bool  # the model family's token statistics (ModelConfig.stats_in_float64)
    shift: bool  # Dream's logits shift
    L: int  # prompt + generation
    B: int  # block length (threshold, LLaDA vanilla; 0 for Dream vanilla)
    mask_id: int
    sampling: bool  # temperature > 0 (the value: T["temperature"])
    nucleus: bool  # a top-p filter (top_p < 1; the value: T["top_p"])
    top_k: int | None
    suppress_mask: bool
    attn_backend: str
    cache: str | None = None
    rule: str | None = None  # the threshold rule set ("threshold" | "factor" | "entropy_threshold"; its value: T)
    guidance: bool = False  # LLaDA's cfg_scale > 0 (the value: T["cfg_scale"])
    remasking: str | None = None
    eos_inf: int | None = None  # logits_eos_inf: this id's logits -> -inf (None: off)
    blocked: tuple = ()  # confidence_eos_eot_inf: ids committed last (confidence -1)
    alg: str | None = None
    race: bool = False  # Dream's alg_temp > 0: a keyed draw without replacement (the value: T["alg_temp"])
    n_steps: int = 0  # Dream vanilla's steps


def geometry(model, cfg, L: int) -> StepGeometry:
    """The StepGeometry of a bound, covered vanilla / threshold config on `model` for L positions (the eager
    steps read their LLaDA knobs from it too: `llada_choice`)."""
    from lopa_fast.ops import _backend

    # the knobs tell the step apart (each is one strategy's own, validated so): a resolved Dream vanilla config has
    # `alg`, LLaDA vanilla has `remasking`, threshold has `cache` / one of its three rules
    dream_vanilla = cfg.alg is not None
    blocked = []
    if cfg.confidence_eos_eot_inf:  # LLaDA vanilla's knob
        blocked = [cfg.eos_token_id] if cfg.eos_token_id is not None else []
        if model.config.vocab_size > LLADA_EOT_ID:
            blocked.append(LLADA_EOT_ID)
    return StepGeometry(
        strategy=cfg.strategy, stats_in_float64=model.config.stats_in_float64, shift=bool(model.logits_shift), L=L,
        B=0 if dream_vanilla else int(cfg.block_length), mask_id=cfg.mask_token_id,
        sampling=cfg.temperature > 0, nucleus=cfg.top_p is not None and cfg.top_p < 1, top_k=cfg.top_k,
        suppress_mask=bool(cfg.suppress_mask_token),
        attn_backend=_backend.resolve("branch_attention", None, model.device),
        cache=cfg.cache, rule=next((r for r in RULES if getattr(cfg, r, None) is not None), None),
        guidance=(cfg.cfg_scale or 0.0) > 0, remasking=cfg.remasking,
        eos_inf=cfg.eos_token_id if cfg.logits_eos_inf else None,
        blocked=tuple(blocked), alg=cfg.alg if dream_vanilla else None,
        race=dream_vanilla and bool(cfg.alg_temp), n_steps=int(cfg.steps) if dream_vanilla else 0,
    )  # fmt: skip


def step_knobs(cfg) -> dict[str, float | None]:
    """A request's float knobs, the tables' runtime inputs of its steps (None: off; `init` stores 0.0)."""
    return {name: getattr(cfg, name, None) for name in KNOBS}


def _rule_knobs(geo: StepGeometry, T: dict) -> dict:
    """The threshold rule as `steps.select_by_rule` takes it: the set rule's tables knob, the others None."""
    return {r: T[r] if r == geo.rule else None for r in RULES}


def _temperature(geo: StepGeometry, T: dict):
    """The temperature a step computes with: the tables' knob when it samples, else 0.0 (greedy: another graph)."""
    return T["temperature"] if geo.sampling else 0.0


def init(model, x: torch.Tensor, P: int, geo: StepGeometry, seed: int, ts: torch.Tensor | None = None,
         knobs: dict | None = None, cache=None):
    """(state, tables) of a request whose canvas is x [L] (prompt + masks); seed: the keyed sampler's (resolved);
    ts: Dream's timesteps [steps + 1] float32 on x's device (None elsewhere); knobs: `step_knobs(cfg)` (None: all
    off); cache: None (its own zero cache) or (k, v) views [layers, L or 1, Hkv, D] it uses in its place (a batch's
    KV pool slot)."""
    dev = x.device
    c = model.config
    z = lambda v=0: torch.full((), v, dtype=torch.long, device=dev)  # noqa: E731
    rows = geo.L if geo.cache is not None else 1  # no cache: the eager path's one unused row
    shape = (c.num_layers, rows, c.num_kv_heads, c.head_dim)
    if cache is None:
        cache = tuple(torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(2))
    elif any(tuple(t.shape) != shape for t in cache):
        raise ValueError(f"static_steps.init: cache views must be {shape}, got {[tuple(t.shape) for t in cache]}")
    st = {"x": x.clone(), "fwd": z(), "i": z(), "fm": z(P), "s": z(P), "e": z(P + geo.B),
          "transferred": z(), "multi": z(), "noop": z(), "head": torch.zeros(len(HEAD), dtype=torch.long, device=dev),
          "ck": cache[0], "cv": cache[1]}  # fmt: skip
    T = {"P": z(P), "seed": z(keyed._s64(int(seed) % (1 << 64))),
         "ts": ts if ts is not None else torch.zeros(1, dtype=torch.float32, device=dev)}  # fmt: skip
    T.update({name: knob((knobs or {}).get(name), dev) for name in KNOBS})
    return st, T


# ---- the forwards (static shapes; positions and prefix lengths are device tensors) -------------------------
# A step's forward is described by its arguments (a `model.forward_requests` part: tokens, start, cache_k, cache_v,
# prefix_len, win_lens, bids, rows): alone it runs as `forward_static` (`_forward`), in a compiled batch as one
# request's part of the shared forward (lopa_fast.decode.compiled_batch).
def _forward(model, a: dict, geo) -> tuple:
    return model.forward_static(a["tokens"], a["start"], a["cache_k"], a["cache_v"], a["prefix_len"], a["win_lens"],
                                None, "full", a["rows"], attn_backend=geo.attn_backend)  # fmt: skip


def _args(st: dict, tokens: torch.Tensor, start, cache_len, win_lens, rows) -> dict:
    return dict(tokens=tokens, start=start, cache_k=st["ck"], cache_v=st["cv"], prefix_len=cache_len,
                win_lens=win_lens, bids=None, rows=rows)  # fmt: skip


def _full(st: dict, tokens: torch.Tensor, rows: torch.Tensor) -> dict:
    """The cache-free forward of tokens [Bt, L] (as StepForward.full / refresh): its arguments."""
    Bt, n = tokens.shape
    zero = torch.zeros((), dtype=torch.long, device=tokens.device)
    win_lens = torch.full((Bt,), n, dtype=torch.long, device=tokens.device)
    return _args(st, tokens, zero, 0, win_lens, rows)


def _dual(model, st: dict, win: torch.Tensor, s: torch.Tensor, rows: torch.Tensor, geo) -> torch.Tensor:
    """StepForward.dual with the window start s a 0-d tensor: win [n]'s K/V written over cache rows [s, s + n)
    (index_copy_ instead of a slice), attending to the whole cache [0, L); raw logits [R, V]."""
    ck, cv, L, n = st["ck"], st["cv"], geo.L, win.numel()
    dst = s + torch.arange(n, device=win.device)
    no_window = torch.zeros(1, dtype=torch.long, device=win.device)

    def attend(i, q, k, v):
        ck[i].index_copy_(0, dst, k[0])
        cv[i].index_copy_(0, dst, v[0])
        return ops.branch_attention(q, ck[i], cv[i], L, k, v, no_window, None, "full", check=False,
                                    backend=geo.attn_backend)  # fmt: skip

    h = model._layers(win[None], dst, attend).reshape(n, -1).index_select(0, rows)
    h = rms_norm(h, model.final_norm_weight(), model.config.rms_norm_eps)
    return F.linear(h, model.head_weight())


# ---- helpers -------------------------------------------------------------------------------------------------
def _rows(lo: torch.Tensor, hi, n: int, L: int, shift: bool, win_start=0):
    """(positions [n] = lo + arange(n), valid [n] = position < hi, raw rows [n] in range): the static form of
    arange(lo, hi) and steps.raw_rows (Dream's shift: row q - win_start - 1, the window's first row its own)."""
    pos = lo + torch.arange(n, device=lo.device)
    r = pos - win_start
    raw = (r - 1).clamp(min=0) if shift else r
    return pos, pos < hi, raw.clamp(max=L - 1)


def _scatter(base: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """base [L] with values [n] written at pos [n] where write [n] (the others go to a trash slot L)."""
    L = base.numel()
    ext = torch.cat([base, base[:1]])
    return ext.index_copy(0, torch.where(write, pos, L), values.to(base.dtype))[:L]


def _keys(T: dict, stream: int, fwd: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return keyed.key(T["seed"], stream, fwd, 0, pos)


def _finish(st: dict, x: torch.Tensor, bad: torch.Tensor, geo, logits: torch.Tensor) -> tuple[dict, dict]:
    """The end of every step: the new canvas, the first mask, the head the host reads once."""
    dev = x.device
    fm = steps.first_mask(x, geo.mask_id)
    full = torch.zeros((), dtype=torch.bool, device=dev)
    if geo.B:
        blk = (st["s"] + torch.arange(geo.B, device=dev)).clamp(max=geo.L - 1)
        full = ~(x.index_select(0, blk) == geo.mask_id).any()
    st.update(x=x, fm=fm)
    st["head"] = torch.stack([bad, full.long(), fm, (x == geo.mask_id).sum()]).long()
    return st, {"logits": logits}


def llada_choice(logits: torch.Tensor, geo: StepGeometry, temperature, token_keys, remask_keys) -> tuple:
    """Vanilla LLaDA's token choice and confidence from the (cfg-mixed) logits [n, V] of n candidate rows, eager
    and compiled alike: (x0 [n], x0_p [n]): the EOS (logits_eos_inf) and mask (suppress_mask_token) ids at
    -inf, x0 = argmax or the keyed Gumbel-max at T > 0 (temperature: a float, or the tables' 0-d knob; token_keys
    [n]), x0_p = softmax(logits)[x0]
    (low_confidence) or a keyed uniform (random: remask_keys [n]); blocked ids get confidence -1 (committed
    last, as the reference). Callers run the numerics guard on the logits before this."""
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


# ---- the steps -------------------------------------------------------------------------------------------------
def threshold_step(model, st: dict, T: dict, geo: StepGeometry, kind: str, sizes: tuple) -> tuple[dict, dict]:
    """One threshold step (lopa_fast.decode.threshold's `step` after its forward) of `kind` on bucket `sizes`
    (module docstring); reads and replaces the tensors of st; no host read."""
    if kind == "dual":  # its forward writes the cache inside the layer loop: not a `forward_requests` part
        pos, valid, raw = _rows(st["s"], st["s"] + geo.B, geo.B, geo.L, geo.shift, win_start=st["s"])
        logits = _dual(model, st, st["x"].index_select(0, pos), st["s"], raw, geo)
        return _threshold_post(st, T, geo, kind, dict(pos=pos, valid=valid), logits, None, None)
    a, ctx = _threshold_pre(st, T, geo, kind, sizes)
    return _threshold_post(st, T, geo, kind, ctx, *_forward(model, a, geo))


def _dual_pre(st: dict, geo: StepGeometry) -> tuple[dict, dict]:
    """A dual step's `steps.dual_forwards` part: the block x[s : s + B] at positions s.. (0-d s), its K/V written over
    cache rows [s, s + B), attending to the whole cache [0, L)."""
    s = st["s"]
    pos, valid, raw = _rows(s, s + geo.B, geo.B, geo.L, geo.shift, win_start=s)
    return dict(tokens=st["x"].index_select(0, pos)[None], start=s, cache_k=st["ck"], cache_v=st["cv"],
                prefix_len=geo.L, rows=raw, attn_backend=geo.attn_backend), dict(pos=pos, valid=valid)


def _threshold_pre(st: dict, T: dict, geo: StepGeometry, kind: str, sizes: tuple) -> tuple[dict, dict]:
    """A threshold step's forward arguments (full / refresh / refresh_first / prefix) and its rows."""
    x, s, L, dev = st["x"], st["s"], geo.L, st["x"].device
    if kind in ("full", "refresh"):  # candidates: every mask in [fm, e)
        pos, valid, raw = _rows(st["fm"], st["e"], sizes[0], L, geo.shift)
    elif kind == "refresh_first":  # the row predicting the block start
        pos, valid, raw = _rows(s, s + 1, 1, L, geo.shift)
    else:  # "prefix": the block [s, s + B) over a window starting at s
        pos, valid, raw = _rows(s, s + geo.B, geo.B, L, geo.shift, win_start=s)
    if kind == "prefix":
        cols = (s + torch.arange(sizes[0], device=dev)).clamp(max=L - 1)
        a = _args(st, x.index_select(0, cols)[None], s, s, (L - s).reshape(1), raw)
    else:
        a = _full(st, x[None], raw)
    return a, dict(pos=pos, valid=valid)


def _threshold_post(st: dict, T: dict, geo: StepGeometry, kind: str, ctx: dict, logits, k, v) -> tuple[dict, dict]:
    """A threshold step after its forward (raw logits [R, V]; a refresh's K/V [layers, 1, L, Hkv, D] become the
    cache): statistics, the rule, the commit, the head."""
    from lopa_fast.sampling import threshold_stats

    x, L = st["x"], geo.L
    pos, valid = ctx["pos"], ctx["valid"]
    if kind in ("refresh", "refresh_first"):
        st["ck"].copy_(k[:, 0])  # all L rows: a "prefix" step reads (masks) only [0, s)
        st["cv"].copy_(v[:, 0])
    pos_c = pos.clamp(max=L - 1)
    cand = (x.index_select(0, pos_c) == geo.mask_id) & valid
    only_first = kind == "refresh_first"  # Dream refresh: the block's first token, unconditionally
    temperature = _temperature(geo, T)
    bad = steps.first_bad_row(logits, valid if only_first else cand, temperature)
    fwd = st["fwd"] + 1
    keys = _keys(T, keyed.TOKEN, fwd, pos) if geo.sampling else None
    x0, conf, ent = threshold_stats(logits, stats_in_float64=geo.stats_in_float64, temperature=temperature,
                                    top_p=T["top_p"] if geo.nucleus else None, top_k=geo.top_k,
                                    suppress_token=geo.mask_id if geo.suppress_mask else None, keys=keys)  # fmt: skip
    if only_first:
        sel = valid
    else:
        sel = steps.select_by_rule(conf, ent, cand, **_rule_knobs(geo, T))
        nsel = sel.sum()
        st["multi"] = st["multi"] + (nsel >= 2).long()
        st["noop"] = st["noop"] + (nsel == 0).long()
    st["fwd"] = fwd
    return _finish(st, _scatter(x, pos_c, sel & valid, x0), bad, geo, logits)


def llada_step(model, st: dict, T: dict, geo: StepGeometry, sizes: tuple) -> tuple[dict, dict]:
    """One vanilla LLaDA step (lopa_fast.decode.vanilla `_Loop.llada`'s body) on bucket (Rb, k): rows [fm, e),
    k = this step's transfer count."""
    a, ctx = _llada_pre(st, T, geo, sizes)
    return _llada_post(st, T, geo, sizes, ctx, *_forward(model, a, geo))


def _llada_pre(st: dict, T: dict, geo: StepGeometry, sizes: tuple) -> tuple[dict, dict]:
    """Vanilla LLaDA's forward arguments: x (cfg_scale > 0: and its prompt-masked twin) on rows [fm, e)."""
    x, L, dev = st["x"], geo.L, st["x"].device
    pos, valid, raw = _rows(st["fm"], st["e"], sizes[0], L, False)
    if geo.guidance:  # conditional and unconditional (prompt masked) rows in one forward
        un_x = torch.where(torch.arange(L, device=dev) < T["P"], geo.mask_id, x)
        return _full(st, torch.stack([x, un_x]), torch.cat([raw, raw + L])), dict(pos=pos, valid=valid)
    return _full(st, x[None], raw), dict(pos=pos, valid=valid)


def _llada_post(st: dict, T: dict, geo: StepGeometry, sizes: tuple, ctx: dict, logits, k_win=None, v_win=None):
    """Vanilla LLaDA's step after its forward (raw logits [Rb or 2 Rb, V]): the choice, the top-k commit."""
    Rb, k = sizes
    x, L, dev, mask_id = st["x"], geo.L, st["x"].device, geo.mask_id
    pos, valid = ctx["pos"], ctx["valid"]
    if geo.guidance:
        cond, un = logits[:Rb], logits[Rb:]
        logits = un + scaled(cond - un, T["cfg_scale"] + 1)  # as the eager `(cfg_scale + 1) * (cond - un)`
    fwd = st["fwd"] + 1
    pos_c = pos.clamp(max=L - 1)
    cand = (x.index_select(0, pos_c) == mask_id) & valid
    temperature = _temperature(geo, T)
    bad = steps.first_bad_row(logits, cand, temperature)
    token_keys = _keys(T, keyed.TOKEN, fwd, pos) if geo.sampling else None
    remask_keys = _keys(T, keyed.REMASK, fwd, pos) if geo.remasking == "random" else None
    x0, x0_p = llada_choice(logits, geo, temperature, token_keys, remask_keys)
    minus_inf = torch.full((L,), float("-inf"), dtype=x0_p.dtype, device=dev)
    conf = _scatter(minus_inf, pos_c, valid, torch.where(cand, x0_p, float("-inf")))
    sel = torch.topk(conf, k).indices
    x0_full = _scatter(x, pos_c, valid, x0)
    st["fwd"] = fwd
    st["transferred"] = st["transferred"] + k
    return _finish(st, x.index_copy(0, sel, x0_full.index_select(0, sel)), bad, geo, logits)


def dream_step(model, st: dict, T: dict, geo: StepGeometry, sizes: tuple) -> tuple[dict, dict]:
    """One vanilla Dream step (lopa_fast.decode.vanilla `_Loop.dream`'s body) on bucket (Rb, n): rows
    [min(fm, L - 1), L), n = this step's transfer count (unused by alg='origin')."""
    a, ctx = _dream_pre(st, T, geo, sizes)
    return _dream_post(st, T, geo, sizes, ctx, *_forward(model, a, geo))


def _dream_pre(st: dict, T: dict, geo: StepGeometry, sizes: tuple) -> tuple[dict, dict]:
    """Vanilla Dream's forward arguments: x on rows [min(fm, L - 1), L)."""
    pos, valid, raw = _rows(st["fm"].clamp(max=geo.L - 1), geo.L, sizes[0], geo.L, True)
    return _full(st, st["x"][None], raw), dict(pos=pos, valid=valid)


def _dream_post(st: dict, T: dict, geo: StepGeometry, sizes: tuple, ctx: dict, logits, k_win=None, v_win=None):
    """Vanilla Dream's step after its forward (raw logits [Rb, V]): its alg's reveal or top-n commit."""
    from lopa_fast.sampling import token_stats

    Rb, n = sizes
    x, L, dev, mask_id = st["x"], geo.L, st["x"].device, geo.mask_id
    pos, valid = ctx["pos"], ctx["valid"]
    fwd = st["fwd"] + 1
    pos_c = pos.clamp(max=L - 1)
    cand = (x.index_select(0, pos_c) == mask_id) & valid
    temperature = _temperature(geo, T)
    bad = steps.first_bad_row(logits, cand, temperature)
    keys = _keys(T, keyed.TOKEN, fwd, pos) if geo.sampling else None
    kw = dict(temperature=temperature, top_p=T["top_p"] if geo.nucleus else None, top_k=geo.top_k,
              suppress_token=mask_id if geo.suppress_mask else None)  # fmt: skip
    i = st["i"]
    if geo.alg == "origin":
        # in range whatever the state (a CUDA capture's warm-up runs on the workspace's last state, possibly a
        # finished request's i = steps: an out-of-range index would be a device assert)
        ic = i.clamp(max=geo.n_steps - 1).reshape(1)
        t, s = T["ts"].index_select(0, ic)[0], T["ts"].index_select(0, ic + 1)[0]
        p_transfer = torch.where(i < geo.n_steps - 1, 1 - s / t, torch.ones_like(t))
        reveal = cand & (keyed.uniform(_keys(T, keyed.REVEAL, fwd, pos)) < p_transfer)
        _, tok, _ = token_stats(logits, **kw, keys=keys)
        x = _scatter(x, pos_c, reveal, tok)
        st["transferred"] = st["transferred"] + reveal.sum()
    else:
        conf, x0, _ = token_stats(logits, sampling_strategy=DREAM_CONF[geo.alg], **kw, keys=keys)
        minus_inf = torch.full((L,), float("-inf"), dtype=logits.dtype, device=dev)
        full_conf = _scatter(minus_inf, pos_c, valid, torch.where(cand, conf.to(logits.dtype), float("-inf")))
        if n > 0:
            masks = torch.full((L,), mask_id, dtype=x.dtype, device=dev)
            x0_full = _scatter(masks, pos_c, valid, torch.where(cand, x0, mask_id))
            if not geo.race:
                sel = torch.topk(full_conf, n).indices
                x = x.index_copy(0, sel, x0_full.index_select(0, sel))
            else:  # n of L without replacement, p ~ softmax(conf / alg_temp), keyed
                race = keyed.top_n_race(torch.softmax(divided(full_conf, T["alg_temp"]), -1), n,
                                        _keys(T, keyed.ORDER, fwd, torch.arange(L, device=dev)))  # fmt: skip
                x = torch.where(race, x0_full, x)
        st["transferred"] = st["transferred"] + n
    st["fwd"] = fwd
    st["i"] = i + 1
    return _finish(st, x, bad, geo, logits)


def parts(geo: StepGeometry, kind: str, sizes: tuple):
    """(pre, post) of the step of `kind` on bucket `sizes` split around its forward (lopa_fast.decode.compiled_batch):
    pre(st, T) -> (forward arguments, ctx), post(st, T, ctx, logits, k_win, v_win) -> (st, {"logits"}); `step` is
    exactly pre -> forward_static -> post ("dual": pre -> steps.dual_forwards, the in-place forward -> post)."""
    if kind == "dual":
        return (lambda st, T: _dual_pre(st, geo)), (lambda st, T, c, *o: _threshold_post(st, T, geo, kind, c, *o))
    if kind == "block_topk":
        return (lambda st, T: _llada_pre(st, T, geo, sizes)), (lambda st, T, c, *o: _llada_post(st, T, geo, sizes, c,
                                                                                                 *o))  # fmt: skip
    if kind == "timestep":
        return (lambda st, T: _dream_pre(st, T, geo, sizes)), (lambda st, T, c, *o: _dream_post(st, T, geo, sizes, c,
                                                                                                 *o))  # fmt: skip
    return ((lambda st, T: _threshold_pre(st, T, geo, kind, sizes)),
            (lambda st, T, c, *o: _threshold_post(st, T, geo, kind, c, *o)))  # fmt: skip


def batch_step(compiled, view, model, st: dict, T: dict, geo: StepGeometry, kind: str, sizes: tuple):
    """The step of `kind` on bucket `sizes` as a compiled batch's BatchStep (one graph per (StepGeometry, kind,
    sizes) and batch size; lopa_fast.decode.compiled_batch). A "dual" step's forward is steps.DualForward (the
    window's K/V written into each request's cache inside the layer loop)."""
    from lopa_fast.decode.compiled_batch import BatchStep

    pre, post = parts(geo, kind, sizes)
    fwds = ((steps.DualForward(model), "full", geo.attn_backend),) if kind == "dual" else None
    return BatchStep(compiled, ("steps", geo, kind, sizes), (kind, *sizes), _label(kind, sizes), ("steps", geo),
                     pre, post, "full", geo.attn_backend, st, T, view, forwards=fwds)  # fmt: skip


def _label(kind: str, sizes: tuple) -> str:
    return kind + ("_" + "x".join(map(str, sizes)) if sizes else "")


def step(model, st: dict, T: dict, geo: StepGeometry, kind: str, sizes: tuple) -> tuple[dict, dict]:
    """The step of `kind` (module docstring) on bucket `sizes`: (state, {"logits": raw logits [R, V]})."""
    if kind == "block_topk":
        return llada_step(model, st, T, geo, sizes)
    if kind == "timestep":
        return dream_step(model, st, T, geo, sizes)
    return threshold_step(model, st, T, geo, kind, sizes)


__all__ = ["HEAD", "StepGeometry", "batch_step", "dream_step", "geometry", "init", "llada_choice", "llada_step",
           "parts", "step", "threshold_step"]


def run_compiled(compiled, model, st: dict, T: dict, geo: StepGeometry, kind: str, sizes: tuple) -> tuple[dict, dict]:
    """compile=True: one vanilla / threshold step of `kind` on bucket `sizes` through CompiledRounds.run (one graph
    per (StepGeometry, kind, sizes); buckets reported as (kind, *sizes))."""
    from lopa_fast.decode.compiled import unique_code

    def make():
        def one_step(st: dict, T: dict) -> tuple[dict, dict]:
            return step(model, st, T, geo, kind, sizes)

        return unique_code(one_step, f"{kind}_{'x'.join(map(str, sizes))}")

    label = _label(kind, sizes)
    return compiled.run(("steps", geo, kind, sizes), (kind, *sizes), label, make, model, st, T, geo)
