"""APD's knobs (docs/decoding.md "APD"; the quirk fixes: None or False is upstream): the fields this folder adds to
GenerateConfig (the registry composes every strategy's knob dataclass into it; lopa_fast.config)."""
from __future__ import annotations

from dataclasses import dataclass

from lopa_fast.request.knobs import knob


@dataclass(frozen=True)
class ApdKnobs:
    apd_mixture_weight: float | None = knob(None, "apd: R, the dLLM's weight in the target R * l_D + (1 - R) * l_AR "
                                                  "(needs verifier=)", unset="the verifier-free leftright baseline")
    kv_window: int | None = knob(None, "apd: W, committed positions recomputed each step (the dLLM's KV cache)",
                                 unset="no cache")
    max_lookahead: int | None = knob(None, "apd: M, masked positions the dLLM sees past the decoding position",
                                     unset="the whole canvas")
    tokens_per_step: int | None = knob(None, "apd leftright baseline: K, tokens committed per step", unset="1")
    single_temperature: bool | None = knob(None, "apd: fix of quirk Q1 (draft from softmax(l / T), not at T^2)",
                                           unset="off (upstream)")
    coupled_gumbel: bool | None = knob(None, "apd: fix of quirk Q2 (the target reuses the draft's Gumbel noise at "
                                             "T > 0)", unset="off (upstream)")
    exact_prev_logits: bool | None = knob(None, "apd: fix of quirk Q3 (after an all-accepted step, the next step's "
                                                "first AR logit predicts right)", unset="off (upstream)")
