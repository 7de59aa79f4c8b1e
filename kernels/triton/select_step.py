"""Triton `select_step`: a threshold step's selection and bookkeeping after its token statistics, in ONE launch of
ONE program (n rows: a block's candidates, tens; the canvas L positions in chunks). On a GPU the step's selection
is ~30 torch ops (graph nodes of a captured step); here it is one.

The semantics are lopa_fast/reference/ops.py::select_step (the oracle; csrc/select_step_cpu.cpp is a sequential
statement of the same). Rows are vectorised over a padded power-of-two extent BN; the factor rule's stable
descending sort is a rank from a [BN, BN] pairwise comparison (NaN above every number, ties by row); first-max /
first-min ties are min-index reductions with torch's NaN propagation made explicit. The canvas is copied, the
commit scattered, and (after a barrier: one program, so no other block races) the first mask, the masks left and
the block-full flag read back. No host read, no value-dependent allocation: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4
BLOCK_L = 1024  # canvas positions per chunk
# reference.ops.STEP_RULES' order (the kernel does not import the reference); constexpr so the jit may read them
THRESHOLD, ENTROPY, FACTOR, FIRST = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _select_step_kernel(x, pos, valid, x0, conf, ent, finite, multi, noop, s, knob,
                        o_x, o_fm, o_multi, o_noop, o_head,
                        L, n, RULE: tl.constexpr, mask_id: tl.constexpr, B: tl.constexpr, BB: tl.constexpr,
                        BN: tl.constexpr, BLK: tl.constexpr):
    r = tl.arange(0, BN)
    r_ok = r < n
    BIG: tl.constexpr = 1 << 30
    p = tl.load(pos + r, mask=r_ok, other=0)
    p_c = tl.minimum(p, L - 1)
    val = (tl.load(valid + r, mask=r_ok, other=0) != 0) & r_ok
    cand = val & (tl.load(x + p_c, mask=r_ok, other=mask_id + 1) == mask_id)
    fin = tl.load(finite + r, mask=r_ok, other=1) != 0
    if RULE == FIRST:
        read = val
    else:
        read = cand
    first_bad = tl.min(tl.where(read & ~fin, r, BIG), 0)
    bad_row = tl.where(first_bad == BIG, -1, first_bad).to(tl.int64)
    n_cand = tl.sum(cand.to(tl.int32), 0)

    if RULE == FIRST:
        sel = val
    elif RULE == FACTOR:
        cf = tl.load(conf + r, mask=r_ok, other=0.0)
        c = tl.where(cand, cf, float("-inf"))
        ci = c[:, None]
        cj = c[None, :]
        nan_i = ci != ci
        nan_j = cj != cj
        gt = (nan_j & ~nan_i) | (cj > ci)
        eq = (nan_j & nan_i) | (cj == ci)
        before = gt | (eq & (r[None, :] < r[:, None]))
        rank = tl.sum(before.to(tl.int32), 1)  # [BN]: row i's place in the stable descending sort
        # the first rank b < n_cand whose value (float64) is under 1 - f / (b + 2) (rank 0: -1), else n_cand
        f = tl.load(knob)
        k = rank.to(tl.float64)
        th = tl.where(rank == 0, -1.0, 1.0 - (1.0 / (k + 2.0)) * f)
        viol = (c.to(tl.float64) < th) & (rank < n_cand) & r_ok
        b = tl.min(tl.where(viol, rank, BIG), 0)
        b = tl.where(b == BIG, n_cand, b)
        count = tl.where(b < n_cand - 1, b, n_cand)
        sel = cand & (rank < count)
    else:
        if RULE == ENTROPY:
            e = tl.load(ent + r, mask=r_ok, other=0.0)
            v = tl.where(cand, e, float("inf"))
            best = tl.min(v, 0)
            keep = cand & ~(e > tl.load(knob))
        else:
            cf = tl.load(conf + r, mask=r_ok, other=0.0)
            v = tl.where(cand, cf, float("-inf"))
            best = tl.max(v, 0)
            keep = cand & ~(cf < tl.load(knob).to(cf.dtype))  # tau in conf's dtype, as torch compares them
        v_nan = (v != v) & r_ok
        first_nan = tl.min(tl.where(v_nan, r, BIG), 0)
        first_best = tl.min(tl.where((v == best) & r_ok, r, BIG), 0)
        first = tl.where(first_nan < BIG, first_nan, first_best)
        sel = (keep | ((r == first) & cand)) & (n_cand > 0)

    m = tl.load(multi)
    z = tl.load(noop)
    if RULE != FIRST:
        n_sel = tl.sum((sel & r_ok).to(tl.int32), 0)
        m += (n_sel >= 2).to(tl.int64)
        z += (n_sel == 0).to(tl.int64)
    tl.store(o_multi, m)
    tl.store(o_noop, z)

    # the commit: the canvas copied, then the selected rows' tokens at their positions
    q = tl.arange(0, BLK)
    for q0 in range(0, L, BLK):
        qo = q0 + q
        tl.store(o_x + qo, tl.load(x + qo, mask=qo < L), mask=qo < L)
    tl.debug_barrier()
    w = sel & val
    tl.store(o_x + p_c, tl.load(x0 + r, mask=w, other=0), mask=w)
    tl.debug_barrier()  # the new canvas is read back below
    fm = L + tl.zeros((), tl.int64)
    masks = tl.zeros((), tl.int64)
    for q0 in range(0, L, BLK):
        qo = q0 + q
        is_m = (tl.load(o_x + qo, mask=qo < L, other=mask_id + 1) == mask_id) & (qo < L)
        fm = tl.minimum(fm, tl.min(tl.where(is_m, qo, L).to(tl.int64), 0))
        masks += tl.sum(is_m.to(tl.int64), 0)
    full = tl.zeros((), tl.int64)
    if B > 0:
        jb = tl.arange(0, BB)
        blk = tl.minimum(tl.load(s) + jb, L - 1)
        in_blk = (tl.load(o_x + blk, mask=jb < B, other=mask_id + 1) == mask_id) & (jb < B)
        full = (tl.sum(in_blk.to(tl.int32), 0) == 0).to(tl.int64)
    tl.store(o_fm, fm)
    h = tl.arange(0, 4)
    head = tl.where(h == 0, bad_row, tl.where(h == 1, full, tl.where(h == 2, fm, masks)))
    tl.store(o_head + h, head)


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(int(n)))


def select_step(args, outs, *, rule_index: int, mask_id: int, B: int) -> list[torch.Tensor]:
    """Launch the kernel on checked `args` (reference.ops.select_step's 11 tensors, in order) into `outs` (the 5
    `SelectStep` fields, fresh and contiguous). Bool tensors travel as uint8 views."""
    n = args[1].numel()
    if n > 1024 or n < 1 or B > 4096:
        raise ValueError(f"select_step (triton): rows n={n}, block B={B}; allowed: 1 <= n <= 1024 (the factor rule's "
                         "[n, n] rank), B <= 4096")

    def v(t):
        t = t if t.is_contiguous() else t.contiguous()
        return t.view(torch.uint8) if t.dtype == torch.bool else t

    _select_step_kernel[(1,)](
        *[v(t) for t in args], *outs, args[0].numel(), n, RULE=rule_index, mask_id=mask_id, B=B, BB=_p2(B), BN=_p2(n),
        BLK=min(BLOCK_L, _p2(args[0].numel())), num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # the factor rule's 1 - (1 / (b + 2)) * f stays two roundings, as the reference's
    )
    return outs
