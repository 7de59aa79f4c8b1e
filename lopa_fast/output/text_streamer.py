"""Driving a TextStreamer-style `streamer=` (transformers' protocol: put(ids), end()) from a request's per-round
progress hook: the prompt first, then the new tokens as they become final (cut at the requested length and before
a stop sequence, so the puts join to the returned generated_ids), then end()."""
from __future__ import annotations

import torch

from lopa_fast.config import GenerateConfig
from lopa_fast.output.progress import first_stop
from lopa_fast.output import GenerateOutput


def check_streamer(streamer) -> None:
    """streamer= is None or has transformers' TextStreamer protocol (put(ids), end()), else a TypeError."""
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise TypeError(f"streamer: {type(streamer).__name__}; expected an object with put(ids) and end() "
                        "(transformers' TextStreamer protocol)")


def streamer_hook(streamer, ids: torch.Tensor, cfg: GenerateConfig, requested: int, on_round=None):
    """(per-round hook, finish(out)) driving a TextStreamer-style `streamer` (generate_with_config's docstring). A
    round puts the finalised prefix's new tokens, up to the requested length, before a stop sequence and holding
    back the last (longest stop - 1) tokens (a stop they start is not complete yet); finish puts the rest of the
    returned ids and calls end()."""
    streamer.put(ids.detach().reshape(1, -1).cpu())
    hold = max((len(q) for q in cfg.stop or ()), default=1) - 1
    sent = 0

    def put(new: list[int]) -> None:
        nonlocal sent
        if new:
            streamer.put(torch.tensor(new, dtype=torch.long))
            sent += len(new)

    def hook(prefix, info):
        if on_round is not None:
            on_round(prefix, info)
        upto = min(len(prefix) - hold, requested)
        if cfg.stop:
            at = first_stop(list(prefix), cfg.stop, cfg.mask_token_id)
            upto = upto if at is None else min(upto, at)
        if upto > sent:
            put(list(prefix[sent:upto]))

    def finish(out: GenerateOutput) -> None:
        put(list(out.generated_ids[sent:]))
        streamer.end()

    return hook, finish
