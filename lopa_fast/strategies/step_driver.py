"""What the vanilla and threshold drivers share: one request whose steps are ONE step function of
lopa_fast.strategies.steps' state, driven by the one loop (lopa_fast.decode.batch; the protocol:
lopa_fast.decode.driver).

`StepDriver` holds the canvas and step state (`steps.init`), the request's compiled steps (compile=True), the
eager step in stages around the scheduler's shared forward (`prepare` / `forward_args` / `finish`), the compiled
step as a batch step (`batch_step` / `take`), the step's one host read (its head), the numerics guard's refusal,
the trace's accepted tokens, the progress hook and stop check, and the result. A strategy's driver adds its step
plan: `name`, `parts` (its step module's `parts(geo, kind, sizes, s=None, head=None)`), `next_bucket` and `_plan` (its
bucket -> (kind, sizes, w)).
"""
from __future__ import annotations

import torch

from lopa_fast.strategies import steps
from lopa_fast.decode.compiled import compiled_for
from lopa_fast.decode.shapes import pow2_bucket
from lopa_fast.keyed import request_noise
from lopa_fast.output import Clock, GenerateOutput, finalize_stats
from lopa_fast.output.progress import after_step


class StepDriver:
    """One vanilla / threshold request (module docstring). model: DecoderLM; prompt: LongTensor [P] on model.device;
    cfg: a bound config of the strategy; cache: None (its own) or a batch's pool slot views [layers, L or 1, Hkv, D]
    (the prefix cache of a threshold request with a cache; one unused row otherwise); ts: Dream vanilla's timesteps
    [steps + 1] float32 on the prompt's device; counters: the strategy's own stats counters (zero at the start)."""

    name = ""  # the strategy (its errors name it)
    mode = "full"  # the forward's attention: full over the prompt and the whole region
    parts = None  # the strategy's step split around its forward (a staticmethod of the subclass)

    def __init__(self, model, prompt: torch.Tensor, cfg, cache=None, ts=None, counters: tuple = ()):
        self.model, self.cfg = model, cfg
        self.dev = prompt.device
        self.P, G = prompt.numel(), cfg.max_new_tokens
        self.L = self.P + G
        self.mask_id = cfg.mask_token_id
        self.geo = steps.geometry(model, cfg, self.L)
        self.attn_backend = self.geo.attn_backend
        x = torch.cat([prompt, prompt.new_full((G,), self.mask_id)])
        seed = request_noise(cfg, self.dev).seed
        self.st, self.T = steps.init(model, x, self.P, self.geo, seed, ts, steps.step_knobs(cfg), cache)
        self.stats = {"forwards": 0, "model_calls": 0, **dict.fromkeys(counters, 0), "host_reads": 0}
        self.trace = [] if cfg.return_trace else None
        self.stopped = False
        # the last head's guard row, block full, first mask and masks left (`read_head`)
        self._b, self.full, self.fm, self.n_mask = -1, False, self.P, G
        self.compiled, self.cview = compiled_for(model, cfg, self.dev)  # compile=True: every step, solo or batched

    @property
    def x(self) -> torch.Tensor:
        """The canvas [L] (prompt + generation): the step state's."""
        return self.st["x"]

    def size(self, n: int) -> int:
        """A step's row / window count: exact eagerly, a power-of-two bucket when compiled."""
        return n if self.compiled is None else pow2_bucket(n)

    def use_cache(self, cache_k, cache_v) -> None:
        """The request's cache rows: a batch's pool slot views (re-pointed when the pool grows)."""
        self.st["ck"], self.st["cv"] = cache_k, cache_v

    def _planned(self, *bucket) -> tuple[str, tuple, dict]:
        """The subclass's `_plan(*bucket)` -> the step's (kind, sizes, w; w["lo"]: the first row's position, the
        guard's), kept for the step's after_round (and, with a trace, the canvas before the step)."""
        kind, sizes, self._w = self._plan(*bucket)
        self._before = self.x.clone() if self.trace is not None else None
        return kind, sizes, self._w

    # ---- the state machine (lopa_fast.decode.driver) ----------------------------------------------------------
    def begin(self, on_round=None) -> None:
        self.on_round = on_round
        self.clock = Clock(self.dev).__enter__()

    def prepare(self, *bucket) -> dict:
        """The step's forward inputs (`part`: a `forward_requests` part) and what its `finish` needs."""
        kind, sizes, w = self._planned(*bucket)
        pre, post = self.parts(self.geo, kind, sizes, s=w.get("s"), head=self._head())
        part, ctx = pre(self.st, self.T)
        return dict(w, part=part, ctx=ctx, post=post)

    def forward_args(self, w: dict) -> dict:
        """This request's part of `model.forward_requests` (the arguments of its solo forward)."""
        return w["part"]

    def finish(self, w: dict, logits: torch.Tensor, k_win=None, v_win=None) -> None:
        """The step after its forward (raw logits [R, V]; window K/V [layers, 1, n, Hkv, D] or None)."""
        self.st, self._info = w["post"](self.st, self.T, w["ctx"], logits, k_win, v_win)

    def batch_step(self, *bucket):
        """compile=True: the step as a compiled batch's BatchStep (lopa_fast.decode.compiled_batch), else None."""
        if self.compiled is None:
            return None
        kind, sizes, _ = self._planned(*bucket)
        return steps.batch_step(self.compiled, self.cview, self.model, self.st, self.T, self.geo, kind, sizes,
                                self.parts, head=self._head())

    def _head(self):
        """The LM-head weight [V, H] the fused head reads (geo.fused_head), else None."""
        return self.model.head_weight() if self.geo.fused_head else None

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result (its state, {"logits"}); `read_head` and `after_round` finish it."""
        self.st, self._info = st, info

    def read_head(self) -> None:
        """The step's one host read (its head): the guard, block full, the first mask, the masks left."""
        self.stats["host_reads"] += 1
        self._b, full, self.fm, self.n_mask = self.st["head"].tolist()
        self.full = bool(full)

    def after_round(self, **trace_facts) -> None:
        """The counters, the guard's refusal, the trace entry (with the subclass's `trace_facts`), the hook and the
        stop check of the step just run."""
        stats = self.stats
        stats["forwards"] += 1
        stats["model_calls"] += 1
        if self._b >= 0:
            steps.refuse(steps.row_logits(self._info, self._b), self._w["lo"] + self._b, stats["forwards"], self.name,
                         self.cfg.temperature)
        if self.trace is not None:
            x, P = self.x, self.P
            pos = ((self._before == self.mask_id) & (x != self.mask_id)).nonzero(as_tuple=True)[0]
            self.trace.append({"round": stats["forwards"], "accepted": [[int(q) - P, int(x[q])] for q in pos],
                               **trace_facts})
        self.stopped = after_step(self.x[self.P :], self.cfg, stats, self.on_round)

    def result(self, **counters) -> GenerateOutput:
        """Stop the clock; the tokens, the counters (the subclass's, read from the state) and stats, the trace."""
        self.clock.__exit__(None, None, None)
        stats = self.stats
        stats.update(counters)
        if self.compiled is not None:
            stats.update(self.compiled.stats(self.cview))
        stats["host_reads_per_step"] = stats["host_reads"] / max(1, stats["forwards"])
        ids = self.x[self.P :].tolist()
        finalize_stats(stats, ids, self.cfg.eos_token_id, self.mask_id, self.clock.seconds, steps_plus_one=False)
        return GenerateOutput(ids, stats, self.trace)
