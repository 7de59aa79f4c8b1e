"""Types and tables shared by the decoders (reference and fast), the public ops and the kernels.

A neutral module: `lopa_fast.decode`, `lopa_fast.ops` and `kernels/` import these from here, never from
`lopa_fast.reference` (the reference decoders are the oracle the fast path is tested against).
"""
from __future__ import annotations

from collections import namedtuple

import torch

# window-attention modes of `branch_attention` (the prefix is always fully visible)
ATTENTION_MODES = ("full", "block_causal", "causal")
# threshold comparators of `select_round`: "gt" v > tau (D2F), "ge" v >= tau (Fast-dLLM), "le" v <= tau (dParallel)
COMPARATORS = ("gt", "ge", "le")

Confidence = namedtuple("Confidence", ["token", "p_max", "margin", "neg_entropy", "lse"])
RoundSelection = namedtuple("RoundSelection", ["accept", "lookahead", "score", "winner"])


def lowest_k_table(n: int, topp: float) -> torch.Tensor:
    """k(c) = max(1, floor(c * topp)) for c = 0..n as int32 [n + 1], computed in Python float64 exactly as
    upstream's `int(len(confs) * branch_topp)`; kernels read this table instead of redoing float maths."""
    return torch.tensor([max(1, int(c * topp)) for c in range(n + 1)], dtype=torch.int32)
