"""What every decoding loop (reference and fast) does when a step or round ends: the progress hook and the stop check.

A neutral module (torch only): `first_stop` also cuts a finished output (lopa_fast.api, lopa_fast.stream).
"""
from __future__ import annotations

import torch


def first_stop(ids: list[int], stops, mask_token_id: int | None = None) -> int | None:
    """Where a stop sequence first starts in the finalised prefix of `ids` (the tokens before the first
    mask), or None. The earliest start over all sequences wins (ties: any; the cut is the same)."""
    if not stops:
        return None
    end = ids.index(mask_token_id) if mask_token_id is not None and mask_token_id in ids else len(ids)
    best = None
    for q in stops:
        q = list(q)
        for i in range(0, end - len(q) + 1):
            if ids[i : i + len(q)] == q:
                best = i if best is None else min(best, i)
                break
    return best


def report_round(on_round, canvas, mask_id: int, total: int, forwards: int) -> None:
    """Call a progress hook `on_round(prefix, info)` after a round / step (lopa_fast.generate's `on_round=`).

    canvas: the accepted sequence's generated positions (LongTensor [n] or list[int], n <= total; d2f / lopa
    hold only the blocks appended so far), padded here with the mask id to `total` (the decoded length).
    prefix: canvas[: first mask], the tokens that no later round changes. info: {"round": the number of
    rounds so far (1-based; one verification forward each, so equal to "forwards"), "forwards", "canvas":
    list[int] [total] with mask_id where not yet decoded, "mask_token_id"}. An exception raised by the hook
    ends decoding and propagates out of generate (lopa_fast.stream uses that to stop early)."""
    ids = canvas.tolist() if isinstance(canvas, torch.Tensor) else list(canvas)
    ids += [mask_id] * (total - len(ids))
    end = ids.index(mask_id) if mask_id in ids else len(ids)
    on_round(ids[:end], {"round": forwards, "forwards": forwards, "canvas": ids, "mask_token_id": mask_id})


def after_step(generated, cfg, stats: dict, on_round=None) -> bool:
    """End of one step of a host-driven loop (vanilla, threshold, apd): the progress hook, when given, and the
    stop check, when cfg.stop is set. generated: the generated positions (LongTensor [max_new_tokens] or list,
    masks included); stats["forwards"] counts the step. Returns True (and sets stats["stopped"]) when a stop
    sequence lies in the finalised prefix: the loop ends, the API cuts the output before it. One host read of
    the row when either is asked for, none otherwise (device-driven loops check on the device instead,
    decode/shapes.py `stop_in_prefix`, and read the flag with their round's one host read)."""
    if on_round is None and not cfg.stop:
        return False
    ids = generated.tolist() if isinstance(generated, torch.Tensor) else list(generated)
    if on_round is not None:
        report_round(on_round, ids, cfg.mask_token_id, cfg.max_new_tokens, stats["forwards"])
    if cfg.stop and first_stop(ids, cfg.stop, cfg.mask_token_id) is not None:
        stats["stopped"] = True
        return True
    return False
