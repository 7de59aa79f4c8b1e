"""The fast vanilla decoder (LLaDA low-confidence / random remasking, Dream's samplers): the step on the device,
one host read per step.

Semantics are exactly `lopa_fast.reference.vanilla` (docs/semantics.md section 4.1; token- and forward-exact
at T = 0 and, with the keyed sampler, for every random ordering and T > 0):
- LLaDA: semi-autoregressive blocks, `steps // num_blocks` steps per block with the transfer schedule, per
  step one cache-free forward (cfg_scale > 0: the conditional and the prompt-masked unconditional rows in
  ONE batched forward), commit the top-k candidates by confidence (softmax(logits)[x0] or a keyed uniform).
- Dream: `steps` steps over the whole generation on timesteps linspace(1, eps, steps + 1) (float32):
  `origin` reveals each mask with probability 1 - s/t, the others commit int(n_mask * (1 - s/t)) highest-
  confidence masks (or a keyed draw without replacement from softmax(conf / alg_temp)).

What changes is how: candidates, statistics, the top-k and the counters stay on the device, the LM head runs
only on the rows from the first mask to the candidates' end (`steps.raw_rows`), the forward is the fused
static one, and the only host read of a step is the head (the first non-finite row, the first mask).
compile=True runs each step as one compiled / captured callable instead (lopa_fast.decode.static_steps: the
same numerics on static shapes, through CompiledRounds.steps_step), with the same one host read.
"""
from __future__ import annotations

import warnings

import torch

from lopa_fast import keyed
from lopa_fast.contracts import after_step
from lopa_fast.decode import static_steps, steps
from lopa_fast.decode.shapes import pow2_bucket as bucket
from lopa_fast.decode.static_steps import DREAM_CONF, llada_choice
from lopa_fast.keyed import request_noise
from lopa_fast.output import Clock, GenerateOutput, finalize_stats
from lopa_fast.sampling import token_stats


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


class _Loop:
    """The state of one request: x [L] on the device, the forwards, the host counters and the trace."""

    def __init__(self, model, prompt: torch.Tensor, cfg, on_round):
        self.model, self.cfg, self.on_round = model, cfg, on_round
        self.dev = prompt.device
        self.P, G = prompt.numel(), cfg.max_new_tokens
        self.mask_id = cfg.mask_token_id
        self.x = torch.cat([prompt, prompt.new_full((G,), self.mask_id)])
        self.L = self.x.numel()
        self.fw = steps.StepForward(model, self.L, cache=False)
        self.noise = request_noise(cfg, self.dev)
        self.stats = {"forwards": 0, "model_calls": 0, "host_reads": 0}
        self.transferred = torch.zeros((), dtype=torch.long, device=self.dev)
        self.trace = [] if cfg.return_trace else None
        self.fm = self.P  # the first mask position, read with each step's head
        self.n_mask = G  # the number of masks, read with each step's head (Dream's transfer count needs it)
        self.geo = static_steps.geometry(model, cfg, self.L)
        self.compiled = None  # compile=True: every step through CompiledRounds (lopa_fast.decode.static_steps)
        from lopa_fast.decode.compiled import CompiledRounds, compile_wanted

        if compile_wanted(cfg, self.dev):
            self.compiled = CompiledRounds.for_model(model, cfg)
            ts = None
            if model.config.kind != "llada":
                ts = torch.linspace(1, cfg.eps, cfg.steps + 1, device=self.dev)
            self.st, self.T = static_steps.init(model, self.x, self.P, self.geo, self.noise.seed, ts)

    def keys(self, stream: int, pos: torch.Tensor) -> torch.Tensor:
        return self.noise.keys(stream, self.stats["forwards"], 0, pos)

    def finish_step(self, bad: torch.Tensor | None, logits: torch.Tensor, lo: int, before) -> bool:
        """The step's one host read (guard + first mask; bad None: the compiled step's head), the trace, the hook;
        True when a stop sequence ends it."""
        self.stats["host_reads"] += 1
        if bad is None:
            b, _, self.fm, self.n_mask = self.st["head"].tolist()
        else:
            b, self.fm, self.n_mask = steps.read_head(bad, steps.first_mask(self.x, self.mask_id),
                                                      (self.x == self.mask_id).sum())  # fmt: skip
        if b >= 0:
            steps.refuse(logits[b], lo + b, self.stats["forwards"], "vanilla", self.cfg.temperature)
        if self.trace is not None:
            x, P = self.x, self.P
            pos = ((before == self.mask_id) & (x != self.mask_id)).nonzero(as_tuple=True)[0]
            self.trace.append({"round": self.stats["forwards"], "accepted": [[int(q) - P, int(x[q])] for q in pos]})
        return after_step(self.x[self.P :], self.cfg, self.stats, self.on_round)

    def count(self) -> None:
        self.stats["forwards"] += 1
        self.stats["model_calls"] += 1

    def compiled_step(self, kind: str, sizes: tuple, lo: int) -> bool:
        """compile=True: the step as one compiled / captured callable (forward, statistics, commit, counters,
        head), then finish_step's one host read; lo: the first row's position (the error message's)."""
        before = self.x.clone() if self.trace is not None else None
        self.st, info = static_steps.run_compiled(self.compiled, self.model, self.st, self.T, self.geo, kind, sizes)
        self.x = self.st["x"]
        self.count()
        return self.finish_step(None, info["logits"], lo, before)

    # ---- LLaDA ------------------------------------------------------------------------------------------
    def llada(self) -> None:
        cfg, x, P, L, mask_id, dev = self.cfg, self.x, self.P, self.L, self.mask_id, self.dev
        bl = cfg.block_length
        nb = (L - P) // bl
        spb = cfg.steps // nb
        # every block starts all masks: a step commits only candidates before its block's end
        sched = transfer_schedule(bl, spb)
        for b in range(nb):
            e = P + (b + 1) * bl
            if self.compiled is not None:
                self.st["e"].fill_(e)  # in place (the CUDA workspace): a kernel launch, no host read
            for i in range(spb):
                lo = self.fm  # candidates: the masks in [fm, e)
                if self.compiled is not None:
                    if self.compiled_step("llada", (bucket(max(e - lo, 1)), sched[i]), lo):
                        return
                    continue
                rows = torch.arange(lo, e, device=dev)
                if cfg.cfg_scale > 0:  # conditional and unconditional (prompt masked) rows in one forward
                    un_x = x.clone()
                    un_x[:P] = mask_id
                    both = self.fw.full(torch.stack([x, un_x]), torch.cat([rows, rows + L]))
                    cond, un = both[: e - lo], both[e - lo :]
                    logits = un + (cfg.cfg_scale + 1) * (cond - un)
                else:
                    logits = self.fw.full(x[None], rows)
                self.count()
                cand = x[lo:e] == mask_id
                bad = steps.first_bad_row(logits, cand, cfg.temperature)  # before the deliberate -inf below
                x0, x0_p = llada_choice(logits, self.geo, self.keys(keyed.TOKEN, rows) if cfg.temperature > 0 else None,
                                        self.keys(keyed.REMASK, rows) if cfg.remasking == "random" else None)
                # full-length rows, so torch.topk sees the reference's vector (its order among exact ties)
                conf = torch.full((L,), float("-inf"), dtype=x0_p.dtype, device=dev)
                conf[lo:e] = torch.where(cand, x0_p, float("-inf"))
                sel = torch.topk(conf, sched[i]).indices
                before = x.clone() if self.trace is not None else None
                x[sel] = torch.cat([x[:lo], x0, x[e:]])[sel]
                self.transferred += sched[i]
                if self.finish_step(bad, logits, lo, before):
                    return

    # ---- Dream ------------------------------------------------------------------------------------------
    def dream(self) -> None:
        cfg, x, L, mask_id, dev = self.cfg, self.x, self.L, self.mask_id, self.dev
        n_steps = cfg.steps
        timesteps = torch.linspace(1, cfg.eps, n_steps + 1, device=dev)  # float32, as upstream
        ts = timesteps.cpu()  # one read per request: the transfer counts are host ints (torch.topk's k)
        kw = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                  suppress_token=mask_id if cfg.suppress_mask_token else None)  # fmt: skip
        allpos = torch.arange(L, device=dev)
        for i in range(n_steps):
            lo = min(self.fm, L - 1)  # no mask left: one row, whose statistics no rule reads
            if self.compiled is not None:
                n = dream_count(self.n_mask, ts, i, n_steps) if cfg.alg != "origin" else 0
                if self.compiled_step("dream", (bucket(L - lo), n), lo):
                    return
                continue
            pos = allpos[lo:]
            logits = self.fw.full(x[None], steps.raw_rows(lo, L, 0, True, dev))
            self.count()
            cand = x[lo:] == mask_id
            bad = steps.first_bad_row(logits, cand, cfg.temperature)
            keys = self.keys(keyed.TOKEN, pos) if cfg.temperature > 0 else None
            t, s = timesteps[i], timesteps[i + 1]
            before = x.clone() if self.trace is not None else None
            if cfg.alg == "origin":
                p_transfer = 1 - s / t if i < n_steps - 1 else 1
                reveal = cand & (keyed.uniform(self.keys(keyed.REVEAL, pos)) < p_transfer)
                _, tok, _ = token_stats(logits, **kw, keys=keys)
                x[lo:] = torch.where(reveal, tok, x[lo:])
                self.transferred += reveal.sum()
            else:
                conf, x0, _ = token_stats(logits, sampling_strategy=DREAM_CONF[cfg.alg], **kw, keys=keys)
                n = dream_count(self.n_mask, ts, i, n_steps)
                full_conf = torch.full((L,), float("-inf"), dtype=logits.dtype, device=dev)
                full_conf[lo:] = torch.where(cand, conf.to(logits.dtype), float("-inf"))
                if n > 0:
                    x0_full = torch.cat([torch.full((lo,), mask_id, dtype=x.dtype, device=dev),
                                         torch.where(cand, x0, mask_id)])  # fmt: skip
                    if cfg.alg_temp is None or cfg.alg_temp == 0:
                        sel = torch.topk(full_conf, n).indices
                        x[sel] = x0_full[sel]
                    else:  # n of L without replacement, p ~ softmax(conf / alg_temp), keyed
                        race = keyed.top_n_race(torch.softmax(full_conf / cfg.alg_temp, -1), n,
                                                self.keys(keyed.ORDER, allpos))  # fmt: skip
                        x.copy_(torch.where(race, x0_full, x))
                self.transferred += n
            if self.finish_step(bad, logits, lo, before):
                return


def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """Vanilla decoding on the fast backend. prompt: LongTensor [P] on model.device; cfg: bound GenerateConfig
    (covered: lopa_fast.decode.fast_not_covered); on_round: the progress hook."""
    run = _Loop(model, prompt, cfg, on_round)
    with Clock(run.dev) as clock:
        run.llada() if model.config.kind == "llada" else run.dream()
    stats = run.stats
    stats["transferred"] = int(run.transferred if run.compiled is None else run.st["transferred"])
    if run.compiled is not None:
        stats.update(run.compiled.stats())
    stats["host_reads_per_step"] = stats["host_reads"] / max(1, stats["forwards"])
    ids = run.x[run.P :].tolist()
    finalize_stats(stats, ids, cfg.eos_token_id, cfg.mask_token_id, clock.seconds, steps_plus_one=False)
    if stats["masks_left"] and not stats.get("stopped"):
        warnings.warn(
            f"vanilla: {stats['masks_left']} of {len(ids)} generated positions still hold the mask id "
            f"{cfg.mask_token_id} after steps={cfg.steps} (the model predicted the mask token, or alg='origin' left "
            "them); see stats['masks_left'], or pass suppress_mask_token=True", RuntimeWarning, stacklevel=3)
    return GenerateOutput(ids, stats, run.trace)
