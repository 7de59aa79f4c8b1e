"""The fast threshold decoder (Fast-dLLM v1 / dParallel): the step on the device, one host read per step.

Semantics are exactly `lopa_fast.strategies.threshold.reference` (docs/semantics.md sections 4.2-4.4 and 5; token- and
forward-exact at T = 0 and, with the keyed sampler, at T > 0): blocks of `block_length` left to right, per
step the masked positions of the block (cache=None: every mask before the block end) are candidates and one
rule commits (rank 1 always): `threshold` (conf >= tau), `factor` (the first rank k with c(k) < 1 - f/(k+1),
upstream's edge cases), `entropy_threshold` (H <= h). Caches: None, "prefix" (refresh forward at each block
start, then the block and every later position over the cached prefix), "dual" (refresh caches every
position; later steps forward only the block, overwriting its K/V in place). Dream refresh steps commit the
block's first token unconditionally; `count_noop_forward` keeps the old loop's extra forward.

What changes is how: the step is ONE function of device tensors (lopa_fast.strategies.threshold.step, on the state
of lopa_fast.decode.steps): the commit rule is tensor ops on the device (`select`), the candidates never leave it,
the LM head runs only on the rows a step reads (the candidates' rows), the forwards are the fused static-cache
ones (`model.forward_static`; dual steps `model.forward_dual`, writing the block's K/V in place), and the step's
one host read is its head (first non-finite row, block full, first mask). This driver runs it eagerly at the
step's exact sizes, or with compile=True as one compiled / captured callable per bucket (through
lopa_fast.decode.compiled_batch: a solo request is batch bucket 1 of the one loop), with the same one host read.
"""
from __future__ import annotations

import torch

from lopa_fast.progress import after_step
from lopa_fast.decode import steps
from lopa_fast.strategies.threshold import step as threshold_step
from lopa_fast.decode.shapes import pow2_bucket as bucket
from lopa_fast.keyed import request_noise
from lopa_fast.output import Clock, GenerateOutput, finalize_stats, round_cap_hit


class ThresholdDriver:
    """One threshold request as the batch scheduler's state machine (lopa_fast.decode.batch: begin / next_bucket /
    prepare / forward_args / finish / read_head / after_round / result); `run()` drives it alone (eager through the
    same stages, or compile=True through CompiledRounds). A step's "bucket" is its kind (full | refresh |
    refresh_first | prefix | dual: lopa_fast.decode.steps); the block machine picks the next one from the
    last step's head (block full, first mask). In a batch, every step but "dual" is a window over a cached prefix
    (the model's `forward_requests`); a "dual" step writes its window's K/V into the cache in place before attending
    to the whole cache, so its forward is `steps.DualForward` (`model.forward_dual`, the same in-place forward as
    solo, for every dual request of the round at once: `forwards`).

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
        self.L = self.P + G
        self.geo = steps.geometry(model, cfg, self.L)
        self.attn_backend = self.geo.attn_backend
        x = torch.cat([prompt, prompt.new_full((G,), self.mask_id)])
        self.st, self.T = steps.init(model, x, self.P, self.geo, self.noise.seed, knobs=steps.step_knobs(cfg),
                                     cache=cache)  # fmt: skip
        self.refresh_kind = "refresh_first" if model.config.refresh_commits_first else "refresh"
        self.stats = {"forwards": 0, "model_calls": 0, "refresh_forwards": 0, "host_reads": 0}
        self.trace = [] if cfg.return_trace else None
        self.stopped = False
        # the block machine: block index, phase (start | full | refresh | cache), the last head's (full, fm)
        self.blk, self.phase, self.full, self.fm = 0, "start", False, self.P
        # compile=True: every step through CompiledRounds, alone or in a batch (then its prefix cache is the pool
        # slot's)
        self.compiled = self.cview = None
        from lopa_fast.decode.compiled import CompiledRounds, compile_wanted

        if compile_wanted(cfg, dev):
            self.compiled = CompiledRounds.for_model(model, cfg)
            self.cview = self.compiled.view()

    @property
    def x(self) -> torch.Tensor:
        """The canvas [L] (prompt + generation): the step state's."""
        return self.st["x"]

    def use_cache(self, cache_k, cache_v) -> None:
        """The request's prefix cache: a batch's pool slot views (re-pointed when the pool grows)."""
        self.st["ck"], self.st["cv"] = cache_k, cache_v

    def _budget(self) -> bool:
        if self.stats["forwards"] >= self.cfg.max_rounds:
            round_cap_hit(self.cfg, self.stats, "threshold")
            return False
        return True

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
                self.st["s"].fill_(s)  # in place (a CUDA workspace): a kernel launch each, no host read
                self.st["e"].fill_(e)
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

    def _plan(self, kind: str) -> tuple[tuple, dict]:
        """The step's sizes (exact eagerly, buckets when compiled) and its plan: the first row's position lo (the
        guard's) and the trace's window start; keeps the trace's canvas."""
        s, e = self.block()
        L, fm = self.L, self.fm
        size = (lambda n: n) if self.compiled is None else bucket
        sizes = {"full": (size(max(e - fm, 1)),), "refresh": (size(max(e - fm, 1)),), "refresh_first": (1,),
                 "prefix": (size(L - s),), "dual": ()}[kind]  # fmt: skip
        lo, wstart = {"full": (fm, -self.P), "refresh": (fm, -self.P), "refresh_first": (s, 0)}.get(
            kind, (s, s - self.P))  # fmt: skip
        self._w = dict(kind=kind, s=s, lo=lo, wstart=wstart)
        self._before = self.x.clone() if self.trace is not None else None
        return sizes, self._w

    def prepare(self, kind: str) -> dict:
        """The step's forward inputs (`part`: tokens [1, n] at `start` over `prefix_len` cached rows, the raw rows
        [R] that get the LM head) and what its `finish` needs."""
        sizes, w = self._plan(kind)
        pre, post = threshold_step.parts(self.geo, kind, sizes, s=w["s"])
        part, ctx = pre(self.st, self.T)
        return dict(w, part=part, ctx=ctx, post=post)

    def forwards(self, w: dict):
        """The step's forward when it is not the model's `forward_requests` (lopa_fast.decode.batch): a "dual" step's
        in-place forward (`steps.DualForward`); None otherwise."""
        return ((steps.DualForward(self.model), self.mode, self.attn_backend),) if w["kind"] == "dual" else None

    def forward_args(self, w: dict) -> dict:
        """This request's part of `model.forward_requests` (full / refresh: cache-free; prefix: over the cache;
        dual: a part of `model.forward_dual`, over the whole cache with the window written in place)."""
        return w["part"]

    def finish(self, w: dict, logits: torch.Tensor, k_win=None, v_win=None) -> None:
        """The step after its forward (raw logits [R, V]; the window's K/V [layers, 1, n, Hkv, D], whose refresh K/V
        become the cache): statistics, the rule, the commit."""
        self.st, self._info = w["post"](self.st, self.T, w["ctx"], logits, k_win, v_win)

    def read_head(self) -> None:
        """The step's one host read (its head): the guard, block full, the first mask."""
        self.stats["host_reads"] += 1
        self._b, full, self.fm, _ = self.st["head"].tolist()
        self.full = bool(full)

    def after_round(self) -> None:
        """The counters, the numerics error, the trace entry, the hook and the stop check of the step just run."""
        kind, b = self._w["kind"], self._b
        self.stats["forwards"] += 1
        self.stats["model_calls"] += 1
        self.stats["refresh_forwards"] += int(kind.startswith("refresh"))
        if b >= 0:
            steps.refuse(self._info["logits"][b], self._w["lo"] + b, self.stats["forwards"], "threshold",
                         self.cfg.temperature)  # fmt: skip
        if self.trace is not None:
            x, P = self.x, self.P
            pos = ((self._before == self.mask_id) & (x != self.mask_id)).nonzero(as_tuple=True)[0]
            self.trace.append({"round": self.stats["forwards"], "accepted": [[int(q) - P, int(x[q])] for q in pos],
                               "window_start": self._w["wstart"]})  # fmt: skip
        self.stopped = after_step(self.x[self.P :], self.cfg, self.stats, self.on_round)

    def batch_step(self, kind: str):
        """compile=True in a batch: the step as a compiled batch's BatchStep (lopa_fast.decode.compiled_batch)."""
        if self.compiled is None:
            return None
        sizes, _ = self._plan(kind)
        return steps.batch_step(self.compiled, self.cview, self.model, self.st, self.T, self.geo, kind, sizes,
                                threshold_step.parts)  # fmt: skip

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result (its state, {"logits"}); `read_head` and `after_round` finish it."""
        self.st, self._info = st, info

    def result(self) -> GenerateOutput:
        """Stop the clock; the tokens, the counters and stats, the trace."""
        self.clock.__exit__(None, None, None)
        stats = self.stats
        ids = self.x[self.P :].tolist()
        if self.compiled is not None:
            stats.update(self.compiled.stats(self.cview))
        stats.update(multi_token_steps=int(self.st["multi"]), noop_forwards=int(self.st["noop"]))
        stats["host_reads_per_step"] = stats["host_reads"] / max(1, stats["forwards"])
        finalize_stats(stats, ids, self.cfg.eos_token_id, self.mask_id, self.clock.seconds, steps_plus_one=False)
        return GenerateOutput(ids, stats, self.trace)
