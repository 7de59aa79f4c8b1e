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
from lopa_fast.decode import static_steps, steps
from lopa_fast.decode.shapes import pow2_bucket as bucket
from lopa_fast.decode.static_steps import DREAM_CONF, llada_choice
from lopa_fast.keyed import request_noise
from lopa_fast.output import Clock, GenerateOutput, finalize_stats
from lopa_fast.progress import after_step
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


class VanillaDriver:
    """One vanilla request: x [L] on the device, the forwards, the host counters and the trace, as the batch
    scheduler's state machine (lopa_fast.decode.batch: begin / next_bucket / prepare / forward_args / finish /
    read_head / after_round / result; many requests' steps share one `model.forward_requests`); `run()` drives it
    alone (eager through the same stages, or compile=True through CompiledRounds). A step's "bucket" is its plan
    (lo: the first row's position, e: the candidates' end, i: the step within the block / the schedule).

    model: DecoderLM; prompt: LongTensor [P] on model.device; cfg: a bound vanilla GenerateConfig; cache: a batch's
    pool slot views (unused: vanilla forwards are cache-free; its one row keeps the pool's bookkeeping uniform)."""

    mode = "full"  # the forward's attention: full over prompt + the whole region

    def __init__(self, model, prompt: torch.Tensor, cfg, cache=None):
        self.model, self.cfg = model, cfg
        self.dev = prompt.device
        self.P, G = prompt.numel(), cfg.max_new_tokens
        self.mask_id = cfg.mask_token_id
        self.x = torch.cat([prompt, prompt.new_full((G,), self.mask_id)])
        self.L = self.x.numel()
        self.fw = steps.StepForward(model, self.L, cache=False)
        if cache is not None:
            self.use_cache(*cache)
        self.attn_backend = self.fw.backend
        self.noise = request_noise(cfg, self.dev)
        self.stats = {"forwards": 0, "model_calls": 0, "host_reads": 0}
        self.transferred = torch.zeros((), dtype=torch.long, device=self.dev)
        self.trace = [] if cfg.return_trace else None
        self.fm = self.P  # the first mask position, read with each step's head
        self.n_mask = G  # the number of masks, read with each step's head (Dream's transfer count needs it)
        self.geo = static_steps.geometry(model, cfg, self.L)
        self.block_topk = model.config.vanilla_commit == "block_topk"  # LLaDA's sampler, else Dream's "timestep"
        self.step_index = 0  # steps run (LLaDA: block * steps_per_block + i)
        self.stopped = False
        if self.block_topk:
            self.nb = (self.L - self.P) // cfg.block_length
            self.spb = cfg.steps // self.nb
            self.schedule = transfer_schedule(cfg.block_length, self.spb)  # every block starts all masks
            self.n_steps = self.nb * self.spb
        else:
            self.n_steps = cfg.steps
            self.timesteps = torch.linspace(1, cfg.eps, cfg.steps + 1, device=self.dev)  # float32, as upstream
            self.ts = self.timesteps.cpu()  # one read per request: the transfer counts are host ints (topk's k)
            self.allpos = torch.arange(self.L, device=self.dev)
        # compile=True: every step through CompiledRounds (lopa_fast.decode.static_steps), alone or in a batch
        self.compiled = self.cview = None
        from lopa_fast.decode.compiled import CompiledRounds, compile_wanted

        if compile_wanted(cfg, self.dev):
            self.compiled = CompiledRounds.for_model(model, cfg)
            self.cview = self.compiled.view()
            ts = None if self.block_topk else self.timesteps
            self.st, self.T = static_steps.init(model, self.x, self.P, self.geo, self.noise.seed, ts,
                                                static_steps.step_knobs(cfg))

    def use_cache(self, cache_k, cache_v) -> None:
        """The request's (unused) cache rows: a batch's pool slot views (re-pointed when the pool grows)."""
        self.fw.cache_k, self.fw.cache_v = cache_k, cache_v

    def keys(self, stream: int, pos: torch.Tensor) -> torch.Tensor:
        return self.noise.keys(stream, self.stats["forwards"], 0, pos)

    def count(self) -> None:
        self.stats["forwards"] += 1
        self.stats["model_calls"] += 1

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
            if self.compiled is not None and i == 0:
                self.st["e"].fill_(e)  # in place (the CUDA workspace): a kernel launch, no host read
            return self.fm, e, i  # candidates: the masks in [fm, e)
        return min(self.fm, self.L - 1), self.L, self.step_index  # no mask left: one row no rule reads

    def prepare(self, lo: int, e: int, i: int) -> dict:
        """The step's forward inputs: tokens [NB, L] (NB 2 with LLaDA's cfg_scale: the prompt-masked
        unconditional row beside the conditional one) and the flat rows [R] that get the LM head."""
        x, L = self.x, self.L
        if self.block_topk:
            rows = torch.arange(lo, e, device=self.dev)
            if self.cfg.cfg_scale > 0:
                un_x = x.clone()
                un_x[: self.P] = self.mask_id
                return dict(lo=lo, e=e, i=i, tokens=torch.stack([x, un_x]), rows=torch.cat([rows, rows + L]))
            return dict(lo=lo, e=e, i=i, tokens=x[None], rows=rows)
        return dict(lo=lo, e=e, i=i, tokens=x[None], rows=steps.raw_rows(lo, L, 0, True, self.dev))

    def forward_args(self, w: dict) -> dict:
        """This request's part of `model.forward_requests` (the arguments of its solo cache-free forward)."""
        NB = w["tokens"].shape[0]
        return dict(tokens=w["tokens"], start=0, cache_k=self.fw.cache_k, cache_v=self.fw.cache_v, prefix_len=0,
                    win_lens=torch.full((NB,), self.L, dtype=torch.long, device=self.dev), bids=None,
                    rows=w["rows"])  # fmt: skip

    def finish(self, w: dict, logits: torch.Tensor, k_win=None, v_win=None) -> None:
        """The step after its forward (raw logits [R, V] of the rows): statistics, the commit, the counters."""
        self.count()
        self._before = self.x.clone() if self.trace is not None else None
        self._lo = w["lo"]
        if self.block_topk:
            self._llada(w, logits)
        else:
            self._dream(w, logits)

    def _llada(self, w: dict, logits: torch.Tensor) -> None:
        cfg, x, L, dev = self.cfg, self.x, self.L, self.dev
        lo, e, i = w["lo"], w["e"], w["i"]
        if cfg.cfg_scale > 0:  # conditional and unconditional (prompt masked) rows of one forward
            cond, un = logits[: e - lo], logits[e - lo :]
            logits = un + (cfg.cfg_scale + 1) * (cond - un)
        rows = w["rows"][: e - lo]
        cand = x[lo:e] == self.mask_id
        self._bad = steps.first_bad_row(logits, cand, cfg.temperature)  # before the deliberate -inf below
        self._logits = logits
        x0, x0_p = llada_choice(logits, self.geo, cfg.temperature,
                                self.keys(keyed.TOKEN, rows) if cfg.temperature > 0 else None,
                                self.keys(keyed.REMASK, rows) if cfg.remasking == "random" else None)
        # full-length rows, so torch.topk sees the reference's vector (its order among exact ties)
        conf = torch.full((L,), float("-inf"), dtype=x0_p.dtype, device=dev)
        conf[lo:e] = torch.where(cand, x0_p, float("-inf"))
        sel = torch.topk(conf, self.schedule[i]).indices
        x[sel] = torch.cat([x[:lo], x0, x[e:]])[sel]
        self.transferred += self.schedule[i]

    def _dream(self, w: dict, logits: torch.Tensor) -> None:
        cfg, x, L, dev, mask_id = self.cfg, self.x, self.L, self.dev, self.mask_id
        lo, i, n_steps = w["lo"], w["i"], self.n_steps
        pos = self.allpos[lo:]
        cand = x[lo:] == mask_id
        self._bad = steps.first_bad_row(logits, cand, cfg.temperature)
        self._logits = logits
        kw = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                  suppress_token=mask_id if cfg.suppress_mask_token else None)  # fmt: skip
        keys = self.keys(keyed.TOKEN, pos) if cfg.temperature > 0 else None
        t, s = self.timesteps[i], self.timesteps[i + 1]
        if cfg.alg == "origin":
            p_transfer = 1 - s / t if i < n_steps - 1 else 1
            reveal = cand & (keyed.uniform(self.keys(keyed.REVEAL, pos)) < p_transfer)
            _, tok, _ = token_stats(logits, **kw, keys=keys)
            x[lo:] = torch.where(reveal, tok, x[lo:])
            self.transferred += reveal.sum()
            return
        conf, x0, _ = token_stats(logits, sampling_strategy=DREAM_CONF[cfg.alg], **kw, keys=keys)
        n = dream_count(self.n_mask, self.ts, i, n_steps)
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
                                        self.keys(keyed.ORDER, self.allpos))  # fmt: skip
                x.copy_(torch.where(race, x0_full, x))
        self.transferred += n

    def read_head(self) -> None:
        """The step's one host read: the guard, the first mask and the masks left (a compiled batch step's:
        `after_round`, with the rest of its bookkeeping)."""
        if self.compiled is not None:
            self._b = self._read_compiled_head()
            return
        self.stats["host_reads"] += 1
        self._head = steps.read_head(self._bad, steps.first_mask(self.x, self.mask_id),
                                     (self.x == self.mask_id).sum())  # fmt: skip
        _, self.fm, self.n_mask = self._head

    def after_round(self) -> None:
        """The guard's refusal, the trace entry and the hook (with a stop check) of the step just run."""
        if self.compiled is not None:
            self._compiled_after(self._info, *self._pending, self._b)
            return
        self.step_index += 1
        if self._head[0] >= 0:
            steps.refuse(self._logits[self._head[0]], self._lo + self._head[0], self.stats["forwards"], "vanilla",
                         self.cfg.temperature)  # fmt: skip
        self._record(self._before)

    def _record(self, before) -> None:
        if self.trace is not None:
            x, P = self.x, self.P
            pos = ((before == self.mask_id) & (x != self.mask_id)).nonzero(as_tuple=True)[0]
            self.trace.append({"round": self.stats["forwards"], "accepted": [[int(q) - P, int(x[q])] for q in pos]})
        if after_step(self.x[self.P :], self.cfg, self.stats, self.on_round):
            self.stopped = True

    def _kind(self, lo: int, e: int, i: int) -> tuple[str, tuple]:
        """compile=True: the step's kind and bucket sizes (lopa_fast.decode.static_steps)."""
        if self.block_topk:
            return "block_topk", (bucket(max(e - lo, 1)), self.schedule[i])
        n = dream_count(self.n_mask, self.ts, i, self.n_steps) if self.cfg.alg != "origin" else 0
        return "timestep", (bucket(self.L - lo), n)

    def compiled_step(self, lo: int, e: int, i: int) -> None:
        """compile=True: the step as one compiled / captured callable (forward, statistics, commit, counters,
        head), then the one host read, the guard, the trace and the hook."""
        before = self.x.clone() if self.trace is not None else None
        self.st, info = static_steps.run_compiled(self.compiled, self.model, self.st, self.T, self.geo,
                                                  *self._kind(lo, e, i))  # fmt: skip
        self._compiled_after(info, lo, before, self._read_compiled_head())

    def batch_step(self, lo: int, e: int, i: int):
        """compile=True in a batch: the step as a compiled batch's BatchStep (lopa_fast.decode.compiled_batch)."""
        if self.compiled is None:
            return None
        self._pending = (lo, self.x.clone() if self.trace is not None else None)
        return static_steps.batch_step(self.compiled, self.cview, self.model, self.st, self.T, self.geo,
                                       *self._kind(lo, e, i))  # fmt: skip

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result (its state, {"logits"}); `read_head` and `after_round` finish it."""
        self.st, self._info = st, info

    def _read_compiled_head(self) -> int:
        """A compiled step's one host read (its head): the first non-finite row (or -1); sets the first mask and the
        masks left."""
        self.stats["host_reads"] += 1
        b, _, self.fm, self.n_mask = self.st["head"].tolist()
        return b

    def _compiled_after(self, info: dict, lo: int, before, b: int) -> None:
        """After a compiled step and its host read: the counters, the guard, the trace and the hook."""
        self.x = self.st["x"]
        self.count()
        self.step_index += 1
        if b >= 0:
            steps.refuse(info["logits"][b], lo + b, self.stats["forwards"], "vanilla", self.cfg.temperature)
        self._record(before)

    def run(self, on_round=None) -> GenerateOutput:
        """Decode the request alone: every step through the stages above (or compiled), then the result."""
        self.begin(on_round)
        while (b := self.next_bucket()) is not None:
            if self.compiled is not None:
                self.compiled_step(*b)
                continue
            w = self.prepare(*b)
            self.finish(w, self.fw.full(w["tokens"], w["rows"]))
            self.read_head()
            self.after_round()
        return self.result()

    def result(self) -> GenerateOutput:
        """Stop the clock; the tokens, the counters and stats, the trace."""
        self.clock.__exit__(None, None, None)
        cfg, stats = self.cfg, self.stats
        stats["transferred"] = int(self.transferred if self.compiled is None else self.st["transferred"])
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


def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """Vanilla decoding on the fast backend. prompt: LongTensor [P] on model.device; cfg: bound GenerateConfig
    (covered: lopa_fast.strategies.fast_not_covered); on_round: the progress hook."""
    return VanillaDriver(model, prompt, cfg).run(on_round)
