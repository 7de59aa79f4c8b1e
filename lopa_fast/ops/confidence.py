"""`confidence`: per-row vocabulary statistics for the decoding strategies. See reference.ops.confidence."""
from __future__ import annotations

import importlib

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.sampling import Confidence

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _check(logits, suppress_token, eps):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"confidence: logits must be a [N, V] tensor, got {getattr(logits, 'shape', type(logits))}")
    if logits.dtype not in _FLOATS:
        raise TypeError(f"confidence: logits.dtype={logits.dtype}; allowed: {_FLOATS}")
    _backend.check_vocab_args("confidence", "logits", logits.shape[1], suppress_token, eps)
    _backend.check_last_dim_contiguous("confidence", logits=logits)


def confidence(logits: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10, *, check: bool = True,
               backend: str | None = None) -> Confidence:
    """Per row of logits [N, V]: softmax in fp32 of the upcast logits, then
    Confidence(token int64 [N] (argmax, ties -> lowest index), p_max fp32 [N], margin fp32 [N] (p_top1 - p_top2),
    neg_entropy fp32 [N] (sum_v p_v * log(p_v + eps)), lse fp32 [N]).
    suppress_token: a vocabulary id treated as logit -inf everywhere (e.g. the mask id), None = off (upstream).
    backend: None (auto: triton on CUDA, torch on CPU) | "cuda" | "triton" | "torch".
    Matches lopa_fast.reference.ops.confidence (the torch backend is that reference).
    """
    if check:
        _check(logits, suppress_token, eps)
    b = _backend.resolve("confidence", backend, logits.device, (logits, suppress_token, eps))
    if b == "torch":
        return ref.confidence(logits, suppress_token, eps)
    if logits.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"confidence: logits.dtype={logits.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    if b == "cuda":
        return Confidence(*_backend.kernel("confidence", b)(logits, suppress_token, eps))
    sup = None if suppress_token is None else int(suppress_token)
    return Confidence(*torch.ops.lopa_fast.triton_confidence(logits, sup, float(eps)))


# ------------------------------------------------------------------------------ torch custom op (Triton)
# Registered so that torch.compile(fullgraph=True) and CUDA-graph capture trace through the public op; the
# op returns plain tensors and the namedtuple is rebuilt outside it.
@torch.library.custom_op("lopa_fast::triton_confidence", mutates_args=())
def _confidence_op(logits: torch.Tensor, suppress_token: int | None, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    launch = importlib.import_module("lopa_fast.kernels.triton.confidence").confidence  # triton: optional
    return tuple(launch(logits, suppress_token, eps))


@_confidence_op.register_fake
def _(logits, suppress_token, eps):
    N = logits.shape[0]
    return (logits.new_empty(N, dtype=torch.int64), *[logits.new_empty(N, dtype=torch.float32) for _ in range(4)])
