"""Types and tables shared by the decoders (reference and fast), the public ops and the kernels.

A neutral module: `lopa_fast.decode`, `lopa_fast.ops` and `kernels/` import these from here, never from
`lopa_fast.reference` (the reference decoders are the oracle the fast path is tested against).
"""
from __future__ import annotations

import functools
from collections import namedtuple

import torch

# window-attention modes of `branch_attention` (the prefix is always fully visible)
ATTENTION_MODES = ("full", "block_causal", "causal")

# The integer codes kernels receive for a mode: its index above. Triton kernels compare with
# these; CUDA (.cu) sources get them as -D defines (`code_defines`), never as literals.
MODE_CODES = {m: i for i, m in enumerate(ATTENTION_MODES)}


# The D2F / LoPA round's counters (lopa_fast/decode/round.py: one 0-d device tensor each in the round state, read
# once at the end of a request into the stats).
ROUND_COUNTERS = ("thresh", "fallback", "eos_fills", "multi", "look_wins", "growth_split", "winner_grew",
                  "max_branches")  # fmt: skip


def code_defines() -> dict[str, int]:
    """{"LOPA_MODE_FULL": 0, ...}: the codes as C preprocessor defines."""
    return {f"LOPA_MODE_{m.upper()}": c for m, c in MODE_CODES.items()}


Confidence = namedtuple("Confidence", ["token", "p_max", "margin", "neg_entropy", "lse"])
# ops.head_confidence: Confidence's fields of the logits rows hidden @ weight.T (never materialised) plus
# finite [R] bool: every raw logit of the row is finite (the round's numerics guard; a False row's statistics
# are meaningless and must not be decoded). neg_entropy is None when the op was asked for no entropy pass.
HeadConfidence = namedtuple("HeadConfidence", ["token", "p_max", "margin", "neg_entropy", "lse", "finite"])


def lowest_k_table(n: int, topp: float, device=None) -> torch.Tensor:
    """k(c) = max(1, floor(c * topp)) for c = 0..n as int32 [n + 1], computed in Python float64 exactly as
    upstream's `int(len(confs) * branch_topp)`; kernels read this table instead of redoing float maths.
    With a `device`, the table is cached per (n, topp, device): no host-to-device copy per round once warm."""
    if device is None:
        return torch.tensor([max(1, int(c * topp)) for c in range(n + 1)], dtype=torch.int32)
    return _device_table(n, float(topp), str(device))


@functools.lru_cache(maxsize=64)
def _device_table(n: int, topp: float, device: str) -> torch.Tensor:
    return lowest_k_table(n, topp).to(device)


def window_key_mask(
    n: int,
    win_lens: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    mode: str,
    batch: int,
    device,
) -> torch.Tensor:
    """Visibility of window keys: bool [B, n_query, n_key] (True = visible).

    Query (b, i) sees window key j iff j < win_lens[b] and
      full:          always
      block_causal:  block_ids[b, j] <= block_ids[b, i]
      causal:        j <= i
    Built from block ids and lengths; the prefix (cache) part is always fully visible.
    """
    j = torch.arange(n, device=device)
    if win_lens is None:
        valid = torch.ones(batch, n, dtype=torch.bool, device=device)
    else:
        valid = j[None, :] < win_lens.to(device).reshape(batch, 1)
    vis = valid[:, None, :].expand(batch, n, n)
    if mode == "causal":
        vis = vis & (j[None, :, None] >= j[None, None, :])
    elif mode == "block_causal":
        vis = vis & (block_ids[:, None, :] <= block_ids[:, :, None])
    return vis


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


def stop_reached(generated, cfg) -> bool:
    """Whether a stop sequence of `cfg.stop` lies in the finalised prefix of `generated` (the generated
    positions, LongTensor [G] or list[int], masks included); False when cfg.stop is None.

    The per-step stop check of the host-driven loops (vanilla, threshold, apd): one host read of the row per
    step, only when stop sequences are given. Device-driven loops check on the device instead
    (decode/round.py `_stop_in_prefix`) and read the flag with their step's one host read."""
    if not cfg.stop:
        return False
    ids = generated.tolist() if isinstance(generated, torch.Tensor) else list(generated)
    return first_stop(ids, cfg.stop, cfg.mask_token_id) is not None


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
    the row when either is asked for, none otherwise."""
    if on_round is None and not cfg.stop:
        return False
    ids = generated.tolist() if isinstance(generated, torch.Tensor) else list(generated)
    if on_round is not None:
        report_round(on_round, ids, cfg.mask_token_id, cfg.max_new_tokens, stats["forwards"])
    if stop_reached(ids, cfg):
        stats["stopped"] = True
        return True
    return False
