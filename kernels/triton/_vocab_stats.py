"""Online vocabulary statistics shared by the Triton `confidence` and `head_confidence` kernels.

Per row, a running state over the logits seen so far: m1 max, i1 earliest arg-max (int32; any index while
m1 = -inf: such a split never wins a merge), m2 second max of the multiset (an exact tie gives m2 == m1),
s sum exp(x - m1). A tile is [BLOCK_V] (one row, AXIS=0: the state is scalars) or [BLOCK_R, BLOCK_V] (a row
tile, AXIS=1: the state is [BLOCK_R]); per-split states are merged in vocabulary order by `merge_splits`.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def suppress_ids(x, ids, suppress, HAS_SUPPRESS: tl.constexpr):
    """x with the logits of vocabulary id `suppress` set to -inf (ids: the column ids, broadcastable to x)."""
    if HAS_SUPPRESS:
        x = tl.where(ids == suppress, float("-inf"), x)
    return x


@triton.jit
def fold_tile(m1, i1, m2, s, x, ids, AXIS: tl.constexpr):
    """The state after the tile x (masked entries already -inf), ids its column ids broadcastable to x."""
    neg_inf = float("-inf")
    cmax = tl.max(x, axis=AXIS)
    cidx = tl.min(tl.where(x == tl.expand_dims(cmax, AXIS), ids, 2147483647), axis=AXIS)  # earliest arg-max
    c2 = tl.max(tl.where(ids == tl.expand_dims(cidx, AXIS), neg_inf, x), axis=AXIS)
    m2 = tl.maximum(tl.minimum(m1, cmax), tl.maximum(m2, c2))
    i1 = tl.where(cmax > m1, cidx, i1)  # strict: an equal later max keeps the earlier index
    m_new = tl.maximum(m1, cmax)
    m_safe = tl.where(m_new == neg_inf, 0.0, m_new)  # all -inf so far: avoid inf - inf
    s = s * tl.exp(m1 - m_safe) + tl.sum(tl.exp(x - tl.expand_dims(m_safe, AXIS)), axis=AXIS)
    return m_new, i1, m2, s


@triton.jit
def entropy_tile(x, lse, valid, eps, AXIS: tl.constexpr):
    """sum over AXIS of p * log(p + eps), p = exp(x - lse), over the `valid` entries of the tile x."""
    p = tl.exp(x - tl.expand_dims(lse, AXIS))
    return tl.sum(tl.where(valid, p * tl.log(p + eps), 0.0), axis=AXIS)


@triton.jit
def merge_splits(pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, row, S, BLOCK_S: tl.constexpr):
    """The S per-split states of one row ([N, S] partials, splits in vocabulary order) -> (m1, i1, m2, lse)."""
    os_ = tl.arange(0, BLOCK_S)
    ok = os_ < S
    base = row * S
    pm1 = tl.load(pm1_ptr + base + os_, mask=ok, other=float("-inf"))
    pm2 = tl.load(pm2_ptr + base + os_, mask=ok, other=float("-inf"))
    ps = tl.load(ps_ptr + base + os_, mask=ok, other=0.0)
    pi1 = tl.load(pi1_ptr + base + os_, mask=ok, other=0)
    m1 = tl.max(pm1, axis=0)
    first = tl.min(tl.where(ok & (pm1 == m1), os_, BLOCK_S), axis=0)  # splits are in index order
    i1 = tl.sum(tl.where(os_ == first, pi1, 0), axis=0)
    # second max of the multiset: every other split's max and every split's own second max
    m2 = tl.maximum(tl.max(pm2, axis=0), tl.max(tl.where(os_ == first, float("-inf"), pm1), axis=0))
    m_safe = tl.where(m1 == float("-inf"), 0.0, m1)
    z = tl.sum(ps * tl.exp(pm1 - m_safe), axis=0)
    lse = m_safe + tl.log(z)
    return m1, i1, m2, lse


@triton.jit
def split_partials(ptr, row, S, other, BLOCK_S: tl.constexpr):
    """One row's S per-split partials of an [N, S] buffer as a [BLOCK_S] vector (`other` past S)."""
    os_ = tl.arange(0, BLOCK_S)
    return tl.load(ptr + row * S + os_, mask=os_ < S, other=other)


@triton.jit
def store_stats(row, m1, i1, m2, lse, tok_ptr, pmax_ptr, margin_ptr, lse_ptr):
    """token (int64), p_max, margin = p_top1 - p_top2 and lse of one row from its final state."""
    p_max = tl.exp(m1 - lse)
    tl.store(tok_ptr + row, i1.to(tl.int64))
    tl.store(pmax_ptr + row, p_max)
    tl.store(margin_ptr + row, p_max - tl.exp(m2 - lse))
    tl.store(lse_ptr + row, lse)


def split_layout(V: int, block_v: int, num_splits: int) -> tuple[int, int, int]:
    """(S, split, BLOCK_S) for about `num_splits` vocabulary splits (clamped to [1, V / block_v tiles]): each
    split a whole number of block_v tiles (so S may come out smaller), BLOCK_S a power of two >= max(S, 2)."""
    num_splits = max(1, min(int(num_splits), triton.cdiv(V, block_v)))
    split = triton.cdiv(triton.cdiv(V, num_splits), block_v) * block_v
    S = triton.cdiv(V, split)
    return S, split, max(2, triton.next_power_of_2(S))
