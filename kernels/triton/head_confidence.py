"""Triton `head_confidence`: the LM head (hidden @ weight.T) and the per-row confidence statistics fused.

The [R, V] logits never leave registers. Tiles of BLOCK_R rows x BLOCK_V vocabulary columns: each tile's
logits are one `tl.dot` loop over H (fp32 accumulation, rounded to the storage dtype as F.linear returns
them), then folded into per-row online statistics. The vocabulary is cut into S splits so that a round's
few row tiles still fill the GPU (grid: row tiles x splits):
  `_hc_stats_kernel`    per (row tile, split): max, first arg-max, second max (multiset), sum exp, finite;
                        with entropy=True or keep_logits it also writes each logit (storage dtype: exactly the value
                        folded) to an [R, V] buffer (kept: the round's next last_logit row is one of them)
  `_hc_entropy_kernel`  (entropy=True) per (row tile, split): the scratch tiles read back in the same loop order
                        (the same logits bit for bit), sum_v p_v * log(p_v + eps) with the final lse
  `_hc_merge_kernel`    per row: the splits merged in index order -> token, p_max, margin, lse, finite
and the entropy partials are summed per row in split order. Bytes: the weight is read ONCE (per row tile); the
entropy's eps sits inside the log, so it needs the final lse and a second look at every logit: reading back the
logits (R x V x 2 B in bf16: 49 MB for a LoPA k = 4 round at Dream-7B's 152,064 ids) costs ~1/20 of recomputing
them from the head weight (545 M parameters, 1.09 GB). Without the entropy nothing of size R x V is written.
Matches lopa_fast.reference.ops.head_confidence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton import _vocab_stats as vs
from lopa_fast.kernels.triton._common import is_interpreter
from lopa_fast.sampling import head_confidence_outputs


# 8 warps for the [64, 128] tiles: at 4 the stats kernel with the logits store, and the entropy pass, spill on sm_90
# (255 registers + 524 / 224 B; bench/compile_triton.py fails on spills)
NUM_WARPS = 8


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, rmask, cols32, hi, H, stride_h, stride_w,
                 BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """(logits [BLOCK_R, BLOCK_V] of rows x columns cols32 in fp32, each rounded to the storage dtype first; the
    columns' mask cols32 < hi)."""
    cmask = cols32 < hi
    cols = cols32.to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_V), dtype=tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + offs_h
        hm = hh < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + hh[None, :], mask=rmask[:, None] & hm[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_w + hh[:, None], mask=cmask[None, :] & hm[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # fp32 inputs: IEEE, not TF32 (parity with F.linear)
    return acc.to(h_ptr.dtype.element_ty).to(tl.float32), cmask


@triton.jit
def _tile(R, V, split, BLOCK_R: tl.constexpr):
    """This program's rows (int64, and which are < R), its split sp of S, and the split's columns [lo, hi)."""
    sp = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    lo = sp * split
    return rows.to(tl.int64), rows < R, sp, tl.num_programs(1), lo, tl.minimum(lo + split, V)


@triton.jit
def _hc_stats_kernel(
    h_ptr, w_ptr, stride_h, stride_w, R, V, H, split, suppress,
    pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, pfin_ptr, lg_ptr,
    HAS_SUPPRESS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
):
    rows64, rmask, sp, S, lo, hi = _tile(R, V, split, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_V)
    m1 = tl.full((BLOCK_R,), float("-inf"), tl.float32)  # the online state of _vocab_stats, per row
    m2 = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    i1 = tl.full((BLOCK_R,), 0, tl.int32) + lo
    s = tl.zeros((BLOCK_R,), tl.float32)
    bad = tl.zeros((BLOCK_R,), tl.int32)
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + offs_v
        x, cmask = _logits_tile(h_ptr, w_ptr, rows64, rmask, cols, hi, H, stride_h, stride_w, BLOCK_R, BLOCK_V, BLOCK_H)
        if STORE_LOGITS:  # x is a storage-dtype value: the store is exact
            tl.store(lg_ptr + rows64[:, None] * V + cols[None, :], x.to(lg_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])
        nonfinite = (x != x) | (tl.abs(x) == float("inf"))  # on the raw logits, before the suppression
        bad += tl.sum(tl.where(nonfinite & cmask[None, :], 1, 0), axis=1)
        x = vs.suppress_ids(tl.where(cmask[None, :], x, float("-inf")), cols[None, :], suppress, HAS_SUPPRESS)
        m1, i1, m2, s = vs.fold_tile(m1, i1, m2, s, x, cols[None, :], 1)
    o = rows64 * S + sp
    tl.store(pm1_ptr + o, m1, mask=rmask)
    tl.store(pi1_ptr + o, i1, mask=rmask)
    tl.store(pm2_ptr + o, m2, mask=rmask)
    tl.store(ps_ptr + o, s, mask=rmask)
    tl.store(pfin_ptr + o, (bad == 0).to(tl.int32), mask=rmask)


@triton.jit
def _hc_merge_kernel(
    pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, pfin_ptr, tok_ptr, pmax_ptr, margin_ptr, lse_ptr, fin_ptr, S,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m1, i1, m2, lse = vs.merge_splits(pm1_ptr, pi1_ptr, pm2_ptr, ps_ptr, row, S, BLOCK_S)
    pfin = vs.split_partials(pfin_ptr, row, S, 1, BLOCK_S)
    vs.store_stats(row, m1, i1, m2, lse, tok_ptr, pmax_ptr, margin_ptr, lse_ptr)
    tl.store(fin_ptr + row, (tl.min(pfin, axis=0) == 1).to(tl.int8))


@triton.jit
def _hc_entropy_kernel(
    lg_ptr, R, V, split, suppress, eps, lse_ptr, pent_ptr,
    HAS_SUPPRESS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows64, rmask, sp, S, lo, hi = _tile(R, V, split, BLOCK_R)
    lse = tl.load(lse_ptr + rows64, mask=rmask, other=0.0)
    offs_v = tl.arange(0, BLOCK_V)
    ent = tl.zeros((BLOCK_R,), tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + offs_v
        cmask = cols < hi
        x = tl.load(lg_ptr + rows64[:, None] * V + cols[None, :].to(tl.int64), mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        x = vs.suppress_ids(tl.where(cmask[None, :], x, float("-inf")), cols[None, :], suppress, HAS_SUPPRESS)
        ent += vs.entropy_tile(x, lse, cmask[None, :], eps, 1)
    tl.store(pent_ptr + rows64 * S + sp, ent, mask=rmask)


def tiles_for(R: int, V: int, H: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_V, BLOCK_H). GPU: 16-64 rows (a round's R is 32-300) x 128 columns (64 in fp32: its IEEE
    dot on the FMA units spilled 36 B at 128 on sm_90) x 64 of H per dot.
    Interpreter (CPU tests): wide vocabulary tiles, each step a numpy matmul."""
    block_r = 16 if R <= 16 else (32 if R <= 32 else 64)
    if is_interpreter():
        return block_r, min(1024, triton.next_power_of_2(max(V, 16))), min(256, triton.next_power_of_2(max(H, 16)))
    return block_r, (64 if dtype == torch.float32 else 128), 64


def num_splits_for(R: int, V: int, block_r: int, block_v: int, n_sm: int = 132) -> int:
    """Vocabulary splits: ~4 programs per SM over (row tiles x splits), each split >= 8 vocabulary tiles."""
    tiles = triton.cdiv(R, block_r)
    return max(1, min(triton.cdiv(V, 8 * block_v), triton.cdiv(4 * n_sm, tiles)))


def head_confidence(hidden: torch.Tensor, weight: torch.Tensor, suppress_token: int | None = None,
                    eps: float = 1e-10, entropy: bool = True, keep_logits: bool = False, num_splits: int | None = None,
                    tiles=None):
    """hidden [R, H], weight [V, H] (one dtype, last dims contiguous) -> HeadConfidence(token int64 [R], p_max,
    margin, neg_entropy (zeros when entropy=False), lse fp32 [R], finite bool [R], logits: the raw logits [R, V]
    in hidden.dtype with keep_logits, else None). num_splits / tiles (BLOCK_R, BLOCK_V, BLOCK_H): None = the
    launcher's choice (tests force both)."""
    R, H = hidden.shape
    V = weight.shape[0]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    dev = hidden.device
    out = head_confidence_outputs(R, dev)
    tok, p_max, margin, neg_entropy, lse, finite, _ = out
    store = entropy or keep_logits
    # the logits the stats pass writes (storage dtype): the entropy pass's input and / or the kept logits; a
    # 1-element stand-in when neither asks
    logits = torch.empty((R, V) if store else (1,), dtype=hidden.dtype, device=dev)
    if R == 0:
        return out._replace(logits=logits if keep_logits else None)
    BR, BV, BH = tiles or tiles_for(R, V, H, hidden.dtype)
    S, split, BLOCK_S = vs.split_layout(V, BV, num_splits_for(R, V, BR, BV) if num_splits is None else num_splits)
    pm1, pm2, ps = (torch.empty(R, S, dtype=torch.float32, device=dev) for _ in range(3))
    pi1, pfin = (torch.empty(R, S, dtype=torch.int32, device=dev) for _ in range(2))
    sup = -1 if suppress_token is None else int(suppress_token)
    has_sup = suppress_token is not None
    grid = (triton.cdiv(R, BR), S)
    _hc_stats_kernel[grid](
        hidden, weight, hidden.stride(0), weight.stride(0), R, V, H, split, sup, pm1, pi1, pm2, ps, pfin, logits,
        HAS_SUPPRESS=has_sup, BLOCK_R=BR, BLOCK_V=BV, BLOCK_H=BH, STORE_LOGITS=store, num_warps=NUM_WARPS,
    )
    _hc_merge_kernel[(R,)](pm1, pi1, pm2, ps, pfin, tok, p_max, margin, lse, finite.view(torch.int8), S,
                           BLOCK_S=BLOCK_S, num_warps=1)
    if entropy:
        pent = torch.empty(R, S, dtype=torch.float32, device=dev)
        _hc_entropy_kernel[grid](
            logits, R, V, split, sup, float(eps), lse, pent,
            HAS_SUPPRESS=has_sup, BLOCK_R=BR, BLOCK_V=BV, num_warps=NUM_WARPS,
        )
        neg_entropy = pent.sum(dim=1)  # split order: deterministic
    return out._replace(neg_entropy=neg_entropy, logits=logits if keep_logits else None)
