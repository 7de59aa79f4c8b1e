"""Public ops: docstring + input checks + dispatch (cuda | triton | torch).

The `torch` backend is what the CPU fast path runs; kernels are picked on GPU when they load.
"""
from lopa_fast.ops.branch_attention import branch_attention

__all__ = ["branch_attention"]
