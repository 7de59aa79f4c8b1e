"""D2F / LoPA's knobs (docs/semantics.md sections 2-3): the fields this folder adds to GenerateConfig (the registry
composes every strategy's knob dataclass into it; lopa_fast.config). Both strategies read them; each has a default,
so their values are checked for every request (spec.py's check_values)."""
from __future__ import annotations

from dataclasses import dataclass

from lopa_fast.request.knobs import SAMPLING_STRATEGIES, knob


@dataclass(frozen=True)
class LopaKnobs:
    block_add_threshold: float = knob(0.1, "tau_add (d2f / lopa): append a new block once the last block's decoded "
                                           "fraction is >= it")
    decoded_token_threshold: float = knob(0.95, "tau_act (d2f / lopa): once a block's decoded fraction is >= it, the "
                                                "next block is fully activated")
    skip_threshold: float = knob(0.9, "tau_conf (d2f / lopa): a masked position is filled when its max probability "
                                      "is > it")
    sampling_strategy: str = knob("neg_entropy", "confidence of the fallback fill, the lookahead ranking and the "
                                                 "branch score (d2f / lopa)", choices=SAMPLING_STRATEGIES)
    branching_factor: int = knob(4, "LoPA's k: lookahead branches per round; a round verifies k + 1 sequences "
                                    "(1 = D2F)")
    branch_topp: float = knob(1.0, "LoPA branch score: the mean of the lowest max(1, int(n * branch_topp)) "
                                   "confidences over its n masks")
    selection_conf_alpha: float = knob(0.0, "LoPA branch score: alpha * creation confidence + (1 - alpha) * that mean")
    use_full_attention: bool = knob(True, "d2f / lopa: full attention over [cache ; window] (upstream LoPA); off: "
                                          "D2F's block-causal mask")
