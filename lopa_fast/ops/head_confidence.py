"""`head_confidence`: the LM head and the per-row confidence statistics fused, over vocabulary chunks.

See lopa_fast.reference.ops.head_confidence (the torch backend) for the semantics: the `confidence` of the
logits rows hidden @ weight.T without materialising them, plus each row's finiteness (the numerics guard).
"""
from __future__ import annotations

import importlib

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.sampling import HeadConfidence, head_confidence_fake, head_confidence_op_outputs

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _check(hidden, weight, suppress_token, eps, entropy, chunk, keep_logits):
    op = "head_confidence"
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{op}: {name} must be a 2-d tensor, got {getattr(t, 'shape', type(t))}")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"{op}: hidden.dtype={hidden.dtype}; allowed: {_FLOATS}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: weight.dtype={weight.dtype} differs from hidden.dtype={hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"{op}: weight is on {weight.device}, hidden on {hidden.device}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{op}: hidden [R, H={hidden.shape[1]}] and weight [V, H={weight.shape[1]}] disagree on H")
    _backend.check_vocab_args(op, "weight", weight.shape[0], suppress_token, eps)
    for name, flag in (("entropy", entropy), ("keep_logits", keep_logits)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name}={flag!r} must be True or False")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{op}: chunk={chunk!r} must be an int >= 1 or None")
    _backend.check_last_dim_contiguous(op, hidden=hidden, weight=weight)


def head_confidence(hidden: torch.Tensor, weight: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10,
                    entropy: bool = True, *, keep_logits: bool = False, chunk: int | None = None, check: bool = True,
                    backend: str | None = None) -> HeadConfidence:
    """The LM head and the confidence statistics fused: for hidden [R, H] (final-normed rows) and the head
    weight [V, H] (same dtype), the statistics of `ops.confidence(F.linear(hidden, weight), suppress_token, eps)`
    computed over vocabulary chunks, the [R, V] logits never materialised.

    Returns HeadConfidence(token int64 [R] (argmax, ties -> lowest index), p_max, margin (p_top1 - p_top2),
    neg_entropy (sum_v p_v * log(p_v + eps); None when entropy=False), lse fp32 [R], finite bool [R], logits).
    keep_logits=True: `logits` holds the raw logits [R, V] in hidden.dtype (the values the statistics folded,
    before the suppression), written by the same pass (the round's next last_logit row is one of them: no second
    GEMV over the head, 1.09 GB at Dream-7B); else None and nothing of size R x V is kept.
    A logit is the head's value in hidden.dtype (fp32 accumulation rounded to the storage dtype, what F.linear
    returns), upcast to fp32; finite[r] is False when any raw logit of row r is NaN / inf (checked before the
    suppressed id is set to -inf): that row's statistics are meaningless and must not be decoded.
    entropy=False skips the second look at every logit (the entropy's eps needs the final lse; the kernels keep
    the logits of the first pass in an [R, V] storage-dtype scratch for it, the torch backend recomputes its
    chunks): the round asks for it only under sampling_strategy="neg_entropy".
    chunk: vocabulary columns per step of the torch backend (None: reference.ops.HEAD_CHUNK); the kernels tile
    on their own.
    backend: None (auto: triton on CUDA, torch on CPU) | "cuda" | "triton" | "torch" (see lopa_fast.ops._backend).
    """
    if check:
        _check(hidden, weight, suppress_token, eps, entropy, chunk, keep_logits)
    b = _backend.resolve("head_confidence", backend, hidden.device, (hidden, weight, suppress_token, eps))
    if b == "torch":
        return ref.head_confidence(hidden, weight, suppress_token, eps, entropy, chunk, keep_logits)
    if hidden.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"head_confidence: hidden.dtype={hidden.dtype} on backend={b!r}; allowed: {_KERNEL_FLOATS}")
    if b == "cuda":
        out = _backend.kernel("head_confidence", b)(hidden, weight, suppress_token, eps, entropy, keep_logits)
    else:
        sup = None if suppress_token is None else int(suppress_token)
        out = torch.ops.lopa_fast.triton_head_confidence(hidden, weight, sup, float(eps), bool(entropy),
                                                         bool(keep_logits))
    token, p_max, margin, neg_entropy, lse, finite, logits = out
    return HeadConfidence(token, p_max, margin, neg_entropy if entropy else None, lse, finite,
                          logits if keep_logits else None)


# ------------------------------------------------------------------------------ torch custom op (Triton)
# Registered so that torch.compile(fullgraph=True) and CUDA-graph capture trace through the public op; the
# op returns plain tensors (neg_entropy: zeros without the entropy pass; logits: [0, V] unless kept) and the
# namedtuple is rebuilt outside.
@torch.library.custom_op("lopa_fast::triton_head_confidence", mutates_args=())
def _head_confidence_op(hidden: torch.Tensor, weight: torch.Tensor, suppress_token: int | None, eps: float,
                        entropy: bool, keep_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    launch = importlib.import_module("lopa_fast.kernels.triton.head_confidence").head_confidence  # optional
    out = launch(hidden, weight, suppress_token, eps, entropy, keep_logits)
    return head_confidence_op_outputs(out, hidden, weight.shape[0], keep_logits)


_head_confidence_op.register_fake(head_confidence_fake)
