"""The fast threshold decoder (Fast-dLLM v1 / dParallel): the step on the device, one host read per step.

Semantics are exactly `lopa_fast.reference.threshold` (docs/semantics.md sections 4.2-4.4 and 5; token- and
forward-exact at T = 0 and, with the keyed sampler, at T > 0): blocks of `block_length` left to right, per
step the masked positions of the block (cache=None: every mask before the block end) are candidates and one
rule commits (rank 1 always): `threshold` (conf >= tau), `factor` (the first rank k with c(k) < 1 - f/(k+1),
upstream's edge cases), `entropy_threshold` (H <= h). Caches: None, "prefix" (refresh forward at each block
start, then the block and every later position over the cached prefix), "dual" (refresh caches every
position; later steps forward only the block, overwriting its K/V in place). Dream refresh steps commit the
block's first token unconditionally; `count_noop_forward` keeps the old loop's extra forward.

What changes is how: the commit rule is tensor ops on the device (`select`), the candidates never leave it,
the LM head runs only on the rows a step reads (the candidates' rows, `steps.raw_rows`), the forwards are
the fused static-cache ones of `steps.StepForward`, and the step's one host read is the head
(first non-finite row, first mask, block full). compile=True runs each step as one compiled / captured
callable instead (lopa_fast.decode.static_steps, through CompiledRounds.steps_step), with the same one host read.
"""
from __future__ import annotations

import torch

from lopa_fast.progress import after_step
from lopa_fast.decode import static_steps, steps
from lopa_fast.decode.steps import threshold_select as select  # noqa: F401  (the step's rule, shared)
from lopa_fast.decode.shapes import pow2_bucket as bucket
from lopa_fast.keyed import TOKEN, request_noise
from lopa_fast.output import Clock, GenerateOutput, finalize_stats, round_cap_hit
from lopa_fast.sampling import threshold_stats


class ThresholdDriver:
    """One threshold request as the batch scheduler's state machine (lopa_fast.decode.batch: begin / next_bucket /
    prepare / forward_args / finish / read_head / after_round / result); `run()` drives it alone (eager through the
    same stages, or compile=True through CompiledRounds). A step's "bucket" is its kind (full | refresh |
    refresh_first | prefix | dual: lopa_fast.decode.static_steps); the block machine picks the next one from the
    last step's head (block full, first mask). In a batch, every step but "dual" is a window over a cached prefix
    (the model's `forward_requests`); a "dual" step writes its window's K/V into the cache in place before attending
    to the whole cache, so its forward is `steps.DualForward` (the same in-place forward as solo, for every dual
    request of the round at once: `forwards`).

    model: DecoderLM; prompt: LongTensor [P] on model.device; cfg: a bound threshold GenerateConfig; cache: a batch's
    pool slot views [num_layers, L or 1, Hkv, D] (the prefix cache lives there)."""

    mode = "full"  # the forward's attention

    def __init__(self, model, prompt: torch.Tensor, cfg, cache=None):
        self.model, self.cfg = model, cfg
        self.P, G, self.B = prompt.numel(), cfg.max_new_tokens, cfg.block_length
        self.n_blocks = G // self.B
        self.mask_id = cfg.mask_token_id
        self.dev = dev = prompt.device
        self.noise = request_noise(cfg, dev)
        self.x = torch.cat([prompt, prompt.new_full((G,), self.mask_id)])
        self.L = self.x.numel()
        self.fw = steps.StepForward(model, self.L, cache=cfg.cache is not None)
        if cache is not None:
            self.use_cache(*cache)
        self.attn_backend = self.fw.backend
        self.stats_in_float64 = model.config.stats_in_float64
        self.refresh_kind = "refresh_first" if model.config.refresh_commits_first else "refresh"
        self.shift = bool(model.logits_shift)
        self.suppress = self.mask_id if cfg.suppress_mask_token else None
        self.stats = {"forwards": 0, "model_calls": 0, "refresh_forwards": 0, "host_reads": 0}
        zero = torch.zeros((), dtype=torch.long, device=dev)
        self.counters = {"multi_token_steps": zero.clone(), "noop_forwards": zero.clone()}
        self.trace = [] if cfg.return_trace else None
        self.stopped = False
        # the block machine: block index, phase (start | full | refresh | cache), the last head's (full, fm)
        self.blk, self.phase, self.full, self.fm = 0, "start", False, self.P
        # compile=True: every step through CompiledRounds (lopa_fast.decode.static_steps), alone or in a batch (then
        # its prefix cache is the pool slot's)
        self.compiled = self.cview = None
        from lopa_fast.decode.compiled import CompiledRounds, compile_wanted

        if compile_wanted(cfg, dev):
            self.compiled = CompiledRounds.for_model(model, cfg)
            self.cview = self.compiled.view()
            self.geo = static_steps.geometry(model, cfg, self.L)
            self.cst, self.T = static_steps.init(model, self.x, self.P, self.geo, self.noise.seed,
                                                 knobs=static_steps.step_knobs(cfg), cache=cache)

    def use_cache(self, cache_k, cache_v) -> None:
        """The request's prefix cache: a batch's pool slot views (re-pointed when the pool grows)."""
        self.fw.cache_k, self.fw.cache_v = cache_k, cache_v
        if getattr(self, "cst", None) is not None:  # (called from __init__ before the compiled state exists)
            self.cst["ck"], self.cst["cv"] = cache_k, cache_v

    def _budget(self) -> bool:
        if self.stats["forwards"] >= self.cfg.max_rounds:
            round_cap_hit(self.cfg, self.stats, "threshold")
            return False
        return True

    def _count(self, refresh: bool) -> None:
        self.stats["forwards"] += 1
        self.stats["model_calls"] += 1
        self.stats["refresh_forwards"] += int(refresh)

    # ---- the state machine ------------------------------------------------------------------------------
    def begin(self, on_round=None) -> None:
        self.on_round = on_round
        self.clock = Clock(self.dev).__enter__()

    def next_bucket(self):
        """The coming step's (kind,), or None when the request has finished (every block full, a stop, the round cap).
        Fast-dLLM's loop: cache None, "full" steps until the block is full; with a cache, a refresh step (LLaDA:
        every mask before the block end; Dream: the block's first token), then cache steps until the block is full
        (count_noop_forward: one more after a refresh that filled it)."""
        cfg = self.cfg
        while not self.stopped and self.blk < self.n_blocks:
            if self.phase == "start":
                s, e = self.block()
                if self.compiled is not None:  # in place (the CUDA workspace): a kernel launch each, no host read
                    self.cst["s"].fill_(s)
                    self.cst["e"].fill_(e)
                if cfg.cache is None:
                    self.phase = "full"
                else:
                    if not self._budget():
                        return None
                    self.phase = "refresh"
                    return (self.refresh_kind,)
            if self.phase == "full":
                if self.full:
                    self._next_block()
                    continue
                return ("full",) if self._budget() else None
            done = self.full and not (self.phase == "refresh" and cfg.count_noop_forward)
            if done:
                self._next_block()
                continue
            self.phase = "cache"
            return (cfg.cache,) if self._budget() else None
        return None

    def _next_block(self) -> None:
        self.blk, self.phase, self.full = self.blk + 1, "start", False

    def block(self) -> tuple[int, int]:
        return self.P + self.blk * self.B, self.P + (self.blk + 1) * self.B

    def prepare(self, kind: str) -> dict:
        """The step's forward inputs: tokens [1, n] at `start` over `prefix_len` cached rows, the raw rows [R] that
        get the LM head, and the positions [lo, hi) they predict (plus the trace's window start)."""
        x, P, L, fm = self.x, self.P, self.L, self.fm
        s, e = self.block()
        lo, hi, wstart = {"full": (fm, e, -P), "refresh": (fm, e, -P), "refresh_first": (s, s + 1, 0)}.get(
            kind, (s, e, s - P))  # fmt: skip
        start = s if kind in ("prefix", "dual") else 0
        tokens = x[s:] if kind == "prefix" else x[s:e] if kind == "dual" else x
        rows = steps.raw_rows(lo, hi, start, self.shift, self.dev)
        return dict(kind=kind, s=s, e=e, lo=lo, hi=hi, wstart=wstart, start=start, tokens=tokens[None], rows=rows)

    def forwards(self, w: dict):
        """The step's forward when it is not the model's `forward_requests` (lopa_fast.decode.batch): a "dual" step's
        in-place forward (`steps.DualForward`); None otherwise."""
        return ((steps.DualForward(self.model), self.mode, self.attn_backend),) if w["kind"] == "dual" else None

    def forward_args(self, w: dict) -> dict:
        """This request's part of `model.forward_requests` (full / refresh: cache-free; prefix: over the cache;
        dual: a part of `steps.dual_forwards`, over the whole cache with the window written in place)."""
        n = w["tokens"].shape[1]
        return dict(tokens=w["tokens"], start=w["start"], cache_k=self.fw.cache_k, cache_v=self.fw.cache_v,
                    prefix_len=self.L if w["kind"] == "dual" else w["start"],
                    win_lens=torch.full((1,), n, dtype=torch.long, device=self.dev), bids=None,
                    rows=w["rows"])  # fmt: skip

    def _forward(self, w: dict) -> torch.Tensor:
        """The solo forward of a step (StepForward: the same numerics as the shared forward's part)."""
        kind, x, s, rows = w["kind"], self.x, w["s"], w["rows"]
        if kind == "full":
            return self.fw.full(w["tokens"], rows)
        if kind in ("refresh", "refresh_first"):
            return self.fw.refresh(x, rows, self._keep())
        return self.fw.prefix(x[s:], s, rows) if kind == "prefix" else self.fw.dual(x[s : w["e"]], s, rows)

    def _keep(self) -> int:
        """A refresh's cached rows: the prefix before the block ("prefix") or every position ("dual")."""
        return self.block()[0] if self.cfg.cache == "prefix" else self.L

    def finish(self, w: dict, logits: torch.Tensor, k_win=None, v_win=None) -> None:
        """The step after its forward (aligned logits [hi - lo, V]; the window's K/V [layers, 1, n, Hkv, D] when it
        ran in a shared forward, whose refresh K/V become the cache here): statistics, the rule, the commit."""
        cfg, x, mask_id = self.cfg, self.x, self.mask_id
        kind, lo, hi = w["kind"], w["lo"], w["hi"]
        self._count(refresh=kind.startswith("refresh"))
        if k_win is not None and kind.startswith("refresh"):  # what StepForward.refresh writes
            keep = self._keep()
            self.fw.cache_k[:, :keep] = k_win[:, 0, :keep]
            self.fw.cache_v[:, :keep] = v_win[:, 0, :keep]
        only_first = kind == "refresh_first"
        cand = x[lo:hi] == mask_id
        read = torch.ones_like(cand) if only_first else cand
        self._bad = steps.first_bad_row(logits, read, cfg.temperature)
        self._logits, self._w = logits, w
        keys = self.noise.keys(TOKEN, self.stats["forwards"], 0, lo + torch.arange(logits.shape[0], device=self.dev)) \
            if cfg.temperature > 0 else None
        x0, conf, ent = threshold_stats(logits, stats_in_float64=self.stats_in_float64, temperature=cfg.temperature,
                                        top_p=cfg.top_p, top_k=cfg.top_k, suppress_token=self.suppress, keys=keys)  # fmt: skip
        if only_first:  # Dream refresh: the block's first token, unconditionally (Fast-dLLM's Dream loop)
            sel = torch.ones_like(cand)
        else:
            sel = select(conf, ent, cand, cfg)
            nsel = sel.sum()
            self.counters["multi_token_steps"] += nsel >= 2
            self.counters["noop_forwards"] += nsel == 0
        self._before = x.clone() if self.trace is not None else None
        x[lo:hi] = torch.where(sel, x0, x[lo:hi])

    def read_head(self) -> None:
        """The step's one host read: the guard, block full, the first mask."""
        if self.compiled is not None:  # the compiled step's head
            self.stats["host_reads"] += 1
            self._b, full, self.fm, _ = self.cst["head"].tolist()  # the step's one device-to-host read
            self.full = bool(full)
            self.x.copy_(self.cst["x"])  # the host's canvas (hook, trace, result): a device copy, no read
            self._logits = self._info["logits"]
            return
        s, e = self._w["s"], self._w["e"]
        self.stats["host_reads"] += 1
        b, full, self.fm = steps.read_head(self._bad, ~(self.x[s:e] == self.mask_id).any(),
                                           steps.first_mask(self.x, self.mask_id))  # fmt: skip
        self.full, self._b = bool(full), b

    def after_round(self) -> None:
        """The numerics error, the trace entry, the hook and the stop check of the step just run."""
        self._after(self._b, self._logits, self._w["lo"], self._before, self._w["wstart"])

    def _after(self, b: int, logits: torch.Tensor, lo: int, before, wstart: int) -> None:
        if b >= 0:
            steps.refuse(logits[b], lo + b, self.stats["forwards"], "threshold", self.cfg.temperature)
        if self.trace is not None:
            x, P = self.x, self.P
            pos = ((before == self.mask_id) & (x != self.mask_id)).nonzero(as_tuple=True)[0]
            self.trace.append({"round": self.stats["forwards"], "accepted": [[int(q) - P, int(x[q])] for q in pos],
                               "window_start": wstart})  # fmt: skip
        self.stopped = after_step(self.x[self.P :], self.cfg, self.stats, self.on_round)

    def _compiled_plan(self, kind: str) -> tuple[dict, tuple]:
        """compile=True: the step's plan (prepare's) and bucket sizes; counts the forward, keeps the trace's canvas."""
        w = self.prepare(kind)
        s, e, fm, L = w["s"], w["e"], self.fm, self.L
        self._count(refresh=kind.startswith("refresh"))
        sizes = {"full": (bucket(max(e - fm, 1)),), "refresh": (bucket(max(e - fm, 1)),), "refresh_first": (1,),
                 "prefix": (bucket(L - s),), "dual": ()}[kind]  # fmt: skip
        self._w, self._before = w, (self.x.clone() if self.trace is not None else None)
        return w, sizes

    def compiled_step(self, kind: str) -> None:
        """compile=True: the step as one compiled / captured callable, then the one host read and the rest."""
        _, sizes = self._compiled_plan(kind)
        self.cst, self._info = static_steps.run_compiled(self.compiled, self.model, self.cst, self.T, self.geo, kind,
                                                         sizes)  # fmt: skip
        self.read_head()
        self.after_round()

    def batch_step(self, kind: str):
        """compile=True in a batch: the step as a compiled batch's BatchStep (lopa_fast.decode.compiled_batch)."""
        if self.compiled is None:
            return None
        _, sizes = self._compiled_plan(kind)
        return static_steps.batch_step(self.compiled, self.cview, self.model, self.cst, self.T, self.geo, kind, sizes)

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result (its state, {"logits"}); `read_head` and `after_round` finish it."""
        self.cst, self._info = st, info

    def run(self, on_round=None) -> GenerateOutput:
        """Decode the request alone: every step through the stages above (or compiled), then the result."""
        self.begin(on_round)
        while (b := self.next_bucket()) is not None:
            kind = b[0]
            if self.compiled is not None:
                self.compiled_step(kind)
                continue
            w = self.prepare(kind)
            self.finish(w, self._forward(w))
            self.read_head()
            self.after_round()
        return self.result()

    def result(self) -> GenerateOutput:
        """Stop the clock; the tokens, the counters and stats, the trace."""
        self.clock.__exit__(None, None, None)
        stats, counters = self.stats, self.counters
        ids = self.x[self.P :].tolist()
        if self.compiled is not None:
            counters = {"multi_token_steps": self.cst["multi"], "noop_forwards": self.cst["noop"]}
            stats.update(self.compiled.stats(self.cview))
        stats.update({k: int(v) for k, v in counters.items()})
        stats["host_reads_per_step"] = stats["host_reads"] / max(1, stats["forwards"])
        finalize_stats(stats, ids, self.cfg.eos_token_id, self.mask_id, self.clock.seconds, steps_plus_one=False)
        return GenerateOutput(ids, stats, self.trace)


def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """Threshold decoding on the fast backend. prompt: LongTensor [P] on model.device; cfg: bound
    GenerateConfig (covered: lopa_fast.strategies.fast_not_covered); on_round: the progress hook."""
    return ThresholdDriver(model, prompt, cfg).run(on_round)
