"""Whether a request's forwards end in the fused LM head + token statistics (`ops.head_confidence`: the [R, V] logits
of a round / step are never materialised), for every fast path that can take it: the D2F / LoPA round
(strategies/lopa, its distributed round included), the Dream-family vanilla and threshold steps (strategies/steps.py
says which of their knobs) and APD's two forwards (strategies/apd/step.py: the draft's arg-max, the finiteness and
the kept logits the mixture reads).

$LOPA_FAST_FUSED_HEAD: unset / "auto" = on CUDA only (the fused statistics are ~1e-6 from the reference softmax, like
`ops.confidence`'s: the CPU path stays bitwise the reference decoders'); "1" = also on CPU (the chunked torch
backend: tokens equal to the reference on the tiny-model grids, tests/test_head_confidence_decode.py; not bitwise in
the statistics: docs/fast_decoder.md, the fused head's exactness policy); "0" = never."""
from __future__ import annotations

import torch

from lopa_fast.ops._backend import env_value

FUSED_HEAD_ENV = "LOPA_FAST_FUSED_HEAD"


def fused_head_wanted(cfg, device) -> bool:
    """The environment's choice for a request whose knobs allow the fused head at all: T = 0 (the keyed sampler at
    T > 0 needs whole rows), no top-p / top-k (a distributed round takes it too: each rank's message carries the
    fused statistics of its rows, lopa_fast.strategies.lopa.distributed). A ValueError naming the variable for a
    value other than auto / 0 / 1."""
    value = env_value(FUSED_HEAD_ENV) or "auto"  # (no KeyError when unset: ops._backend.env_value)
    if value not in ("auto", "0", "1"):
        raise ValueError(f"environment variable {FUSED_HEAD_ENV}={value!r}; allowed: auto, 0, 1 (or unset)")
    if value == "0" or cfg.temperature > 0 or cfg.top_p is not None or cfg.top_k is not None:
        return False
    return value == "1" or torch.device(device).type == "cuda"
