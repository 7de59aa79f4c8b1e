"""Reference D2F pipelined block decoding (docs/semantics.md section 2), single branch.

Mirrors upstream LoPA's `_generate_original_single_branch` (the D2F-on-Dream decoder): one forward per
step over [to_cache span ; every later position], full attention (`use_full_attention=True`, upstream's
default) or D2F's block-causal mask. The block table and the fill rule defined here are shared with the
LoPA reference (lopa.py), whose branching_factor=1 reduces to exactly this loop (a test checks it).

Block table: a list indexed by block id. Block 0 is the prompt {start 0, end P, total P, mask_count 0,
state "to_cache", is_complete True}; generated blocks are appended as {state "active", is_complete False,
mask_count = total = block_size}. States: active -> to_cache (no masks left and no lower block active)
-> in_cache (its K/V was written by the next forward; never refreshed).
"""
from __future__ import annotations

import torch

from lopa_fast.output.progress import first_stop, report_round
from lopa_fast.output import GenerateOutput, finalize_stats
from lopa_fast.keyed import TOKEN
from lopa_fast.reference.common import (Clock, check_finite, draw_kw, request_noise, round_cap_hit, shift_logits,
                                        token_stats)


# ---- block table --------------------------------------------------------------------------------
def new_block(start: int, size: int, *, prompt: bool = False) -> dict:
    if prompt:
        return {"start": 0, "end": size, "total": size, "mask_count": 0, "state": "to_cache", "is_complete": True}
    return {"start": start, "end": start + size, "total": size, "mask_count": size, "state": "active",
            "is_complete": False}


def copy_blocks(blocks: list[dict]) -> list[dict]:
    return [dict(b) for b in blocks]


def maybe_grow(x: torch.Tensor, blocks: list[dict], cfg, eos_detected: bool) -> torch.Tensor:
    """Step 1: append block_size masks as a new active block when the last block's decoded fraction
    (from its recorded mask_count) is >= block_add_threshold, while fewer than max_new_tokens // block_size
    blocks exist and no EOS was decoded. Returns the (possibly longer) token row x [L]."""
    if len(blocks) - 1 < cfg.max_new_tokens // cfg.block_size and not eos_detected:
        last = blocks[-1]
        progress = (last["total"] - last["mask_count"]) / last["total"] if last["total"] > 0 else 1.0
        if progress >= cfg.block_add_threshold:
            blocks.append(new_block(x.numel(), cfg.block_size))
            x = torch.cat([x, x.new_full((cfg.block_size,), cfg.mask_token_id)])
    return x


def update_activation(blocks: list[dict], cfg) -> None:
    """Step 2: block b+1 becomes fully activated (is_complete, sticky) once block b's decoded fraction is
    >= decoded_token_threshold."""
    for b, blk in enumerate(blocks):
        if blk["total"] > 0 and (blk["total"] - blk["mask_count"]) / blk["total"] >= cfg.decoded_token_threshold:
            if b + 1 < len(blocks):
                blocks[b + 1]["is_complete"] = True


def is_done(x: torch.Tensor, blocks: list[dict], mask_id: int) -> bool:
    """Step 3: no mask left anywhere and no active block."""
    return not bool((x == mask_id).any()) and all(b["state"] != "active" for b in blocks)


def active_ids(blocks: list[dict]) -> list[int]:
    return [b for b, blk in enumerate(blocks) if blk["state"] == "active"]


def window_block_ids(P: int, block_size: int, start: int, n: int, device) -> torch.Tensor:
    """Block index of absolute positions [start, start+n): 0 for the prompt, 1 + (p-P)//block_size after."""
    p = torch.arange(start, start + n, device=device)
    return torch.where(p < P, torch.zeros_like(p), 1 + (p - P).div(block_size, rounding_mode="floor"))


def forward_branch(model, cache, x: torch.Tensor, start: int, P: int, cfg) -> torch.Tensor:
    """One window forward of tokens x[start:] over cache[:start]; returns raw logits [n, V]."""
    tokens = x[start:][None]
    if cfg.use_full_attention:
        return model.forward_window(tokens, cache=cache, start=start, mask="full")[0]
    bids = window_block_ids(P, cfg.block_size, start, tokens.shape[1], x.device)[None]
    return model.forward_window(tokens, cache=cache, start=start, mask="block_causal", block_ids=bids)[0]


def predictions(model, raw: torch.Tensor, last_logit: torch.Tensor | None) -> torch.Tensor:
    """Logits [n, V] whose row i predicts window position i (Dream: shifted with the stale last_logit)."""
    return shift_logits(raw, last_logit) if model.logits_shift else raw


def stats_kw(cfg, generator, step: int = 0, pos=None) -> dict:
    """token_stats keywords of a D2F/LoPA run: the sampling knobs, the confidence and the mask suppression.
    generator: the request's noise (reference.common.request_noise); with the keyed sampler the draw of a row
    predicting absolute position q in round `step` is keyed by (step, q) only, the same for every branch
    (common random numbers: the fast round's Dream-shift row is shared by all branches, so a branch-free key
    is what both backends can draw identically; docs/decoding.md "Sampling")."""
    return dict(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        sampling_strategy=cfg.sampling_strategy,
        suppress_token=cfg.mask_token_id if cfg.suppress_mask_token else None,
        **draw_kw(generator, cfg, TOKEN, step, 0, pos),
    )


def fill_stats() -> dict:
    """The anchor-fill counters every D2F/LoPA run reports (zeroed)."""
    return {"accepted_by_threshold": 0, "fallback_fills": 0, "eos_fills": 0}


def anchor_fill(
    x: torch.Tensor,
    blocks: list[dict],
    logits: torch.Tensor,
    start: int,
    lo: int,
    cfg,
    counters: dict,
    generator=None,
) -> tuple[dict, bool]:
    """Step 5, the D2F fill rule, for every active block in id order, from one forward's logits.

    logits [n, V] predict window positions start..start+n-1. Only masked positions >= lo are considered
    (lo = the shared-prefix end in LoPA; the window start in D2F). Accept position i if p(i) >
    skip_threshold (strict); if none and the block is fully activated, fill the single most confident
    position (torch.topk(conf, 1)). All blocks read the same snapshot of x; fills are applied at the end.
    Returns ({abs position: token}, eos_filled).
    """
    fills: dict[int, int] = {}
    eos = False
    L = x.numel()
    for b in active_ids(blocks):
        blk = blocks[b]
        pos = (x[blk["start"] : blk["end"]] == cfg.mask_token_id).nonzero(as_tuple=True)[0] + blk["start"]
        pos = pos[(pos >= lo) & (pos < L)]
        if pos.numel() == 0:
            continue
        check_finite(logits[pos - start], pos, cfg, counters.get("forwards", 0))
        conf, x0, p = token_stats(logits[pos - start], **stats_kw(cfg, generator, counters.get("forwards", 0), pos))
        hi = (p > cfg.skip_threshold).nonzero(as_tuple=True)[0]
        if hi.numel() > 0:
            chosen = hi
            counters["accepted_by_threshold"] += int(hi.numel())
        elif blk["is_complete"]:
            chosen = torch.topk(conf, 1).indices
            counters["fallback_fills"] += 1
        else:
            continue
        for i in chosen.tolist():
            tok = int(x0[i])
            fills[int(pos[i])] = tok
            if cfg.eos_token_id is not None and tok == cfg.eos_token_id:
                eos = True
                counters["eos_fills"] += 1
    for q, tok in fills.items():
        x[q] = tok
    return fills, eos


def retire_blocks(x: torch.Tensor, blocks: list[dict], ids: list[int], mask_id: int) -> list[int]:
    """Step 6: recount masks of blocks `ids`; a block with no masks whose lower blocks are all non-active
    becomes to_cache (in id order, so a chain of finished blocks retires together). Returns the ids whose
    mask count is 0 (LoPA's `base_completed_blocks`)."""
    done = []
    for b in ids:
        blk = blocks[b]
        blk["mask_count"] = int((x[blk["start"] : blk["end"]] == mask_id).sum())
        if blk["mask_count"] == 0:
            done.append(b)
    return done


def mark_to_cache(blocks: list[dict], ids: list[int], completed: list[int]) -> None:
    for b in ids:
        if b in completed and blocks[b]["mask_count"] == 0 and blocks[b]["state"] == "active":
            if all(blocks[q]["state"] != "active" for q in range(b)):
                blocks[b]["state"] = "to_cache"


# ---- the loop -----------------------------------------------------------------------------------
def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """D2F single-branch decoding. prompt: LongTensor [P] on model.device; cfg: bound GenerateConfig;
    on_round: the progress hook (lopa_fast.output.progress.report_round), called after every round."""
    P = prompt.numel()
    mask_id = cfg.mask_token_id
    gen = request_noise(cfg, prompt.device)
    cache = model.new_cache(P + cfg.max_new_tokens)
    x = prompt.clone()
    blocks = [new_block(0, P, prompt=True)]
    last_logit = None
    eos_detected = False
    stats = {"forwards": 0, "model_calls": 0, "multi_token_rounds": 0, **fill_stats()}
    trace = [] if cfg.return_trace else None
    with Clock(prompt.device) as clock:
        while True:
            if cfg.stop and first_stop(x[P:].tolist(), cfg.stop, mask_id) is not None:
                stats["stopped"] = True  # a stop sequence in the finalised prefix: the output ends before it
                break
            x = maybe_grow(x, blocks, cfg, eos_detected)
            update_activation(blocks, cfg)
            if is_done(x, blocks, mask_id):
                break
            if stats["forwards"] >= cfg.max_rounds:
                round_cap_hit(cfg, stats, "d2f")
                break
            to_cache = [b for b, blk in enumerate(blocks) if blk["state"] == "to_cache"]
            acts = active_ids(blocks)
            if to_cache:
                start = min(blocks[b]["start"] for b in to_cache)
                u = max(blocks[b]["end"] for b in to_cache) - start
            elif acts:
                start, u = min(blocks[b]["start"] for b in acts), 0
            else:  # masks left outside every block: unreachable (upstream loops here without a forward)
                break
            assert start == cache.length, (start, cache.length)
            raw = forward_branch(model, cache, x, start, P, cfg)
            stats["forwards"] += 1
            stats["model_calls"] += 1
            if u > 0:
                cache.commit_window(0, u)
                last_logit = raw[u - 1].clone()
                for b in to_cache:
                    blocks[b]["state"] = "in_cache"
            logits = predictions(model, raw, last_logit)
            fills, eos = anchor_fill(x, blocks, logits, start, start, cfg, stats, gen)
            eos_detected = eos_detected or eos
            if len(fills) >= 2:
                stats["multi_token_rounds"] += 1
            completed = retire_blocks(x, blocks, acts, mask_id)
            mark_to_cache(blocks, acts, completed)
            if trace is not None:
                trace.append(
                    {
                        "round": stats["forwards"],
                        "window_start": start - P,
                        "window_len": x.numel() - start,
                        "cached": u,
                        "branches": [{"lookahead": None, "score": None, "window_len": x.numel() - start}],
                        "winner": 0,
                        "accepted": sorted([q - P, t] for q, t in fills.items()),
                    }
                )
            if on_round is not None:
                report_round(on_round, x[P:], mask_id, cfg.max_new_tokens, stats["forwards"])
    ids = x[P:].tolist()
    stats["eos_detected"] = eos_detected
    stats["cache_length"] = cache.length
    stats["cached_blocks"] = sum(1 for blk in blocks[1:] if blk["state"] == "in_cache")
    finalize_stats(stats, ids, cfg.eos_token_id, mask_id, clock.seconds, steps_plus_one=True)
    return GenerateOutput(ids, stats, trace)
