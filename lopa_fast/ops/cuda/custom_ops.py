"""The GPU entry points as torch custom ops (`torch.ops.lopa_fast.cuda_*`) with fake implementations, so a
torch.compile'd or CUDA-graph-captured round treats them as opaque ops."""
from __future__ import annotations

import torch

from lopa_fast.ops.cuda.device import launcher
from lopa_fast.ops.cuda.launch import run_branch_attention, run_confidence, run_head_confidence, run_select_round
from lopa_fast.sampling import head_confidence_fake, head_confidence_op_outputs

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("lopa_fast::cuda_branch_attention", mutates_args=(), device_types="cuda")
def branch_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: int, k_win: Tensor, v_win: Tensor,
                        win_lens: OptTensor, block_ids: OptTensor, mode: str, scale: float | None,
                        cache_len_dev: OptTensor = None, cache_index: OptTensor = None) -> tuple[Tensor, Tensor]:
    """(o [B, n, Hq, D] in q.dtype, lse [B, n, Hq] fp32) of lopa_fast.ops.branch_attention. cache_len_dev: the
    prefix length as a device int tensor (graph-safe; `cache_len` is then ignored), or None. cache_index [B]
    (pooled form): k/v_cache a pool [S, Lmax, Hkv, D] and cache_len_dev the [S] slot lengths."""
    L = launcher("branch_attention", q)
    cl = cache_len if cache_len_dev is None else cache_len_dev
    return run_branch_attention(L, L.num_sms, q, k_cache, v_cache, cl, k_win, v_win, win_lens, block_ids, mode, scale,
                                cache_index)


@branch_attention_op.register_fake
def _(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, scale, cache_len_dev=None,
      cache_index=None):
    B, n, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, n, Hq), dtype=torch.float32)


@torch.library.custom_op("lopa_fast::cuda_confidence", mutates_args=(), device_types="cuda")
def confidence_op(logits: Tensor, suppress_token: int | None, eps: float
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The 5 Confidence fields of logits [N, V] (split over V when rows are few)."""
    L = launcher("confidence", logits)
    return run_confidence(L, logits, suppress_token, eps, L.num_sms)


@confidence_op.register_fake
def _(logits, suppress_token, eps):
    N = logits.shape[0]
    return (logits.new_empty(N, dtype=torch.int64), *[logits.new_empty(N, dtype=torch.float32) for _ in range(4)])


@torch.library.custom_op("lopa_fast::cuda_head_confidence", mutates_args=(), device_types="cuda")
def head_confidence_op(hidden: Tensor, weight: Tensor, suppress_token: int | None, eps: float, entropy: bool,
                       keep_logits: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The 7 HeadConfidence fields of hidden [R, H] x weight [V, H] (neg_entropy zeros without entropy; logits
    [0, V] unless kept)."""
    L = launcher("head_confidence", hidden)
    out = run_head_confidence(L, hidden, weight, suppress_token, eps, entropy, L.num_sms, keep_logits)
    return head_confidence_op_outputs(out, hidden, weight.shape[0], keep_logits)


head_confidence_op.register_fake(head_confidence_fake)


@torch.library.custom_op("lopa_fast::cuda_select_round", mutates_args=(), device_types="cuda")
def select_round_op(args: list[Tensor], bs: int, mask_id: int, eos_id: int, n_look: int, shift: bool, blend: bool,
                    score_all: bool) -> list[Tensor]:
    """The 28 SelectRound fields of lopa_fast.ops.select_round (its 35 checked tensors), one launch."""
    from lopa_fast.ops.select_round_outputs import outputs as _outputs  # noqa: PLC0415 - the op's one output layout

    outs = _outputs(args, split=False)
    ins = [t.contiguous() for t in args]
    run_select_round(launcher("select_round", args[3]), ins, outs, bs, mask_id, eos_id, n_look, shift, blend,
                     score_all)
    return outs


@select_round_op.register_fake
def _(args, bs, mask_id, eos_id, n_look, shift, blend, score_all):
    from lopa_fast.ops.select_round_outputs import outputs as _outputs  # noqa: PLC0415

    return _outputs(args, split=False)
