"""Reference threshold parallel decoding (Fast-dLLM v1 / dParallel) inside LLaDA's semi-AR block loop.

docs/semantics.md sections 4.2-4.4 and 5. x = [prompt | MASK x max_new_tokens], blocks of
`block_length` decoded left to right; `steps` is only checked for divisibility (as upstream). Per step,
the masked positions of the current block are candidates and ONE of three commit rules runs (rank 1 is
always committed):

- `threshold=tau`        (Fast-dLLM): sort by confidence, commit every other rank with conf >= tau
                         (upstream drops `conf < tau`, so equality commits).
- `factor=f`             (newer Fast-dLLM): find the first rank k (1-based) with c(k) < 1 - f/(k+1)
                         (rank 1's threshold is -1); commit ranks < k, except that a break at rank 1 or at
                         the LAST rank commits one more (upstream's edge case: a break at the last rank
                         commits every candidate); no break commits all.
- `entropy_threshold=h`  (dParallel): sort by entropy ascending, commit every other rank with H <= h
                         (upstream drops `H > h`); H = -sum p log(p + 1e-12) in float64, nats.

Confidence: LLaDA family: x0 = argmax of the logits (float64 Gumbel-max at T > 0), conf =
softmax(float64 logits)[x0] (Fast-dLLM). Dream family: Dream's sampler (temperature, top-p, top-k,
softmax in fp32), conf = p(x0); Dream logits are shifted with upstream's `cat(l[:1], l[:-1])`.

Caches (`cache=`), with Fast-dLLM's exact approximations, on the static KVCache:
- None:      every step forwards the whole sequence without a cache. Candidates are ALL masks before the
             block end (as upstream LLaDA, which never restricts the start).
- "prefix":  each block starts with a refresh forward over the whole sequence (its K/V for [0, block
             start) become the cache; that forward also decodes the block's first step); later steps
             forward x[block start:] (block + every later mask) over that cache.
- "dual":    the refresh caches K/V of ALL positions; later steps forward only the block and overwrite its
             K/V in place (forward_window in-place mode), attending to the stale suffix.
  Dream refresh steps commit only the block's first token, unconditionally (Fast-dLLM's Dream loop:
  position s is predicted from s-1, which is not recomputed afterwards).
- Forward counting: the newer loop (checks the block before each cached forward) by default;
  `count_noop_forward=True` runs the old loop (Fast-dLLM 24cc59e, dParallel), whose first cached forward
  after a refresh always runs, even when the refresh already filled the block, and commits nothing then.
"""
from __future__ import annotations

import torch

from lopa_fast.output.progress import after_step
from lopa_fast.output import GenerateOutput, finalize_stats
from lopa_fast.keyed import TOKEN
from lopa_fast.reference.common import Clock, check_finite, draw_kw, request_noise, record_step, round_cap_hit
from lopa_fast.sampling import threshold_stats


def factor_count(sorted_conf: list[float], factor: float) -> int:
    """How many of the candidates (confidences sorted descending) the factor rule commits (>= 1)."""
    n = len(sorted_conf)
    threshs = [1 - factor / (k + 1) for k in range(1, n + 1)]
    threshs[0] = -1
    top_i = 0
    for top_i in range(n):
        if sorted_conf[top_i] < threshs[top_i]:
            break
    if top_i == 0 or top_i == n - 1:
        top_i += 1
    return top_i


def select(conf: torch.Tensor, ent: torch.Tensor, cand: torch.Tensor, cfg) -> torch.Tensor:
    """Indices (into the row) to commit. conf/ent [n] over the window rows, cand bool [n]."""
    k = int(cand.sum())
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=conf.device)
    if cfg.entropy_threshold is not None:
        e = torch.where(cand, ent, torch.full_like(ent, float("inf")))
        idx = torch.topk(e, k, largest=False).indices
        keep = [0] + [j for j in range(1, k) if not bool(e[idx[j]] > cfg.entropy_threshold)]
        return idx[keep]
    c = torch.where(cand, conf, torch.full_like(conf, float("-inf")))
    if cfg.factor is not None:
        n = factor_count(torch.sort(c[cand], descending=True).values.tolist(), cfg.factor)
        return torch.topk(c, n).indices
    idx = torch.topk(c, k).indices
    keep = [0] + [j for j in range(1, k) if not bool(c[idx[j]] < cfg.threshold)]
    return idx[keep]


def step_stats(model, logits: torch.Tensor, cfg, gen, step: int = 0, lo: int = 0):
    """x0 [n], conf [n] (float64 LLaDA, float32 Dream), entropy [n] float64 for aligned logits [n, V] whose
    rows predict positions lo, lo + 1, ... (lopa_fast.sampling.threshold_stats; the keyed sampler's draws are
    keyed by (step, position))."""
    draw = draw_kw(gen, cfg, TOKEN, step, 0, lo + torch.arange(logits.shape[0], device=logits.device))
    return threshold_stats(logits, stats_in_float64=model.config.stats_in_float64, temperature=cfg.temperature,
                           top_p=cfg.top_p, top_k=cfg.top_k,
                           suppress_token=cfg.mask_token_id if cfg.suppress_mask_token else None, **draw)


def align(model, raw: torch.Tensor) -> torch.Tensor:
    """Dream family: upstream's shift `cat(l[:1], l[:-1])` (the first row keeps its own logits)."""
    return torch.cat([raw[:1], raw[:-1]]) if model.logits_shift else raw


def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """Threshold decoding. prompt: LongTensor [P] on model.device; cfg: bound GenerateConfig; on_round: the
    progress hook (lopa_fast.output.progress.report_round), called after every forward. A stop sequence (`stop=`)
    in the finalised prefix ends decoding after the forward that completed it."""
    P, G, B = prompt.numel(), cfg.max_new_tokens, cfg.block_length
    mask_id = cfg.mask_token_id
    gen = request_noise(cfg, prompt.device)
    x = torch.cat([prompt, prompt.new_full((G,), mask_id)])
    L = x.numel()
    cache = model.new_cache(L) if cfg.cache is not None else None
    draws_all_rows = not model.config.stats_in_float64  # Dream's sampler draws every row it is given at T > 0
    refresh_commits_first = model.config.refresh_commits_first  # Fast-dLLM Dream: the block's first token
    stats = {"forwards": 0, "model_calls": 0, "refresh_forwards": 0, "multi_token_steps": 0, "noop_forwards": 0}

    def budget() -> bool:
        if stats["forwards"] >= cfg.max_rounds:
            round_cap_hit(cfg, stats, "threshold")
            return False
        return True

    trace = [] if cfg.return_trace else None
    stopped: list[bool] = []  # appended to when a stop sequence ends decoding

    def commit(lo: int, logits: torch.Tensor, cand: torch.Tensor) -> None:
        """Decode one step from window logits [n, V] covering positions [lo, lo+n)."""
        guard(lo, logits, cand)
        x0, conf, ent = step_stats(model, logits, cfg, gen, stats["forwards"], lo)
        sel = select(conf, ent, cand, cfg)
        before = x.clone() if trace is not None else None
        x[lo + sel] = x0[sel]
        record_step(trace, stats["forwards"], before, x, P, mask_id=mask_id, window_start=lo - P)
        if sel.numel() >= 2:
            stats["multi_token_steps"] += 1
        if sel.numel() == 0:
            stats["noop_forwards"] += 1
        if after_step(x[P:], cfg, stats, on_round):  # the hook; a stop sequence in the finalised prefix
            stopped.append(True)

    def guard(lo: int, logits: torch.Tensor, cand) -> None:
        """The numerics guard on the rows this step reads (the candidates; every row the sampler draws at T > 0)."""
        if cand is None or (cfg.temperature > 0 and draws_all_rows):
            check_finite(logits, lo, cfg, stats["forwards"])
        else:
            idx = cand.nonzero(as_tuple=True)[0]
            check_finite(logits[idx], idx + lo, cfg, stats["forwards"])

    def count(refresh=False):
        stats["forwards"] += 1
        stats["model_calls"] += 1
        stats["refresh_forwards"] += int(refresh)

    def block_full(s: int, e: int) -> bool:
        return not bool((x[s:e] == mask_id).any())

    with Clock(prompt.device) as clock:
        for b in range(G // B):
            s, e = P + b * B, P + (b + 1) * B
            if cfg.cache is None:
                while True:
                    if not budget():
                        break
                    logits = align(model, model.forward_window(x[None], mask="full")[0])
                    count()
                    cand = x == mask_id
                    cand[e:] = False
                    commit(0, logits, cand)
                    if block_full(s, e) or stopped:
                        break
            else:
                if not budget():
                    break
                cache.reset()
                keep = s if cfg.cache == "prefix" else L
                logits = align(model, model.forward_window(x[None], cache=cache, mask="full", commit=keep)[0])
                count(refresh=True)
                if refresh_commits_first:
                    guard(s, logits[s : s + 1], None)
                    x0, _, _ = step_stats(model, logits[s : s + 1], cfg, gen, stats["forwards"], s)
                    before = x.clone() if trace is not None else None
                    x[s] = x0[0]
                    record_step(trace, stats["forwards"], before, x, P, mask_id=mask_id, window_start=0)
                    if after_step(x[P:], cfg, stats, on_round):
                        stopped.append(True)
                else:
                    cand = x == mask_id
                    cand[e:] = False
                    commit(0, logits, cand)
                first = True
                while not stopped:
                    if block_full(s, e) and not (cfg.count_noop_forward and first):
                        break
                    first = False
                    if not budget():
                        break
                    if cfg.cache == "prefix":
                        raw = model.forward_window(x[s:][None], cache=cache, mask="full")[0]
                        cand = x[s:] == mask_id
                        cand[B:] = False
                    else:
                        raw = model.forward_window(x[s:e][None], cache=cache, start=s, mask="full")[0]
                        cand = x[s:e] == mask_id
                    count()
                    commit(s, align(model, raw), cand)
                    if block_full(s, e):
                        break
            if stats.get("hit_round_cap") or stopped:
                break
    ids = x[P:].tolist()
    finalize_stats(stats, ids, cfg.eos_token_id, mask_id, clock.seconds, steps_plus_one=False)
    return GenerateOutput(ids, stats, trace)
