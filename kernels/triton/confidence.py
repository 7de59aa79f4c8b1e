"""Triton `confidence`: per-row vocabulary statistics (argmax, p_max, top-2 margin, neg-entropy, lse).

Two chunked passes over V (never a whole 152k row in registers: a 32k-wide tile spilled at 255
registers on sm_90, docs/toolchain.md section 4):
  pass 1: online max / argmax / second max / sum exp  -> token, p_max, margin, lse
  pass 2: sum_v p_v * log(p_v + eps) with the final lse (the eps term needs p, so it cannot be folded
          into pass 1 exactly)
Many rows: one program per row does both passes (`_confidence_kernel`). Few rows (a 32-96-row round
would occupy under one program per SM): split-V, each (row, split) program walks a slice of V
(`_conf_partial_kernel`, `_conf_entropy_kernel`) and `_conf_finalize_kernel` merges in a fixed order.
Bytes: reads 2 * N * V * elem (pass 2 mostly hits L2: 300 KB per bf16 row), writes 20 * N.
Matches lopa_fast.reference.ops.confidence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton import _vocab_stats as vs
from lopa_fast.kernels.triton._common import is_interpreter


@triton.jit
def _chunk_stats(base, lo, hi, suppress, HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The online state (m1, i1, m2, s; _vocab_stats) over logits[lo:hi] of one row."""
    offs = tl.arange(0, BLOCK_V)
    m1 = tl.full((), float("-inf"), tl.float32)
    m2 = tl.full((), float("-inf"), tl.float32)
    i1 = lo
    s = tl.full((), 0.0, tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        idx = v0 + offs
        x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        x = vs.suppress_ids(x, idx, suppress, HAS_SUPPRESS)
        m1, i1, m2, s = vs.fold_tile(m1, i1, m2, s, x, idx, 0)
    return m1, i1, m2, s


@triton.jit
def _chunk_entropy(base, lo, hi, lse, suppress, eps, HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr):
    """sum_v p_v * log(p_v + eps) over logits[lo:hi] of one row, p_v = exp(x_v - lse)."""
    offs = tl.arange(0, BLOCK_V)
    ent = tl.full((), 0.0, tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        idx = v0 + offs
        x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        x = vs.suppress_ids(x, idx, suppress, HAS_SUPPRESS)
        ent += vs.entropy_tile(x, lse, idx < hi, eps, 0)
    return ent


@triton.jit
def _confidence_kernel(
    x_ptr, stride_x,
    tok_ptr, pmax_ptr, margin_ptr, negent_ptr, lse_ptr,
    V, suppress, eps,
    HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row: both passes over the whole row."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    m1, i1, m2, s = _chunk_stats(base, 0, V, suppress, HAS_SUPPRESS, BLOCK_V)
    lse = m1 + tl.log(s)
    ent = _chunk_entropy(base, 0, V, lse, suppress, eps, HAS_SUPPRESS, BLOCK_V)
    vs.store_stats(row, m1, i1, m2, lse, tok_ptr, pmax_ptr, margin_ptr, lse_ptr)
    tl.store(negent_ptr + row, ent)


@triton.jit
def _conf_partial_kernel(
    x_ptr, stride_x, pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, V, split, suppress,
    HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    S = tl.num_programs(1)
    lo = sp * split
    hi = tl.minimum(lo + split, V)
    m1, i1, m2, s = _chunk_stats(x_ptr + row * stride_x, lo, hi, suppress, HAS_SUPPRESS, BLOCK_V)
    o = row * S + sp
    tl.store(pm1_ptr + o, m1)
    tl.store(pi1_ptr + o, i1)
    tl.store(pm2_ptr + o, m2)
    tl.store(ps_ptr + o, s)


@triton.jit
def _conf_entropy_kernel(
    x_ptr, stride_x, pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, pent_ptr, V, split, suppress, eps,
    HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    S = tl.num_programs(1)
    _, _, _, lse = vs.merge_splits(pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, row, S, BLOCK_S)
    lo = sp * split
    hi = tl.minimum(lo + split, V)
    ent = _chunk_entropy(x_ptr + row * stride_x, lo, hi, lse, suppress, eps, HAS_SUPPRESS, BLOCK_V)
    tl.store(pent_ptr + row * S + sp, ent)


@triton.jit
def _conf_finalize_kernel(
    pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, pent_ptr, tok_ptr, pmax_ptr, margin_ptr, negent_ptr, lse_ptr, S,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m1, i1, m2, lse = vs.merge_splits(pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, row, S, BLOCK_S)
    ent = tl.sum(vs.split_partials(pent_ptr, row, S, 0.0, BLOCK_S), axis=0)  # fixed order
    vs.store_stats(row, m1, i1, m2, lse, tok_ptr, pmax_ptr, margin_ptr, lse_ptr)
    tl.store(negent_ptr + row, ent)


def block_v_for(V: int) -> int:
    # 4096 fp32 per program = 16 values per thread at 8 warps: no spills (bench/results/kernel_resources.md)
    return min(4096, triton.next_power_of_2(max(V, 16)))


def num_splits_for(N: int, V: int, block_v: int, n_sm: int = 132) -> int:
    """Vocabulary splits per row: one program per row leaves most of the 132 SMs idle for a 32-96-row
    round (each row is a latency-bound walk over 37 chunks of 4096); aim at ~4 programs per SM, each
    split keeping >= 4 chunks so the partials (20 B per split) stay negligible."""
    max_splits = max(1, triton.cdiv(V, 4 * block_v))
    return max(1, min(max_splits, triton.cdiv(4 * n_sm, max(N, 1))))


def confidence(logits: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10, num_splits=None):
    """logits [N, V] (last dim contiguous) -> (token int64 [N], p_max, margin, neg_entropy, lse fp32 [N]).

    num_splits=None: one program per row when that fills the GPU, else the split-V path (partials per
    (row, split), then an entropy pass, then a merge; three launches, deterministic order)."""
    N, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    tok = torch.empty(N, dtype=torch.int64, device=dev)
    outs = [torch.empty(N, dtype=torch.float32, device=dev) for _ in range(4)]
    if N == 0:
        return (tok, *outs)
    BLOCK_V = block_v_for(V)
    if is_interpreter():
        BLOCK_V = min(BLOCK_V, 1024)
    S, split, BLOCK_S = vs.split_layout(V, BLOCK_V, num_splits_for(N, V, BLOCK_V) if num_splits is None else num_splits)
    sup = -1 if suppress_token is None else int(suppress_token)
    has_sup = suppress_token is not None
    if S == 1:
        _confidence_kernel[(N,)](
            logits, logits.stride(0), tok, *outs, V, sup, float(eps),
            HAS_SUPPRESS=has_sup, BLOCK_V=BLOCK_V, num_warps=8,
        )
        return (tok, *outs)
    pm1, pm2, ps, pent = (torch.empty(N, S, dtype=torch.float32, device=dev) for _ in range(4))
    pi1 = torch.empty(N, S, dtype=torch.int32, device=dev)
    _conf_partial_kernel[(N, S)](
        logits, logits.stride(0), pm1, pi1, pm2, ps, V, split, sup,
        HAS_SUPPRESS=has_sup, BLOCK_V=BLOCK_V, num_warps=8,
    )
    _conf_entropy_kernel[(N, S)](
        logits, logits.stride(0), pm1, pi1, pm2, ps, pent, V, split, sup, float(eps),
        HAS_SUPPRESS=has_sup, BLOCK_V=BLOCK_V, BLOCK_S=BLOCK_S, num_warps=8,
    )
    _conf_finalize_kernel[(N,)](pm1, pi1, pm2, ps, pent, tok, *outs, S, BLOCK_S=BLOCK_S, num_warps=1)
    return (tok, *outs)
