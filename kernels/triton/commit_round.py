"""Triton `commit_round`: a D2F / LoPA round's commit as ONE launch (its torch form in a captured round: the winner's
K/V gathered (2 nodes), the masked index_copy_ of both caches (~6) and, under Dream's shift, the next last_logit
row picked and selected (~7)).

Programs [0, layers x Nb): program (l, i) copies window row i of the winner's K and V at layer l into cache row
cache_len + i when i < u (rows past the span are not written: the torch form sends them to the trash row).
Programs past them (with a last_logit): a BLOCK_V chunk each of logits row last_row - 1 into last_logit, when
u > 0 and last_row > 0. Every value is read from the device (graph-safe). Matches
lopa_fast.reference.ops.commit_round on every row but the trash row (exact: copies).
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_HD = 1024  # K/V elements a step (Hkv x D: 512 at Dream-7B, 128 at Qwen2.5-0.5B)
BLOCK_V = 4096  # last_logit elements a program (152,064 at Dream: 38 programs)


@triton.jit
def _commit_kernel(ck_ptr, cv_ptr, kw_ptr, vw_ptr, cl_ptr, w_ptr, u_ptr, last_ptr, lg_ptr, lr_ptr,
                   Nb, HD, V, Lc, n_kv,
                   s_cl, s_cr, s_vl, s_vr, s_wl, s_wb, s_wn, s_xl, s_xb, s_xn, s_lg,
                   HAS_LAST: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    u = tl.load(u_ptr)
    if pid < n_kv:
        layer = (pid // Nb).to(tl.int64)
        i = pid % Nb
        row = tl.load(cl_ptr) + i
        if (i < u) & (row < Lc):
            w = tl.load(w_ptr).to(tl.int64)
            ksrc = kw_ptr + layer * s_wl + w * s_wb + i * s_wn
            vsrc = vw_ptr + layer * s_xl + w * s_xb + i * s_xn
            kdst = ck_ptr + layer * s_cl + row * s_cr
            vdst = cv_ptr + layer * s_vl + row * s_vr
            for c0 in range(0, HD, BLOCK_HD):
                c = c0 + tl.arange(0, BLOCK_HD)
                m = c < HD
                tl.store(kdst + c, tl.load(ksrc + c, mask=m), mask=m)
                tl.store(vdst + c, tl.load(vsrc + c, mask=m), mask=m)
    elif HAS_LAST:
        lr = tl.load(lr_ptr)
        if (u > 0) & (lr > 0):
            c = (pid - n_kv) * BLOCK_V + tl.arange(0, BLOCK_V)
            m = c < V
            src = lg_ptr + (lr - 1).to(tl.int64) * s_lg
            tl.store(last_ptr + c, tl.load(src + c, mask=m), mask=m)


def commit_round(cache_k, cache_v, cache_len, k_win, v_win, winner, u, last_logit=None, logits=None, last_row=None):
    """In place: cache_k / cache_v [layers, Lc, Hkv, D] (rows contiguous), k_win / v_win [layers, NB, Nb, Hkv, D]
    (rows contiguous), cache_len / winner / u / last_row 0-d int tensors on the device; last_logit [V] and logits
    [R, V] (last dims contiguous) or None."""
    layers, NB, Nb = k_win.shape[:3]
    HD = k_win.shape[3] * k_win.shape[4]
    Lc = cache_k.shape[1]
    n_kv = layers * Nb
    has_last = last_logit is not None
    V = last_logit.shape[0] if has_last else 0
    grid = n_kv + (triton.cdiv(V, BLOCK_V) if has_last else 0)
    if grid == 0:
        return
    dummy = cache_len
    _commit_kernel[(grid,)](
        cache_k, cache_v, k_win, v_win, cache_len, winner, u,
        last_logit if has_last else cache_k, logits if has_last else cache_k, last_row if has_last else dummy,
        Nb, HD, V, Lc, n_kv,
        cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1),
        k_win.stride(0), k_win.stride(1), k_win.stride(2), v_win.stride(0), v_win.stride(1), v_win.stride(2),
        logits.stride(0) if has_last else 0,
        HAS_LAST=has_last, BLOCK_HD=min(BLOCK_HD, triton.next_power_of_2(max(HD, 16))), BLOCK_V=BLOCK_V, num_warps=4,
    )
