"""The fast vanilla decoder (LLaDA low-confidence / random remasking, Dream's samplers): the step on the device,
one host read per step.

Semantics are exactly `lopa_fast.strategies.vanilla.reference` (docs/semantics.md section 4.1; token- and forward-exact
at T = 0 and, with the keyed sampler, for every random ordering and T > 0):
- LLaDA: semi-autoregressive blocks, `steps // num_blocks` steps per block with the transfer schedule, per
  step one cache-free forward (cfg_scale > 0: the conditional and the prompt-masked unconditional rows in
  ONE batched forward), commit the top-k candidates by confidence (softmax(logits)[x0] or a keyed uniform).
- Dream: `steps` steps over the whole generation on timesteps linspace(1, eps, steps + 1) (float32):
  `origin` reveals each mask with probability 1 - s/t, the others commit int(n_mask * (1 - s/t)) highest-
  confidence masks (or a keyed draw without replacement from softmax(conf / alg_temp)).

What changes is how: the step is ONE function of device tensors (lopa_fast.strategies.vanilla.step, on the state of
lopa_fast.decode.steps): candidates, statistics, the top-k and the counters stay on the device, the LM head runs
only on the rows from the first mask to the candidates' end, the forward is the fused static one, and the only
host read of a step is its head (the first non-finite row, the first mask, the masks left). This driver runs it
eagerly at the step's exact sizes, or with compile=True as one compiled / captured callable per bucket (through
lopa_fast.decode.compiled_batch: a solo request is batch bucket 1 of the one loop), with the same one host read.
"""
from __future__ import annotations

import warnings

import torch

from lopa_fast.progress import after_step
from lopa_fast.decode import steps
from lopa_fast.strategies.vanilla import step as vanilla_step
from lopa_fast.decode.shapes import pow2_bucket as bucket
from lopa_fast.keyed import request_noise
from lopa_fast.output import Clock, GenerateOutput, finalize_stats


def transfer_schedule(n_masks: int, n_steps: int) -> list[int]:
    """LLaDA `get_num_transfer_tokens` for one block: floor(n/S) per step, +1 for the first n mod S."""
    base, rem = divmod(n_masks, n_steps)
    return [base + (1 if i < rem else 0) for i in range(n_steps)]


def dream_count(n_mask: int, ts: torch.Tensor, i: int, n_steps: int) -> int:
    """Dream's transfer count of step i (a host int: torch.topk's k) from the masks left (the last head) and the
    host timesteps ts [steps + 1]: upstream's int(num_mask * (1 - s / t)) in float32 tensor arithmetic (CPU
    float32 ops are IEEE-rounded like the device's), every mask on the last step."""
    if i == n_steps - 1:
        return n_mask
    return int(torch.tensor(n_mask, dtype=torch.float32) * (1 - ts[i + 1] / ts[i]))


class VanillaDriver:
    """One vanilla request: its step state on the device (lopa_fast.decode.steps: the canvas, the counters, the
    unused cache row), the forwards, the host counters and the trace, as the batch scheduler's state machine
    (lopa_fast.decode.batch: begin / next_bucket / prepare / forward_args / finish / read_head / after_round /
    result; many requests' steps share one `model.forward_requests`); `run()` drives it alone (eager through the
    same stages, or compile=True through CompiledRounds). A step's "bucket" is its plan (lo: the first row's
    position, e: the candidates' end, i: the step within the block / the schedule).

    model: DecoderLM; prompt: LongTensor [P] on model.device; cfg: a bound vanilla GenerateConfig; cache: a batch's
    pool slot views [layers, 1, Hkv, D] (unused: vanilla forwards are cache-free; its one row keeps the pool's
    bookkeeping uniform)."""

    mode = "full"  # the forward's attention: full over prompt + the whole region

    def __init__(self, model, prompt: torch.Tensor, cfg, cache=None):
        self.model, self.cfg = model, cfg
        self.dev = prompt.device
        self.P, G = prompt.numel(), cfg.max_new_tokens
        self.mask_id = cfg.mask_token_id
        self.L = self.P + G
        self.geo = steps.geometry(model, cfg, self.L)
        self.attn_backend = self.geo.attn_backend
        self.noise = request_noise(cfg, self.dev)
        self.stats = {"forwards": 0, "model_calls": 0, "host_reads": 0}
        self.trace = [] if cfg.return_trace else None
        self.fm = self.P  # the first mask position, read with each step's head
        self.n_mask = G  # the number of masks, read with each step's head (Dream's transfer count needs it)
        self.block_topk = model.config.vanilla_commit == "block_topk"  # LLaDA's sampler, else Dream's "timestep"
        self.step_index = 0  # steps run (LLaDA: block * steps_per_block + i)
        self.stopped = False
        ts = None
        if self.block_topk:
            self.nb = (self.L - self.P) // cfg.block_length
            self.spb = cfg.steps // self.nb
            self.schedule = transfer_schedule(cfg.block_length, self.spb)  # every block starts all masks
            self.n_steps = self.nb * self.spb
        else:
            self.n_steps = cfg.steps
            ts = torch.linspace(1, cfg.eps, cfg.steps + 1, device=self.dev)  # float32, as upstream
            self.ts = ts.cpu()  # one read per request: the transfer counts are host ints (topk's k)
        x = torch.cat([prompt, prompt.new_full((G,), self.mask_id)])
        self.st, self.T = steps.init(model, x, self.P, self.geo, self.noise.seed, ts, steps.step_knobs(cfg), cache)
        # compile=True: every step through CompiledRounds, alone or in a batch
        self.compiled = self.cview = None
        from lopa_fast.decode.compiled import CompiledRounds, compile_wanted

        if compile_wanted(cfg, self.dev):
            self.compiled = CompiledRounds.for_model(model, cfg)
            self.cview = self.compiled.view()

    @property
    def x(self) -> torch.Tensor:
        """The canvas [L] (prompt + generation): the step state's."""
        return self.st["x"]

    def use_cache(self, cache_k, cache_v) -> None:
        """The request's (unused) cache rows: a batch's pool slot views (re-pointed when the pool grows)."""
        self.st["ck"], self.st["cv"] = cache_k, cache_v

    # ---- the state machine ------------------------------------------------------------------------------
    def begin(self, on_round=None) -> None:
        self.on_round = on_round
        self.clock = Clock(self.dev).__enter__()

    def next_bucket(self):
        """The coming step's plan (lo, e, i), or None when the request has finished (every step run, or a stop)."""
        if self.stopped or self.step_index >= self.n_steps:
            return None
        if self.block_topk:
            b, i = divmod(self.step_index, self.spb)
            e = self.P + (b + 1) * self.cfg.block_length
            if i == 0:
                self.st["e"].fill_(e)  # in place (a CUDA workspace): a kernel launch, no host read
            return self.fm, e, i  # candidates: the masks in [fm, e)
        return min(self.fm, self.L - 1), self.L, self.step_index  # no mask left: one row no rule reads

    def _kind(self, lo: int, e: int, i: int) -> tuple[str, tuple]:
        """The step's kind and sizes (lopa_fast.decode.steps): exact rows eagerly, a row bucket when compiled."""
        size = (lambda n: n) if self.compiled is None else bucket
        if self.block_topk:
            return "block_topk", (size(max(e - lo, 1)), self.schedule[i])
        n = dream_count(self.n_mask, self.ts, i, self.n_steps) if self.cfg.alg != "origin" else 0
        return "timestep", (size(self.L - lo), n)

    def prepare(self, lo: int, e: int, i: int) -> dict:
        """The step's forward inputs (`part`: tokens [NB, L], NB 2 with LLaDA's cfg_scale: the prompt-masked
        unconditional row beside the conditional one; rows [R] that get the LM head) and what its `finish` needs."""
        kind, sizes = self._kind(lo, e, i)
        pre, post = vanilla_step.parts(self.geo, kind, sizes)
        part, ctx = pre(self.st, self.T)
        self._before = self.x.clone() if self.trace is not None else None
        return dict(lo=lo, kind=kind, part=part, ctx=ctx, post=post)

    def forward_args(self, w: dict) -> dict:
        """This request's part of `model.forward_requests` (the arguments of its solo cache-free forward)."""
        return w["part"]

    def finish(self, w: dict, logits: torch.Tensor, k_win=None, v_win=None) -> None:
        """The step after its forward (raw logits [R, V] of the rows): statistics, the commit, the counters."""
        self._lo = w["lo"]
        self.st, self._info = w["post"](self.st, self.T, w["ctx"], logits, k_win, v_win)

    def read_head(self) -> None:
        """The step's one host read (its head): the guard, the first mask and the masks left."""
        self.stats["host_reads"] += 1
        self._b, _, self.fm, self.n_mask = self.st["head"].tolist()

    def after_round(self) -> None:
        """The counters, the guard's refusal, the trace entry and the hook (with a stop check) of the step just
        run."""
        self.stats["forwards"] += 1
        self.stats["model_calls"] += 1
        self.step_index += 1
        if self._b >= 0:
            steps.refuse(self._info["logits"][self._b], self._lo + self._b, self.stats["forwards"], "vanilla",
                         self.cfg.temperature)  # fmt: skip
        if self.trace is not None:
            x, P, before = self.x, self.P, self._before
            pos = ((before == self.mask_id) & (x != self.mask_id)).nonzero(as_tuple=True)[0]
            self.trace.append({"round": self.stats["forwards"], "accepted": [[int(q) - P, int(x[q])] for q in pos]})
        if after_step(self.x[self.P :], self.cfg, self.stats, self.on_round):
            self.stopped = True

    def batch_step(self, lo: int, e: int, i: int):
        """compile=True in a batch: the step as a compiled batch's BatchStep (lopa_fast.decode.compiled_batch)."""
        if self.compiled is None:
            return None
        self._before = self.x.clone() if self.trace is not None else None
        self._lo = lo
        return steps.batch_step(self.compiled, self.cview, self.model, self.st, self.T, self.geo,
                                *self._kind(lo, e, i), vanilla_step.parts)  # fmt: skip

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result (its state, {"logits"}); `read_head` and `after_round` finish it."""
        self.st, self._info = st, info

    def result(self) -> GenerateOutput:
        """Stop the clock; the tokens, the counters and stats, the trace."""
        self.clock.__exit__(None, None, None)
        cfg, stats = self.cfg, self.stats
        stats["transferred"] = int(self.st["transferred"])
        if self.compiled is not None:
            stats.update(self.compiled.stats(self.cview))
        stats["host_reads_per_step"] = stats["host_reads"] / max(1, stats["forwards"])
        ids = self.x[self.P :].tolist()
        finalize_stats(stats, ids, cfg.eos_token_id, cfg.mask_token_id, self.clock.seconds, steps_plus_one=False)
        if stats["masks_left"] and not stats.get("stopped"):
            warnings.warn(
                f"vanilla: {stats['masks_left']} of {len(ids)} generated positions still hold the mask id "
                f"{cfg.mask_token_id} after steps={cfg.steps} (the model predicted the mask token, or alg='origin' "
                "left them); see stats['masks_left'], or pass suppress_mask_token=True", RuntimeWarning, stacklevel=4)
        return GenerateOutput(ids, stats, self.trace)
