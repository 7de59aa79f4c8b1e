"""Reference LoPA (Lookahead Parallel Decoding) on D2F (docs/semantics.md section 3).

Keeps the structure of upstream `DreamLoRA._generate_enhanced_speculative` (zhijie-group/LoPA,
scale_dream_d2f): every round verifies the candidate branches one forward each, over the same committed
cache (our static KVCache: each branch's window forward leaves the cache untouched, its to-cache span
K/V is kept with `cache.window_span`, and only the winner's span is appended: Commit-Winner-Cache). The
winner's logits are reused for the anchor fill and for spawning the next round's lookaheads, so a round
costs one (batched, conceptually) forward.

Branch convention (upstream's Dream repository): branching_factor=1 spawns no lookahead and is exactly
plain D2F (reference_d2f.py); branching_factor=k >= 2 spawns k lookaheads, so a round verifies k+1
sequences (anchor + k). LoPA-Dist's Branch Parallel code instead verifies branching_factor sequences
(k-1 lookaheads); pass branching_factor=k-1 here to get its count.

Order inside a round: lookaheads in rank order, then the anchor LAST; ties in the branch score go to the
earliest in that order (upstream's stable sort with reverse=True), so a lookahead beats an equal anchor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lopa_fast.output import GenerateOutput, finalize_stats
from lopa_fast.output.progress import first_stop, report_round
from lopa_fast.reference.common import Clock, check_finite, request_noise, round_cap_hit, token_stats
from lopa_fast.strategies.lopa.reference_d2f import (
    active_ids,
    anchor_fill,
    copy_blocks,
    fill_stats,
    forward_branch,
    is_done,
    mark_to_cache,
    maybe_grow,
    new_block,
    predictions,
    retire_blocks,
    stats_kw,
    update_activation,
)


@dataclass
class Branch:
    """One candidate sequence. rank orders the round (lookaheads 0..k-1 by confidence rank; anchor last)."""

    x: torch.Tensor  # [L] token row: prompt + appended blocks
    blocks: list
    is_base: bool
    rank: int
    creation_conf: float = 1.0
    eos_detected: bool = False
    lookahead: int | None = None  # absolute position of the lookahead token (None for the anchor)

    def copy(self) -> "Branch":
        return Branch(self.x.clone(), copy_blocks(self.blocks), self.is_base, self.rank, self.creation_conf,
                      self.eos_detected, self.lookahead)


def shared_prefix_end(branches: list[Branch], P: int) -> int:
    """End of the shortest leading run of (to_cache | in_cache) blocks with no masks, over all branches;
    the prompt length when some branch has none (upstream `find_shared_prefix_end`)."""
    runs = []
    for br in branches:
        n = 0
        for blk in br.blocks:
            if blk["state"] in ("in_cache", "to_cache") and blk["mask_count"] == 0:
                n += 1
            else:
                break
        runs.append(n)
    m = min(runs)
    return P if m == 0 else branches[0].blocks[m - 1]["end"]


def branch_score(br: Branch, logits: torch.Tensor, start: int, spe: int, cfg, generator=None, round_: int = 0) -> float:
    """alpha * creation_conf + (1 - alpha) * future, future = mean of the lowest max(1, int(n*branch_topp))
    confidences over ALL the branch's masked positions >= spe (1.0 with none; the value itself with one).
    A branch with no positions past spe scores 1.0 outright (upstream)."""
    if br.x.numel() - spe <= 0:
        return 1.0
    pos = (br.x[spe:] == cfg.mask_token_id).nonzero(as_tuple=True)[0] + spe
    if pos.numel() == 0:
        future = 1.0
    else:
        check_finite(logits[pos - start], pos, cfg, round_)
        conf, _, _ = token_stats(logits[pos - start], **stats_kw(cfg, generator, round_, pos))
        n = conf.numel()
        if n == 1:
            future = conf.item()
        else:
            cnt = max(1, int(n * cfg.branch_topp))
            future = torch.sort(conf, descending=False).values[:cnt].mean().item()
    alpha = float(max(0.0, min(1.0, cfg.selection_conf_alpha)))
    return alpha * float(br.creation_conf) + (1.0 - alpha) * future


def spawn_lookaheads(
    w: Branch, logits: torch.Tensor, start: int, spe: int, acts: list[int], fills: dict, cfg, generator=None,
    round_: int = 0,
) -> list[Branch]:
    """Top-k lookaheads of the filled winner w: its masked positions inside its active blocks (block, then
    position order), ranked by confidence from the winner's logits (descending, stable: the earlier
    position wins ties); each copy fills exactly one of them with the predicted token."""
    L = w.x.numel()
    if L - spe <= 0:
        return []
    cand = []
    for b in acts:
        blk = w.blocks[b]
        masked = (w.x[blk["start"] : blk["end"]] == cfg.mask_token_id).nonzero(as_tuple=True)[0] + blk["start"]
        for q in masked.tolist():
            if q not in fills and q >= spe and q - spe < L - spe:
                cand.append(q)
    if not cand:
        return []
    idx = torch.tensor(cand, device=logits.device) - start
    check_finite(logits[idx], idx + start, cfg, round_)
    conf, x0, _ = token_stats(logits[idx], **stats_kw(cfg, generator, round_, idx + start))
    ranked = sorted(zip(conf.tolist(), range(len(cand))), key=lambda t: t[0], reverse=True)
    out = []
    for r, (c, i) in enumerate(ranked[: cfg.branching_factor]):
        q = cand[i]
        tok, creation = int(x0[i]), c
        if cfg.temperature > 0:  # upstream samples the chosen position a second time (quirk 7)
            # (keyed sampler: the same key, so the same draw as the ranking's)
            q_pos = torch.tensor([q], device=logits.device)
            c2, t2, _ = token_stats(logits[q - start][None], **stats_kw(cfg, generator, round_, q_pos))
            tok, creation = int(t2[0]), float(c2[0])
        nb = w.copy()
        nb.is_base, nb.rank, nb.lookahead, nb.creation_conf = False, r, q, creation
        nb.x[q] = tok
        if cfg.eos_token_id is not None and tok == cfg.eos_token_id:
            nb.eos_detected = True
        out.append(nb)
    return out


def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """LoPA decoding. prompt: LongTensor [P] on model.device; cfg: bound GenerateConfig; on_round: the
    progress hook (lopa_fast.output.progress.report_round), called after every round with the winner (the accepted
    sequence, the next round's anchor)."""
    P = prompt.numel()
    mask_id = cfg.mask_token_id
    gen = request_noise(cfg, prompt.device)
    cache = model.new_cache(P + cfg.max_new_tokens)
    candidates = [Branch(prompt.clone(), [new_block(0, P, prompt=True)], is_base=True, rank=0)]
    last_logit = None
    stats = {
        "forwards": 0, "model_calls": 0, "multi_token_rounds": 0, "lookahead_wins": 0, "branch_growth": 0,
        "winner_grew": 0, "max_branches": 0, "upstream_model_calls": 0, **fill_stats(),
    }
    # upstream forwards the anchor twice in a round that follows a spawn with no lookahead when
    # branching_factor > 1 (it appends the winner itself and its anchor copy); tokens are unaffected, we
    # forward it once and only count upstream's number in stats["upstream_model_calls"]
    upstream_duplicate = False
    trace = [] if cfg.return_trace else None
    result = candidates[0]
    with Clock(prompt.device) as clock:
        while True:
            if cfg.stop:  # a stop sequence in the anchor's finalised prefix: the output ends before it
                base = next(b for b in candidates if b.is_base)
                if first_stop(base.x[P:].tolist(), cfg.stop, mask_id) is not None:
                    result = base
                    stats["stopped"] = True
                    break
            # 1-3: grow, activation, termination, per branch with the branch's own counts
            active, finished = [], []
            for br in candidates:
                br.x = maybe_grow(br.x, br.blocks, cfg, br.eos_detected)
                update_activation(br.blocks, cfg)
                (finished if is_done(br.x, br.blocks, mask_id) else active).append(br)
            if not active:
                result = finished[0]
                break
            result = next((b for b in active if b.is_base), active[0])
            if stats["forwards"] >= cfg.max_rounds:
                round_cap_hit(cfg, stats, "lopa")
                break
            spe = shared_prefix_end(active, P)
            layout = result
            to_cache = [b for b, blk in enumerate(layout.blocks) if blk["state"] == "to_cache" and blk["end"] <= spe]
            if to_cache:
                start = min(layout.blocks[b]["start"] for b in to_cache)
                u = max(layout.blocks[b]["end"] for b in to_cache) - start
            else:
                start, u = spe, 0
            assert start == cache.length, (start, cache.length)
            order = sorted(active, key=lambda b: (b.is_base, b.rank))
            anchor_len = layout.x.numel()
            if any(b.x.numel() != anchor_len for b in order):
                stats["branch_growth"] += 1
            stats["max_branches"] = max(stats["max_branches"], len(order))

            # 4: one forward per branch over the shared cache (upstream: batch=1 each, on a cache copy)
            results = []
            for br in order:
                raw = forward_branch(model, cache, br.x, start, P, cfg)
                span = cache.window_span(0, u) if u > 0 else None
                ll = raw[u - 1].clone() if u > 0 else last_logit
                results.append((br, predictions(model, raw, ll), span, ll))
            stats["forwards"] += 1
            stats["model_calls"] += len(order)
            stats["upstream_model_calls"] += len(order) + int(upstream_duplicate)

            # scores and the winner (first maximum in round order)
            scores = [branch_score(br, lg, start, spe, cfg, gen, stats["forwards"]) for br, lg, _, _ in results]
            wi = max(range(len(scores)), key=lambda i: (scores[i], -i))
            w, wlogits, wspan, wll = results[wi]
            if u > 0:
                cache.append(*wspan)
                last_logit = wll
            if not w.is_base:
                stats["lookahead_wins"] += 1
            if w.x.numel() != anchor_len:
                stats["winner_grew"] += 1

            # 5: anchor fill on the winner with its own block states and logits
            acts = active_ids(w.blocks)
            fills, eos = anchor_fill(w.x, w.blocks, wlogits, start, spe, cfg, stats, gen)
            w.eos_detected = w.eos_detected or eos
            accepted = len(fills) + (0 if w.is_base else 1)
            if accepted >= 2:
                stats["multi_token_rounds"] += 1
            completed = retire_blocks(w.x, w.blocks, acts, mask_id)

            # spawn: lookaheads (ranked) then the new anchor, which sorts last
            new = (spawn_lookaheads(w, wlogits, start, spe, acts, fills, cfg, gen, stats["forwards"])
                   if cfg.branching_factor > 1 else [])
            upstream_duplicate = cfg.branching_factor > 1 and not new
            anchor = w.copy()
            anchor.is_base, anchor.rank, anchor.creation_conf, anchor.lookahead = True, len(new), 1.0, None
            new.append(anchor)
            for nb in new:
                if u > 0:
                    for b in to_cache:
                        nb.blocks[b]["state"] = "in_cache"
                nacts = active_ids(nb.blocks)
                retire_blocks(nb.x, nb.blocks, nacts, mask_id)
                mark_to_cache(nb.blocks, nacts, completed)
            if trace is not None:
                acc = sorted([q - P, t] for q, t in fills.items())
                if not w.is_base:
                    acc = sorted(acc + [[w.lookahead - P, int(w.x[w.lookahead])]])
                trace.append(
                    {
                        "round": stats["forwards"],
                        "window_start": start - P,
                        "cached": u,
                        "branches": [
                            {
                                "lookahead": None if br.lookahead is None else br.lookahead - P,
                                "score": s,
                                "window_len": br.x.numel() - start,
                            }
                            for (br, _, _, _), s in zip(results, scores)
                        ],
                        "winner": wi,
                        "accepted": acc,
                    }
                )
            candidates = new
            if on_round is not None:
                report_round(on_round, w.x[P:], mask_id, cfg.max_new_tokens, stats["forwards"])
    ids = result.x[P:].tolist()
    stats["eos_detected"] = bool(result.eos_detected)
    stats["cache_length"] = cache.length
    stats["cached_blocks"] = sum(1 for blk in result.blocks[1:] if blk["state"] == "in_cache")
    finalize_stats(stats, ids, cfg.eos_token_id, mask_id, clock.seconds, steps_plus_one=True)
    return GenerateOutput(ids, stats, trace)
