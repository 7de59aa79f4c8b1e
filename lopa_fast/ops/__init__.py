"""Public ops: docstring + input checks + dispatch (cuda | triton | torch).

The `torch` backend is what the CPU fast path runs; kernels are picked on CUDA tensors when they load
(see lopa_fast.ops._backend); every op takes `backend=` to force one.
"""
from lopa_fast.ops.branch_attention import branch_attention
from lopa_fast.ops.confidence import confidence
from lopa_fast.ops.select_round import select_round
from lopa_fast.contracts import Confidence, RoundSelection

__all__ = ["branch_attention", "confidence", "select_round", "Confidence", "RoundSelection"]
