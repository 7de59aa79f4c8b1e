"""Triton `select_round`: threshold accept, at-least-one fallback, top-n lookahead, branch score, winner.

One program for the whole round: it walks the branches in groups of a [BLOCK_B, BLOCK_N] tile (whole
windows, <= 4096 lanes: B=16 x n=256 in one step) and keeps a running winner, so the cross-branch
argmax needs no second launch and no host round trip. Inputs are a few KB, so the op is bound by its
one launch; what it buys is that the round's decision never leaves the device.
Matches lopa_fast.reference.ops.select_round.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.contracts import COMPARATOR_CODES, lowest_k_table

_GT = tl.constexpr(COMPARATOR_CODES["gt"])
_GE = tl.constexpr(COMPARATOR_CODES["ge"])


@triton.jit
def _select_round_kernel(
    val_ptr, conf_ptr, masked_ptr, blk_ptr, complete_ptr, ktab_ptr, cc_ptr, active_ptr,
    accept_ptr, look_ptr, score_ptr, winner_ptr,
    B, n, nb, n_look, tau, alpha,
    s_val, s_conf, s_masked, s_blk, s_complete,
    CMP: tl.constexpr, HAS_CC: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    on = tl.arange(0, BLOCK_N)
    neg_inf = float("-inf")
    big = 1 << 30
    best_score = tl.full((), neg_inf, tl.float32)
    best_b = tl.full((), big, tl.int32)
    # groups of BLOCK_B branches (BLOCK_B * BLOCK_N <= 4096 lanes: larger tiles spilled on sm_90)
    for b0 in range(0, B, BLOCK_B):
        ob = b0 + tl.arange(0, BLOCK_B)
        rows = ob < B
        inb = rows[:, None] & (on[None, :] < n)
        masked = tl.load(masked_ptr + ob[:, None] * s_masked + on[None, :], mask=inb, other=0) != 0
        blk = tl.load(blk_ptr + ob[:, None] * s_blk + on[None, :], mask=inb, other=-1)
        conf = tl.load(conf_ptr + ob[:, None] * s_conf + on[None, :], mask=inb, other=0.0).to(tl.float32)
        val = tl.load(val_ptr + ob[:, None] * s_val + on[None, :], mask=inb, other=0.0).to(tl.float32)
        conf = tl.where(masked, conf, neg_inf)  # never read values outside the candidates (may be NaN)
        in_block = masked & (blk >= 0)
        if CMP == _GT:
            hit = val > tau
        elif CMP == _GE:
            hit = val >= tau
        else:
            hit = val <= tau
        accept = in_block & hit
        pos = on[None, :] + tl.zeros((BLOCK_B, BLOCK_N), tl.int32)

        # at-least-one fallback per fully activated block without an accept (earliest arg-max of conf)
        for j in range(nb):
            bm = masked & (blk == j)
            has_mask = tl.max(bm.to(tl.int32), axis=1) > 0
            has_acc = tl.max((bm & accept).to(tl.int32), axis=1) > 0
            comp = tl.load(complete_ptr + ob * s_complete + j, mask=rows, other=0) != 0
            cj = tl.where(bm, conf, neg_inf)
            best = tl.max(cj, axis=1)
            first = tl.min(tl.where(bm & (cj == best[:, None]), pos, big), axis=1)
            need = comp & has_mask & (~has_acc)
            accept = accept | (need[:, None] & (pos == first[:, None]))
        tl.store(accept_ptr + ob[:, None] * n + on[None, :], accept.to(tl.int8), mask=inb)

        # top-n_look of the remaining candidates: repeated earliest arg-max (n_look is small, <= ~16)
        cand = in_block & (~accept)
        for t in range(n_look):
            key = tl.where(cand, conf, neg_inf)
            best = tl.max(key, axis=1)
            first = tl.min(tl.where(cand & (key == best[:, None]), pos, big), axis=1)
            found = first < big
            tl.store(look_ptr + ob * n_look + t, tl.where(found, first, -1).to(tl.int64), mask=rows)
            cand = cand & (pos != first[:, None])

        # branch score: mean of the lowest k(m) conf values over all masked positions (1.0 when none)
        m = tl.sum(masked.to(tl.int32), axis=1)
        k = tl.load(ktab_ptr + m, mask=rows, other=1)
        asc = tl.sort(tl.where(masked, conf, float("inf")), dim=1)
        low = tl.sum(tl.where(pos < k[:, None], asc, 0.0), axis=1) / k.to(tl.float32)
        future = tl.where(m > 0, low, 1.0)
        if HAS_CC:
            cc = tl.load(cc_ptr + ob, mask=rows, other=1.0).to(tl.float32)
        else:
            cc = tl.full((BLOCK_B,), 1.0, tl.float32)
        score = alpha * cc + (1.0 - alpha) * future
        tl.store(score_ptr + ob, score, mask=rows)

        act = rows
        if HAS_ACTIVE:
            act = act & (tl.load(active_ptr + ob, mask=rows, other=0) != 0)
        key = tl.where(act, score, neg_inf)
        g_best = tl.max(key, axis=0)
        g_first = tl.min(tl.where(act & (key == g_best), ob, big), axis=0)
        take = (g_first < big) & ((best_b == big) | (g_best > best_score))  # strict: earlier groups win ties
        best_score = tl.where(take, g_best, best_score)
        best_b = tl.where(take, g_first, best_b)
    tl.store(winner_ptr, tl.where(best_b < big, best_b, -1).to(tl.int64))


def tile_for(B: int, n: int, max_lanes: int = 4096) -> tuple[int, int, int]:
    """(BLOCK_B, BLOCK_N, num_warps): whole windows, as many branches per step as fit max_lanes."""
    BLOCK_N = max(16, triton.next_power_of_2(n))
    BLOCK_B = max(1, min(triton.next_power_of_2(B), max_lanes // BLOCK_N))
    return BLOCK_B, BLOCK_N, 4 if BLOCK_B * BLOCK_N <= 2048 else 8


def select_round(accept_value, conf, masked, block_ids, block_complete, tau, comparator="gt", n_look=0,
                 topp=1.0, alpha=0.0, creation_conf=None, branch_active=None, max_lanes=4096):
    """See lopa_fast.reference.ops.select_round; returns (accept bool [B, n], lookahead int64 [B, n_look],
    score fp32 [B], winner int64 0-d). Inputs need a contiguous last dim (the public op ensures it)."""
    B, n = conf.shape
    nb = block_complete.shape[1]
    dev = conf.device
    accept = torch.empty(B, n, dtype=torch.int8, device=dev)
    look = torch.empty(B, n_look, dtype=torch.int64, device=dev)
    score = torch.empty(B, dtype=torch.float32, device=dev)
    winner = torch.empty((), dtype=torch.int64, device=dev)
    masked_u8 = masked.view(torch.uint8) if masked.dtype == torch.bool else masked
    complete_u8 = block_complete.view(torch.uint8) if block_complete.dtype == torch.bool else block_complete
    blk = block_ids if block_ids.dtype == torch.int32 else block_ids.to(torch.int32)
    active = branch_active
    if active is not None and active.dtype == torch.bool:
        active = active.view(torch.uint8)
    BLOCK_B, BLOCK_N, warps = tile_for(B, n, max_lanes)
    _select_round_kernel[(1,)](
        accept_value, conf, masked_u8, blk, complete_u8, lowest_k_table(n, topp, dev),
        creation_conf if creation_conf is not None else score, active if active is not None else score,
        accept, look, score, winner,
        B, n, nb, n_look, float(tau), float(alpha),
        accept_value.stride(0), conf.stride(0), masked_u8.stride(0), blk.stride(0), complete_u8.stride(0),
        CMP=COMPARATOR_CODES[comparator], HAS_CC=creation_conf is not None, HAS_ACTIVE=branch_active is not None,
        BLOCK_B=BLOCK_B, BLOCK_N=BLOCK_N, num_warps=warps,
    )
    return accept.view(torch.bool), look, score, winner
