"""Public ops: docstring + input checks + dispatch (cuda | triton | torch).

The `torch` backend is what the CPU fast path runs; kernels are picked on CUDA tensors when they load
(see lopa_fast.ops._backend); every op takes `backend=` to force one.
"""
from lopa_fast.ops.branch_attention import branch_attention
from lopa_fast.ops.confidence import confidence
from lopa_fast.ops.head_confidence import head_confidence
from lopa_fast.sampling import Confidence, HeadConfidence

__all__ = ["branch_attention", "confidence", "head_confidence", "Confidence", "HeadConfidence"]
from lopa_fast.ops.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from lopa_fast.ops.rope import rope, rope_cos_sin  # noqa: E402
from lopa_fast.ops.silu_mul import silu_mul  # noqa: E402
from lopa_fast.ops.norm_linear import NormLinear, norm_linear  # noqa: E402
from lopa_fast.ops.select_round import plan_round, select_round  # noqa: E402
from lopa_fast.ops.select_step import select_step  # noqa: E402
from lopa_fast.ops.window_inputs import window_inputs  # noqa: E402
from lopa_fast.ops.first_nonfinite import first_nonfinite  # noqa: E402
from lopa_fast.ops.first_bad import first_bad  # noqa: E402
from lopa_fast.ops.commit_round import commit_round  # noqa: E402

__all__ += ["rms_norm", "add_rms_norm", "rope", "rope_cos_sin", "silu_mul", "norm_linear", "NormLinear", "select_round",
            "plan_round", "window_inputs", "select_step", "first_nonfinite", "first_bad", "commit_round"]
