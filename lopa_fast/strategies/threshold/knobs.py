"""Threshold's knobs (Fast-dLLM, dParallel): the fields this folder adds to GenerateConfig (the registry composes
every strategy's knob dataclass into it; lopa_fast.config). It also reads vanilla's steps / block_length."""
from __future__ import annotations

from dataclasses import dataclass

from lopa_fast.request.knobs import knob

CACHE_MODES = (None, "prefix", "dual")


@dataclass(frozen=True)
class ThresholdKnobs:
    threshold: float | None = knob(None, "threshold: commit masks with p(x0) >= it (Fast-dLLM); give at most one of "
                                         "threshold / factor / entropy_threshold",
                                   unset="0.9 (Fast-dLLM's default) when neither factor nor entropy_threshold is given")
    factor: float | None = knob(None, "threshold: Fast-dLLM's factor rule, commit the longest prefix with c(k) >= "
                                      "1 - factor / (k + 1)", unset="none")
    entropy_threshold: float | None = knob(None, "threshold: commit masks whose entropy is <= it, in nats "
                                                 "(dParallel)", unset="none")
    cache: str | None = knob(None, "threshold: Fast-dLLM's KV cache", choices=CACHE_MODES, unset="no cache")
    count_noop_forward: bool | None = knob(None, "threshold: run and count the cached forward after a refresh that "
                                                 "filled the block (upstream's loop)", unset="off")
