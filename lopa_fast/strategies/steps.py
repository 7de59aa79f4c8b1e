"""The shared machinery of the fast vanilla and threshold steps: their state, their forwards, the numerics guard
and the one host read per step, and how a step runs (eager, compiled / captured, in a compiled batch).

How a step runs (the step kinds and their sizes, eager vs compiled shapes, padding, the head): docs/internals.md.

State (`init`, per request; the CUDA workspace of CompiledRounds per StepGeometry):
  x [L] long; fwd (forwards so far: the keyed sampler's step), i (Dream's step index), fm, s, e 0-d long;
  transferred, multi, noop 0-d long counters; head [4] long; ck, cv [layers, L or 1, Hkv, D] the cache.
Tables T: P (prompt length), seed (the keyed sampler's, as int64 bits), ts (Dream's timesteps, float32), and the
float knobs (`step_knobs`: temperature, top_p, threshold, factor, entropy_threshold, cfg_scale, alg_temp) as 0-d
float64 runtime inputs: a step's graph serves every value; only whether a knob is on is in the StepGeometry.
The host writes s and e in place (`fill_`) at each block start: a kernel launch, not a host read.
Row helpers map aligned positions to raw rows: with Dream's shift (upstream's `cat(l[:1], l[:-1])` over a
window), aligned row i is raw row i - 1, except the window's first row, which keeps its own (`rows`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lopa_fast import keyed, ops
from lopa_fast.decode.compiled_batch import BatchStep
from lopa_fast.decode.fused_head import fused_head_wanted
from lopa_fast.decode.kv_pool import request_cache
from lopa_fast.decode.shapes import knob
from lopa_fast.errors import NonFiniteLogitsError
from lopa_fast.sampling import NEG_ENTROPY_EPS, finite_rows, is_on

HEAD = ("bad", "full", "first_mask", "masks_left")
# the threshold strategy's rules (GenerateConfig's names), in `reference.ops.select_by_rule`'s order of precedence
RULES = ("factor", "entropy_threshold", "threshold")
KNOBS = ("temperature", "top_p", *RULES, "cfg_scale", "alg_temp")  # float knobs: runtime inputs (tables)


@dataclass(frozen=True)
class StepGeometry:
    """Every Python constant a step of one request reads (it keys the compiled callables and the CUDA
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
    fused_head: bool = False  # the step's LM head and statistics as ONE `ops.head_confidence` (`step_fused_head`)


def geometry(model, cfg, L: int) -> StepGeometry:
    """The StepGeometry of a bound, covered vanilla / threshold config on `model` for L positions."""
    from lopa_fast.ops import _backend

    # the knobs tell the step apart (each is one strategy's own, validated so): a resolved Dream vanilla config has
    # `alg`, LLaDA vanilla has `remasking`, threshold has `cache` / one of its three rules
    dream_vanilla = cfg.alg is not None
    blocked = []
    if cfg.confidence_eos_eot_inf:  # LLaDA vanilla's knob
        blocked = [cfg.eos_token_id] if cfg.eos_token_id is not None else []
        eot = model.config.eot_token_id  # the family's (LLaDA's <|eot_id|>)
        if eot is not None and model.config.vocab_size > eot:
            blocked.append(eot)
    rule = next((r for r in RULES if getattr(cfg, r, None) is not None), None)
    return StepGeometry(
        strategy=cfg.strategy, stats_in_float64=model.config.stats_in_float64, shift=bool(model.logits_shift), L=L,
        B=0 if dream_vanilla else int(cfg.block_length), mask_id=cfg.mask_token_id,
        sampling=cfg.temperature > 0, nucleus=cfg.top_p is not None and cfg.top_p < 1, top_k=cfg.top_k,
        suppress_mask=bool(cfg.suppress_mask_token),
        attn_backend=_backend.resolve("branch_attention", None, model.device),
        cache=cfg.cache, rule=rule,
        guidance=(cfg.cfg_scale or 0.0) > 0, remasking=cfg.remasking,
        eos_inf=cfg.eos_token_id if cfg.logits_eos_inf else None,
        blocked=tuple(blocked), alg=cfg.alg if dream_vanilla else None,
        race=dream_vanilla and bool(cfg.alg_temp), n_steps=int(cfg.steps) if dream_vanilla else 0,
        fused_head=step_fused_head(model, cfg, dream_vanilla, rule),
    )


def step_fused_head(model, cfg, dream_vanilla: bool, rule: str | None) -> bool:
    """Whether a step's forward ends in the fused LM head (lopa_fast.decode.fused_head: $LOPA_FAST_FUSED_HEAD, T = 0,
    no top-p / top-k) where its statistics are what `ops.head_confidence` gives: the Dream family's float32 ones
    (not LLaDA's float64 statistics), Dream vanilla without alg_temp's race (p_max, margin or neg-entropy of each
    row; `origin`: the arg-max), threshold with the threshold or factor rule (p(x0) = p_max; the entropy rule reads
    the float64 entropy), every cache mode (`model.forward_dual` returns the hidden rows too)."""
    if model.config.stats_in_float64 or not fused_head_wanted(cfg, model.device):
        return False
    if dream_vanilla:
        return not cfg.alg_temp
    return rule in ("threshold", "factor")  # a threshold step (vanilla has no rule)


def step_knobs(cfg) -> dict[str, float | None]:
    """A request's float knobs, the tables' runtime inputs of its steps (None: off; `init` stores 0.0)."""
    return {name: getattr(cfg, name, None) for name in KNOBS}


def init(model, x: torch.Tensor, P: int, geo: StepGeometry, seed: int, ts: torch.Tensor | None = None,
         knobs: dict | None = None, cache=None):
    """(state, tables) of a request whose canvas is x [L] (prompt + masks); seed: the keyed sampler's (resolved);
    ts: Dream's timesteps [steps + 1] float32 on x's device (None elsewhere); knobs: `step_knobs(cfg)` (None: all
    off); cache: None (its own zero cache) or (k, v) views [layers, L or 1, Hkv, D] it uses in its place (a batch's
    KV pool slot). Builds (or checks) the model's merged-weight view once, outside any graph."""
    dev = x.device
    z = lambda v=0: torch.full((), v, dtype=torch.long, device=dev)  # noqa: E731
    # no cache: one unused row (a batch's pool slot keeps its shape)
    cache = request_cache(model, geo.L if geo.cache is not None else 1, cache)
    model.fused_layers()
    st = {"x": x.clone(), "fwd": z(), "i": z(), "fm": z(P), "s": z(P), "e": z(P + geo.B),
          "transferred": z(), "multi": z(), "noop": z(), "head": torch.zeros(len(HEAD), dtype=torch.long, device=dev),
          "ck": cache[0], "cv": cache[1]}
    T = {"P": z(P), "seed": z(keyed._s64(int(seed) % (1 << 64))),
         "ts": ts if ts is not None else torch.zeros(1, dtype=torch.float32, device=dev)}
    T.update({name: knob((knobs or {}).get(name), dev) for name in KNOBS})
    return st, T


# ---- the forwards (static shapes; positions, and in a compiled step prefix lengths, are device tensors) ---------
# A step's forward is described by its arguments (a `model.forward_requests` part: tokens, start, cache_k, cache_v,
# prefix_len, win_lens, bids, rows; a dual step's: a `model.forward_dual` part): one request's part of the shared
# forward (lopa_fast.decode.batch, lopa_fast.decode.compiled_batch; a solo request is a batch of one).
def args(st: dict, tokens: torch.Tensor, start, prefix_len, win_lens, rows, geo: StepGeometry) -> dict:
    """A `forward_requests` part over the request's cache: tokens [Bt, n] at start.., prefix_len cached rows; with
    geo.fused_head its rows come back final-normed ([R, H]: `head_stats` applies the head)."""
    return dict(tokens=tokens, start=start, cache_k=st["ck"], cache_v=st["cv"], prefix_len=prefix_len,
                win_lens=win_lens, bids=None, rows=rows, output="hidden" if geo.fused_head else "logits")


def full_args(st: dict, tokens: torch.Tensor, rows: torch.Tensor, geo: StepGeometry) -> dict:
    """The cache-free forward of tokens [Bt, L] (full, refresh, vanilla): its arguments."""
    Bt, n = tokens.shape
    zero = torch.zeros((), dtype=torch.long, device=tokens.device)
    return args(st, tokens, zero, 0, torch.full((Bt,), n, dtype=torch.long, device=tokens.device), rows, geo)


def head_stats(hidden: torch.Tensor, head: torch.Tensor, geo: StepGeometry, entropy: bool = False):
    """The fused head of a step (geo.fused_head): `ops.head_confidence` of the final-normed rows hidden [R, H] and
    the LM-head weight head [V, H] (the mask id suppressed when the step suppresses it; the entropy pass only when
    asked). Returns its HeadConfidence (token, p_max, margin, neg_entropy, lse, finite [R])."""
    suppress = geo.mask_id if geo.suppress_mask else None
    return ops.head_confidence(hidden, head, suppress, NEG_ENTROPY_EPS, entropy, check=False)


def row_logits(info: dict, r: int) -> torch.Tensor:
    """Raw logits row r [V] of a step's forward, for the numerics guard's message: info["logits"], or with the
    fused head the one row info["hidden"][r] @ info["head"].T (computed only when the guard fires)."""
    if "head" in info:
        return F.linear(info["logits"][r : r + 1], info["head"])[0]
    return info["logits"][r]


@dataclass(frozen=True)
class DualForward:
    """`model.forward_dual` as a `forward_requests` for the batch scheduler (lopa_fast.decode.batch groups a round's
    forwards by (this, mask, backend): equal for every request of one model). Returns (logits, None, None) per
    request (or the hidden rows of a part with output="hidden"): the window's K/V are already in each request's
    cache."""

    model: Any

    def forward_requests(self, parts: list[dict], mode: str, attn_backend=None, pool=None) -> list[tuple]:
        return [(logits, None, None) for logits in self.model.forward_dual(parts)]


# ---- helpers -------------------------------------------------------------------------------------------------
def rows(lo: torch.Tensor, hi, n: int, L: int, shift: bool, win_start=0):
    """(positions [n] = lo + arange(n), valid [n] = position < hi, raw rows [n] in range) for 0-d lo: the positions
    [lo, hi) and the raw window rows whose aligned logits predict them (Dream's shift: position q reads raw row
    q - win_start - 1, the window's first row its own)."""
    pos = lo + torch.arange(n, device=lo.device)
    r = pos - win_start
    raw = (r - 1).clamp(min=0) if shift else r
    return pos, pos < hi, raw.clamp(max=L - 1)


def scatter(base: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """base [L] with values [n] written at pos [n] where write [n] (the others go to a trash slot L)."""
    L = base.numel()
    ext = torch.cat([base, base[:1]])
    return ext.index_copy(0, torch.where(write, pos, L), values.to(base.dtype))[:L]


def keys(T: dict, stream: int, fwd: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The keyed sampler's keys [n] of a step's rows at positions pos [n] (fwd: the step's forward count)."""
    return keyed.key(T["seed"], stream, fwd, 0, pos)


def temperature(geo: StepGeometry, T: dict):
    """The temperature a step computes with: the tables' knob when it samples, else 0.0 (greedy: another graph)."""
    return T["temperature"] if geo.sampling else 0.0


def finish(st: dict, x: torch.Tensor, bad: torch.Tensor, geo, logits: torch.Tensor, head=None) -> tuple[dict, dict]:
    """The end of every step: the new canvas, the first mask, the head the host reads once. Returns (st, info):
    info["logits"] the forward's rows (final-normed [R, H] with the fused head, whose weight is then info["head"]:
    `row_logits`)."""
    dev = x.device
    fm = first_mask(x, geo.mask_id)
    full = torch.zeros((), dtype=torch.bool, device=dev)
    if geo.B:
        blk = (st["s"] + torch.arange(geo.B, device=dev)).clamp(max=geo.L - 1)
        full = ~(x.index_select(0, blk) == geo.mask_id).any()
    st.update(x=x, fm=fm)
    st["head"] = torch.stack([bad, full.long(), fm, (x == geo.mask_id).sum()]).long()
    return st, ({"logits": logits} if head is None else {"logits": logits, "head": head})


def rows_finite(logits: torch.Tensor, temperature) -> torch.Tensor:
    """bool [n]: each row of logits [n, V] is finite (and, at T > 0: a float, or a 0-d tensor knob,
    `sampling.is_on`, does not overflow when divided by the temperature): the numerics guard's test."""
    x = logits.float()
    ok = finite_rows(x)
    if is_on(temperature):
        ok = ok & finite_rows(x / temperature)
    return ok


def first_bad_row(logits: torch.Tensor, read: torch.Tensor, temperature) -> torch.Tensor:
    """0-d long: the first row r with read[r] whose logits [n, V] fail `rows_finite`, else -1. No host read."""
    return first_bad(rows_finite(logits, temperature), read)


def first_bad(finite: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """0-d long: the first row r with read[r] and not finite[r] (bool [n] each), else -1. No host read."""
    bad = read & ~finite
    idx = torch.arange(bad.numel(), device=bad.device)
    return torch.where(bad.any(), torch.where(bad, idx, bad.numel()).min(), -1)


def refuse(logits_row: torch.Tensor, position: int, step: int, strategy: str, temperature: float):
    """Raise NonFiniteLogitsError for one raw logits row [V] (the value: the first NaN / inf entry, else the
    largest magnitude that the temperature overflows, as the reference's guard reports it)."""
    row = logits_row.float()
    bad = row[~torch.isfinite(row)]
    value = float(bad[0]) if bad.numel() else f"{float(row.abs().max())} / temperature {temperature}"
    raise NonFiniteLogitsError(strategy=strategy, round=step, position=position, value=value)


def first_mask(x: torch.Tensor, mask_id: int) -> torch.Tensor:
    """0-d long: the first position of x [L] holding the mask id, L when none."""
    m = x == mask_id
    return torch.where(m.any(), m.long().argmax(), x.numel())


# ---- running a step: compiled / captured alone, or in a compiled batch ----------------------------------------
def _label(kind: str, sizes: tuple) -> str:
    return kind + ("_" + "x".join(map(str, sizes)) if sizes else "")


def batch_step(compiled, view, model, st: dict, T: dict, geo: StepGeometry, kind: str, sizes: tuple, parts,
               head=None):
    """The step of `kind` on bucket `sizes` as a compiled batch's BatchStep (one graph per (StepGeometry, kind,
    sizes) and batch size; lopa_fast.decode.compiled_batch). parts: the strategy's `parts(geo, kind, sizes, head=)`
    -> (pre, post); head: the LM-head weight with geo.fused_head. A "dual" step's forward is DualForward (the
    window's K/V written into each request's cache inside the layer loop)."""
    pre, post = parts(geo, kind, sizes, head=head)
    fwds = ((DualForward(model), "full", geo.attn_backend),) if kind == "dual" else None
    return BatchStep(compiled, ("steps", geo, kind, sizes), (kind, *sizes), _label(kind, sizes), ("steps", geo),
                     pre, post, "full", geo.attn_backend, st, T, view, forwards=fwds)
