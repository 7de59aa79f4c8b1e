"""The fast threshold decoder (Fast-dLLM v1 / dParallel): the step on the device, one host read per step.

Semantics are exactly `lopa_fast.strategies.threshold.reference`'s (its docstring; docs/semantics.md sections
4.2-4.4 and 5): token- and forward-exact at T = 0 and, with the keyed sampler, at T > 0. The step is
lopa_fast.strategies.threshold.step (the commit rule as tensor ops on the device, the LM head only on the
candidates' rows; dual steps through `model.forward_dual`, writing the block's K/V in place); this module is its
block machine (refresh, cache and full steps per block; `count_noop_forward`'s extra forward) on
lopa_fast.strategies.step_driver's `StepDriver`.
"""
from __future__ import annotations

import torch

from lopa_fast.strategies import steps
from lopa_fast.strategies.step_driver import StepDriver
from lopa_fast.output import round_cap_hit
from lopa_fast.strategies.threshold import step as threshold_step


class ThresholdDriver(StepDriver):
    """One threshold request (lopa_fast.strategies.step_driver.StepDriver) stepped by the one loop. A step's "bucket"
    is its kind (full | refresh | refresh_first | prefix | dual: lopa_fast.strategies.steps); the block machine picks
    the next one from the last step's head (block full, first mask). In a batch, every step but "dual" is a window
    over a cached prefix (the model's `forward_requests`); a "dual" step writes its window's K/V into the cache in
    place before attending to the whole cache, so its forward is `steps.DualForward` (`model.forward_dual`, the
    same in-place forward as solo, for every dual request of the round at once: `forwards`).

    model: DecoderLM; prompt: LongTensor [P] on model.device; cfg: a bound threshold GenerateConfig; cache: a batch's
    pool slot views [num_layers, L or 1, Hkv, D] (the prefix cache lives there)."""

    name = "threshold"
    parts = staticmethod(threshold_step.parts)

    def __init__(self, model, prompt: torch.Tensor, cfg, cache=None):
        super().__init__(model, prompt, cfg, cache, counters=("refresh_forwards",))
        self.B = cfg.block_length
        self.n_blocks = cfg.max_new_tokens // self.B
        self.refresh_kind = "refresh_first" if model.config.refresh_commits_first else "refresh"
        # the block machine: block index, phase (start | full | refresh | cache); the last head's (full, fm)
        self.blk, self.phase = 0, "start"

    def _budget(self) -> bool:
        if self.stats["forwards"] >= self.cfg.max_rounds:
            round_cap_hit(self.cfg, self.stats, "threshold")
            return False
        return True

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

    def _plan(self, kind: str) -> tuple[str, tuple, dict]:
        """The step's sizes (exact eagerly, buckets when compiled) and its plan: the window start s (a host int, the
        eager step's), the first row's position lo (the guard's) and the trace's window start. Forward inputs:
        tokens [1, n] at `start` over `prefix_len` cached rows, the raw rows [R] that get the LM head."""
        s, e = self.block()
        L, fm = self.L, self.fm
        sizes = {"full": (self.size(max(e - fm, 1)),), "refresh": (self.size(max(e - fm, 1)),), "refresh_first": (1,),
                 "prefix": (self.size(L - s),), "dual": ()}[kind]
        lo, wstart = {"full": (fm, -self.P), "refresh": (fm, -self.P), "refresh_first": (s, 0)}.get(
            kind, (s, s - self.P))
        return kind, sizes, dict(kind=kind, s=s, lo=lo, wstart=wstart)

    def forwards(self, w: dict):
        """The step's forward when it is not the model's `forward_requests` (lopa_fast.decode.batch): a "dual" step's
        in-place forward (`steps.DualForward`); None otherwise."""
        return ((steps.DualForward(self.model), self.mode, self.attn_backend),) if w["kind"] == "dual" else None

    def after_round(self) -> None:
        self.stats["refresh_forwards"] += int(self._w["kind"].startswith("refresh"))
        super().after_round(window_start=self._w["wstart"])

    def result(self):
        return super().result(multi_token_steps=int(self.st["multi"]), noop_forwards=int(self.st["noop"]))
