"""Triton `confidence`: per-row vocabulary statistics (argmax, p_max, top-2 margin, neg-entropy, lse).

One program per row, two chunked passes over V (never a whole 152k row in registers: a 32k-wide tile
spilled at 255 registers on sm_90, TOOLCHAIN.md):
  pass 1: online max / argmax / second max / sum exp  -> token, p_max, margin, lse
  pass 2: sum_v p_v * log(p_v + eps) with the final lse (the eps term needs p, so it cannot be folded
          into pass 1 exactly)
Bytes: reads 2 * N * V * elem (pass 2 mostly hits L2 for a 300 KB bf16 row), writes 20 * N.
Matches lopa_fast.reference.ops.confidence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton._common import is_interpreter


@triton.jit
def _confidence_kernel(
    x_ptr, stride_x,
    tok_ptr, pmax_ptr, margin_ptr, negent_ptr, lse_ptr,
    V, suppress, eps,
    HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    m1 = tl.full((), neg_inf, tl.float32)  # running max
    m2 = tl.full((), neg_inf, tl.float32)  # running second max (multiset: an exact tie gives m2 == m1)
    i1 = tl.full((), 0, tl.int32)
    s = tl.full((), 0.0, tl.float32)  # sum exp(x - m1)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + offs
        x = tl.load(base + idx, mask=idx < V, other=neg_inf).to(tl.float32)
        if HAS_SUPPRESS:
            x = tl.where(idx == suppress, neg_inf, x)
        cmax = tl.max(x, axis=0)
        cidx = tl.min(tl.where(x == cmax, idx, 2147483647), axis=0)  # earliest arg-max in the chunk
        c2 = tl.max(tl.where(idx == cidx, neg_inf, x), axis=0)
        m2 = tl.maximum(tl.minimum(m1, cmax), tl.maximum(m2, c2))
        better = cmax > m1  # strict: an equal later max keeps the earlier index
        i1 = tl.where(better, cidx, i1)
        m_new = tl.maximum(m1, cmax)
        m_safe = tl.where(m_new == neg_inf, 0.0, m_new)  # all -inf so far: avoid inf - inf
        s = s * tl.exp(m1 - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m1 = m_new
    lse = m1 + tl.log(s)
    p_max = tl.exp(m1 - lse)
    p_2 = tl.exp(m2 - lse)
    ent = tl.full((), 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + offs
        x = tl.load(base + idx, mask=idx < V, other=neg_inf).to(tl.float32)
        if HAS_SUPPRESS:
            x = tl.where(idx == suppress, neg_inf, x)
        p = tl.exp(x - lse)
        ent += tl.sum(tl.where(idx < V, p * tl.log(p + eps), 0.0), axis=0)
    tl.store(tok_ptr + row, i1.to(tl.int64))
    tl.store(pmax_ptr + row, p_max)
    tl.store(margin_ptr + row, p_max - p_2)
    tl.store(negent_ptr + row, ent)
    tl.store(lse_ptr + row, lse)


def block_v_for(V: int) -> int:
    # 4096 fp32 per program = 16 values per thread at 8 warps: no spills (bench/results/kernel_resources.md)
    return min(4096, triton.next_power_of_2(max(V, 16)))


def confidence(logits: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10):
    """logits [N, V] (last dim contiguous) -> (token int64 [N], p_max, margin, neg_entropy, lse fp32 [N])."""
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
    _confidence_kernel[(N,)](
        logits, logits.stride(0), tok, *outs, V,
        -1 if suppress_token is None else int(suppress_token), float(eps),
        HAS_SUPPRESS=suppress_token is not None, BLOCK_V=BLOCK_V, num_warps=8,
    )
    return (tok, *outs)
