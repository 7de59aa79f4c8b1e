"""The fast vanilla decoder (LLaDA low-confidence / random remasking, Dream's samplers): the step on the device,
one host read per step.

Semantics are exactly `lopa_fast.strategies.vanilla.reference`'s (its docstring; docs/semantics.md section 4.1):
token- and forward-exact at T = 0 and, with the keyed sampler, for every random ordering and T > 0. The step is
lopa_fast.strategies.vanilla.step (candidates, statistics, the top-k and the counters on the device; the LM head
only on the rows from the first mask to the candidates' end); this module is its step plan (LLaDA's blocks and
transfer schedule, Dream's timesteps and transfer counts) on lopa_fast.strategies.step_driver's `StepDriver`.
"""
from __future__ import annotations

import warnings

import torch

from lopa_fast.strategies.step_driver import StepDriver
from lopa_fast.strategies.vanilla import step as vanilla_step
from lopa_fast.strategies.vanilla.spec import transfer_schedule


def dream_count(n_mask: int, ts: torch.Tensor, i: int, n_steps: int) -> int:
    """Dream's transfer count of step i (a host int: torch.topk's k) from the masks left (the last head) and the
    host timesteps ts [steps + 1]: upstream's int(num_mask * (1 - s / t)) in float32 tensor arithmetic (CPU
    float32 ops are IEEE-rounded like the device's), every mask on the last step."""
    if i == n_steps - 1:
        return n_mask
    return int(torch.tensor(n_mask, dtype=torch.float32) * (1 - ts[i + 1] / ts[i]))


class VanillaDriver(StepDriver):
    """One vanilla request (lopa_fast.strategies.step_driver.StepDriver: the step state, the forwards, the host
    counters and the trace) stepped by the one loop. A step's "bucket" is its plan (lo: the first row's position,
    e: the candidates' end, i: the step within the block / the schedule).

    model: DecoderLM; prompt: LongTensor [P] on model.device; cfg: a bound vanilla GenerateConfig; cache: a batch's
    pool slot views [layers, 1, Hkv, D] (unused: vanilla forwards are cache-free; its one row keeps the pool's
    bookkeeping uniform)."""

    name = "vanilla"
    parts = staticmethod(vanilla_step.parts)

    def __init__(self, model, prompt: torch.Tensor, cfg, cache=None):
        self.block_topk = model.config.vanilla_commit == "block_topk"  # LLaDA's sampler, else Dream's "timestep"
        self.step_index = 0  # steps run (LLaDA: block * steps_per_block + i)
        ts = None
        if self.block_topk:
            self.nb = cfg.max_new_tokens // cfg.block_length
            self.spb = cfg.steps // self.nb
            self.schedule = transfer_schedule(cfg.block_length, self.spb)  # every block starts all masks
            self.n_steps = self.nb * self.spb
        else:
            self.n_steps = cfg.steps
            ts = torch.linspace(1, cfg.eps, cfg.steps + 1, device=prompt.device)  # float32, as upstream
            self.ts = ts.cpu()  # one read per request: the transfer counts are host ints (topk's k)
        super().__init__(model, prompt, cfg, cache, ts)

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

    def _plan(self, lo: int, e: int, i: int) -> tuple[str, tuple, dict]:
        """The step's kind ("block_topk" | "timestep", lopa_fast.strategies.steps) and sizes: exact rows eagerly, a row
        bucket when compiled. Forward inputs: tokens [NB, L], NB 2 with LLaDA's cfg_scale (the prompt-masked
        unconditional row beside the conditional one)."""
        if self.block_topk:
            return "block_topk", (self.size(max(e - lo, 1)), self.schedule[i]), dict(lo=lo)
        n = dream_count(self.n_mask, self.ts, i, self.n_steps) if self.cfg.alg != "origin" else 0
        return "timestep", (self.size(self.L - lo), n), dict(lo=lo)

    def after_round(self) -> None:
        self.step_index += 1
        super().after_round()

    def result(self):
        """Stop the clock; the tokens, the counters and stats, the trace; warns when masks are left."""
        cfg = self.cfg
        out = super().result(transferred=int(self.st["transferred"]))
        stats = out.stats
        if stats["masks_left"] and not stats.get("stopped"):
            warnings.warn(
                f"vanilla: {stats['masks_left']} of {len(out.generated_ids)} generated positions still hold the mask "
                f"id {cfg.mask_token_id} after steps={cfg.steps} (the model predicted the mask token, or alg='origin' "
                "left them); see stats['masks_left'], or pass suppress_mask_token=True", RuntimeWarning, stacklevel=4)
        return out
