"""Triton `select_round`: a D2F / LoPA round's selection and bookkeeping after its token statistics, in ONE launch
of ONE program (the round is tiny: NB <= 16 slots, Nb window columns, G + 1 blocks, Lb + 1 positions; its cost
on a GPU is the ~277 launches of the torch ops it replaces, bench/results/projection.md, not arithmetic).

The semantics are lopa_fast/reference/ops.py::select_round (the oracle; csrc/select_round_cpu.cpp is a second,
sequential statement). Vectorised over padded power-of-two extents: BNB slots, BN window columns, BG blocks, BL row
positions. Stable sorts are ranks over composite keys (class: value / NaN / padding, then value, then index);
first-max ties are min-index reductions; NaN propagation of torch's max is explicit. The new rows go through
global memory (x_new) with a barrier between the phases that write and read them (one program: no other block
races). No host read, no allocation that depends on values: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 8
# reference.ops' block states (the kernel does not import the reference); constexpr so the jit may read them
ACTIVE, TO_CACHE, IN_CACHE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _order_key(v, cls, idx, DESCENDING: tl.constexpr):
    """A unique int64 key per column whose ascending order is the stable sort's order: class (bits 42+), then the
    value as an order-preserving 32-bit integer (bits 10..41; -0.0 folded into 0.0, equal as torch compares),
    then the column (bits 0..9; Nb < 1024). One compare per pair instead of a float / NaN / index expression:
    the rank's [BN, BN] matrix spilled at 8 warps on sm_90 with the expression (56 bytes)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648  # [0, 2^32)
    if DESCENDING:
        ordered = 4294967295 - ordered
    ordered = tl.where(v != v, 0, ordered)  # NaNs: their own class, by column
    return (cls.to(tl.int64) << 42) + (ordered << 10) + idx


@triton.jit
def _select_round_kernel(
    conf, token, p,
    x, n_blocks, block_state, complete, eos, alive, creation_conf, look_pos, counts,
    exists, active, running, is_mask, lens, to_cache, shared_end, layout_slot, commit_len,
    win_pos, win_valid, need_flat,
    prompt_len, gen_pos, block_start, block_end, pos_block, in_block, lowest_k, grow_table, activate_table,
    skip_threshold, alpha,
    o_winner, o_score, o_last_row, o_accepted, o_tokens, o_x, o_eos, o_alive, o_cconf, o_look, o_state, o_counts,
    p_nblk, p_complete, p_exists, p_active, p_running, p_done, p_ismask, p_need, p_lens, p_wl, p_tc,
    p_spe, p_lay, p_start, p_commit, p_head,
    NB: tl.constexpr, L1: tl.constexpr, G1: tl.constexpr, Nb: tl.constexpr, bs: tl.constexpr,
    mask_id: tl.constexpr, eos_id: tl.constexpr, n_look: tl.constexpr,
    SHIFT: tl.constexpr, BLEND: tl.constexpr, SCORE: tl.constexpr,
    BNB: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, BL: tl.constexpr,
):
    G: tl.constexpr = G1 - 1
    Lb: tl.constexpr = L1 - 1
    sl = tl.arange(0, BNB)  # slots
    ci = tl.arange(0, BN)  # window columns
    bj = tl.arange(0, BG)  # blocks
    qq = tl.arange(0, BL)  # row positions
    s_ok = sl < NB
    c_ok = ci < Nb
    j_ok = bj < G1
    q_ok = qq < L1
    ok2 = s_ok[:, None] & c_ok[None, :]

    # ---- select: the table row predicting each window column, per slot (the cumsum of need_flat, slot-major)
    need = tl.load(need_flat + sl[:, None] * Nb + ci[None, :], mask=ok2, other=0).to(tl.int32)  # int32: registers
    rowc = tl.cumsum(need, 1)
    rowtot = tl.sum(need, 1)
    csum = rowc + (tl.cumsum(rowtot, 0) - rowtot)[:, None]  # [BNB, BN] 1-based rank of each needed raw row
    if SHIFT:
        sidx = tl.where(ci[None, :] == 0, 0, csum - need)  # the previous column's csum; row 0 at column 0
    else:
        sidx = tl.maximum(csum - 1, 0)
    wpos = tl.load(win_pos + ci, mask=c_ok, other=Lb)
    wval = tl.load(win_valid + ci, mask=c_ok, other=0) != 0
    masked = (tl.load(is_mask + sl[:, None] * L1 + wpos[None, :], mask=ok2, other=0) != 0) & wval[None, :] & ok2

    W = tl.zeros((), tl.int64)
    if NB == 1 and not SCORE:
        tl.store(o_score + sl, tl.zeros((BNB,), tl.float64), mask=s_ok)
    else:
        m = tl.sum(masked.to(tl.int64), 1)
        kk = tl.load(lowest_k + m, mask=s_ok, other=1)
        low = tl.zeros((BNB,), tl.float32)
        for b in range(NB):  # per slot: the sum of its lowest kk keys, ascending and stable (NaN last)
            rb = (sl == b)[:, None]
            mb = tl.sum(tl.where(rb & masked, 1, 0), 0) > 0
            v = tl.load(conf + tl.sum(tl.where(rb, sidx, 0), 0), mask=mb, other=float("inf"))  # row b's keys
            v = tl.where(c_ok, v, 0.0)
            cls = tl.where(c_ok, tl.where(v != v, 1, 0), 2)  # 0: a value, 1: NaN, 2: padding
            key = _order_key(v, cls, ci, False)
            kb = tl.sum(tl.where(sl == b, kk, 0), 0)
            # the kb-th smallest key (keys are unique: exactly kb columns at or below it); a bitonic sort, not a
            # [BN, BN] rank matrix (it spilled on sm_90 at Nb = 256)
            kth = tl.sum(tl.where(ci == kb - 1, tl.sort(key), 0), 0)
            sb = tl.sum(tl.where((key <= kth) & c_ok, v.to(tl.float64), 0.0), 0)
            lb = tl.math.div_rn(sb.to(tl.float32), kb.to(tl.float32))
            low = tl.where(sl == b, lb, low)
        future = tl.where(m > 0, low.to(tl.float64), 1.0)
        if BLEND:
            a = tl.load(alpha)
            cc = tl.load(creation_conf + sl, mask=s_ok, other=1.0)
            score = a * cc + (1.0 - a) * future
        else:
            score = future
        ln = tl.load(lens + sl, mask=s_ok, other=0)
        score = tl.where(ln <= tl.load(shared_end), 1.0, score)
        tl.store(o_score + sl, score, mask=s_ok)
        run = tl.load(running + sl, mask=s_ok, other=0) != 0
        keyw = tl.where(run & s_ok, score, float("-inf"))
        isn = (keyw != keyw) & s_ok
        best = tl.max(tl.where(isn, float("-inf"), keyw), 0)
        hit = (keyw == best) & s_ok & (tl.sum(isn.to(tl.int32), 0) == 0)
        W = tl.minimum(tl.min(tl.where(hit, sl, NB), 0), NB - 1).to(tl.int64)
    tl.store(o_winner, W)
    if SHIFT:
        cl = tl.maximum(tl.load(commit_len) - 1, 0)
        last_row = tl.sum(tl.sum(tl.where((sl[:, None] == W) & (ci[None, :] == cl) & ok2, csum, 0), 1), 0)
    else:
        last_row = tl.zeros((), tl.int64)
    tl.store(o_last_row, last_row.to(tl.int64))

    # ---- the D2F fill rule on the winner only
    rW = (sl == W)[:, None] & ok2
    sW = tl.sum(tl.where(rW, sidx, 0), 0)
    mW = tl.sum(tl.where(rW & masked, 1, 0), 0) > 0
    cW = tl.load(conf + sW, mask=c_ok, other=0.0)
    tokW = tl.load(token + sW, mask=c_ok, other=0)
    pW = tl.load(p + sW, mask=c_ok, other=0.0)
    tl.store(o_tokens + ci, tokW, mask=c_ok)
    actWb = tl.load(active + W * G1 + bj, mask=j_ok, other=0) != 0
    pb = tl.minimum(tl.load(pos_block + wpos, mask=c_ok, other=0), G)
    candW = mW & (tl.load(active + W * G1 + pb, mask=c_ok, other=0) != 0) & c_ok
    tau = tl.load(skip_threshold).to(tl.float32)  # the knob rounded to p's float32, as torch compares
    thr = candW & (pW > tau)
    ok_cj = c_ok[:, None] & j_ok[None, :]
    onehot = (tl.load(in_block + wpos[:, None] * G1 + bj[None, :], mask=ok_cj, other=0) != 0) & ok_cj
    cand_b = candW[:, None] & onehot
    key = tl.where(cand_b, cW[:, None], float("-inf"))
    knan = tl.sum((key != key).to(tl.int32), 0) > 0  # torch's max is NaN then: no column equals it
    bestb = tl.max(tl.where(key != key, float("-inf"), key), 0)
    firstpos = tl.min(tl.where(cand_b & (key == bestb[None, :]) & ~knan[None, :], ci[:, None], Nb), 0)
    compW = tl.load(complete + W * G1 + bj, mask=j_ok, other=0) != 0
    any_c = tl.sum(cand_b.to(tl.int32), 0) > 0
    any_t = tl.sum((thr[:, None] & onehot).to(tl.int32), 0) > 0
    need_fb = compW & actWb & any_c & ~any_t & j_ok
    fb = tl.sum(((firstpos[None, :] == ci[:, None]) & need_fb[None, :]).to(tl.int32), 1) > 0
    fb = fb & c_ok
    accW = thr | fb
    tl.store(o_accepted + ci, accW.to(tl.uint8), mask=c_ok)
    if eos_id >= 0:
        eos_hit = accW & (tokW == eos_id)
    else:
        eos_hit = accW & False
    eosW = (tl.load(eos + W) != 0) | (tl.sum(eos_hit.to(tl.int32), 0) > 0)
    alv = tl.load(alive + sl, mask=s_ok, other=0) != 0
    nA = tl.sum(alv.to(tl.int64), 0)
    n_acc = tl.sum(accW.to(tl.int64), 0)
    if NB == 1:
        multi = (n_acc >= 2).to(tl.int64)
        look_win = tl.zeros((), tl.int64)
        grew = tl.zeros((), tl.int64)
    else:
        look_win = (W != nA - 1).to(tl.int64)  # the anchor is the last alive slot
        grew = (tl.load(lens + W) != tl.load(lens + tl.load(layout_slot))).to(tl.int64)
        multi = ((n_acc + look_win) >= 2).to(tl.int64)
    k8 = tl.arange(0, 8)
    delta = tl.where(k8 == 0, tl.sum(thr.to(tl.int64), 0), 0)
    delta = tl.where(k8 == 1, tl.sum(fb.to(tl.int64), 0), delta)
    delta = tl.where(k8 == 2, tl.sum(eos_hit.to(tl.int64), 0), delta)
    delta = tl.where(k8 == 3, multi, delta)
    delta = tl.where(k8 == 4, look_win, delta)
    delta = tl.where(k8 == 6, grew, delta)
    tl.store(o_counts + k8, tl.load(counts + k8) + delta)

    # ---- every new row starts as the winner's row after the fill (through global memory: barriers between)
    xW = tl.load(x + W * L1 + qq, mask=q_ok, other=0)
    for b in range(NB):  # row by row: a [BNB, BL] int64 tile spilled on sm_90 (Lb + 1 = 513)
        tl.store(o_x + b * L1 + qq, xW, mask=q_ok)
    tl.debug_barrier()
    tl.store(o_x + sl[:, None] * L1 + wpos[None, :], tl.broadcast_to(tokW[None, :], (BNB, BN)),
             mask=s_ok[:, None] & accW[None, :])
    tl.debug_barrier()

    # ---- the winner's completed blocks (upstream's base_completed_blocks), from row 0 before the spawn
    mcW = tl.zeros((BG,), tl.int64)
    jg = tl.maximum(bj - 1, 0)
    for t in range(bs):
        gp = tl.load(gen_pos + jg * bs + t, mask=(bj >= 1) & j_ok, other=0)
        mcW += ((tl.load(o_x + gp, mask=(bj >= 1) & j_ok, other=0) == mask_id) & (bj >= 1)).to(tl.int64)
    base_done = actWb & (mcW == 0)
    tl.debug_barrier()

    # ---- spawn: lookaheads at the winner's top-n_look remaining masks (conf descending, stable, NaN first)
    eos_new = tl.broadcast_to(eosW, (BNB,))
    cconf = tl.full((BNB,), 1.0, tl.float64)
    lookp = tl.full((BNB,), -1, tl.int64)
    n_valid = tl.zeros((), tl.int64)
    if n_look > 0:
        rest = candW & ~accW
        kl = tl.where(rest, cW, float("-inf"))
        cls = tl.where(c_ok, tl.where(kl != kl, 0, 1), 2)  # 0: NaN, 1: a value, 2: padding
        srt = tl.sort(_order_key(kl, cls, ci, True))
        # slot r < n_look takes the column of the r-th key (the low 10 bits)
        col = tl.sum(tl.where(ci[:, None] == sl[None, :], srt[:, None] & 1023, 0), 0)  # [BNB]
        sel = (col[None, :] == ci[:, None]) & (sl[None, :] < n_look) & (sl[None, :] < Nb) & c_ok[:, None]
        valid = tl.sum((sel & rest[:, None]).to(tl.int32), 0) > 0
        lpos = tl.sum(tl.where(sel, wpos[:, None], 0), 0)
        ltok = tl.sum(tl.where(sel, tokW[:, None], 0), 0)
        lc = tl.sum(tl.where(sel, cW[:, None], 0.0), 0)
        n_valid = tl.sum(valid.to(tl.int64), 0)
        tl.store(o_x + sl * L1 + lpos, ltok, mask=valid)
        cconf = tl.where(valid, lc.to(tl.float64), cconf)
        if eos_id >= 0:
            eos_new = eos_new | (valid & (ltok == eos_id))
        lookp = tl.where(valid, lpos, lookp)
    tl.store(o_eos + sl, eos_new.to(tl.uint8), mask=s_ok)
    tl.store(o_cconf + sl, cconf, mask=s_ok)
    tl.store(o_look + sl, lookp, mask=s_ok)
    alive_new = (sl <= n_valid) & s_ok
    tl.store(o_alive + sl, alive_new.to(tl.uint8), mask=s_ok)

    # ---- new block tables: the cached span -> in_cache; the anchor rule's completions -> to_cache in order
    st = tl.load(block_state + bj, mask=j_ok, other=IN_CACHE)
    tcin = tl.load(to_cache + bj, mask=j_ok, other=0) != 0
    st = tl.where(tcin, IN_CACHE, st)
    exW = tl.load(exists + W * G1 + bj, mask=j_ok, other=0) != 0
    act = exW & (st == ACTIVE) & j_ok
    retire = act & base_done
    chain = tl.cumsum((~(~act | retire)).to(tl.int32), 0) == 0
    st = tl.where(retire & chain, TO_CACHE, st)
    tl.store(o_state + bj, st, mask=j_ok)
    tl.debug_barrier()

    # ---- plan_round on the new state
    nblk = tl.broadcast_to(tl.load(n_blocks + W), (BNB,))
    okj = s_ok[:, None] & j_ok[None, :]
    mc = tl.zeros((BNB, BG), tl.int64)  # masks of block j
    mcp = tl.zeros((BNB, BG), tl.int64)  # masks of block j - 1
    jp = tl.maximum(bj - 2, 0)
    for t in range(bs):
        g1 = tl.load(gen_pos + jg * bs + t, mask=(bj >= 1) & j_ok, other=0)
        g0 = tl.load(gen_pos + jp * bs + t, mask=(bj >= 2) & j_ok, other=0)
        x1 = tl.load(o_x + sl[:, None] * L1 + g1[None, :], mask=okj, other=0)
        x0 = tl.load(o_x + sl[:, None] * L1 + g0[None, :], mask=okj, other=0)
        mc += ((x1 == mask_id) & (bj >= 1)[None, :]).to(tl.int64)
        mcp += ((x0 == mask_id) & (bj >= 2)[None, :]).to(tl.int64)
    last_mc = tl.sum(tl.where(bj[None, :] == nblk[:, None], mc, 0), 1)
    gt = tl.load(grow_table + last_mc, mask=s_ok, other=0) != 0
    grow = alive_new & (nblk < G) & ~eos_new & gt
    nblk = nblk + grow.to(tl.int64)
    tl.store(p_nblk + sl, nblk, mask=s_ok)
    ex = (bj[None, :] <= nblk[:, None]) & okj
    compWr = tl.load(complete + W * G1 + bj, mask=j_ok, other=0) != 0
    at = tl.load(activate_table + mcp, mask=okj, other=0) != 0
    comp = compWr[None, :] | ((bj >= 1)[None, :] & at & ex)
    act2 = ex & (st == ACTIVE)[None, :]
    off2 = sl[:, None] * G1 + bj[None, :]
    tl.store(p_exists + off2, ex.to(tl.uint8), mask=okj)
    tl.store(p_complete + off2, comp.to(tl.uint8), mask=okj)
    tl.store(p_active + off2, act2.to(tl.uint8), mask=okj)
    P = tl.load(prompt_len)
    ln = P + nblk * bs
    tl.store(p_lens + sl, ln, mask=s_ok)
    has_act = tl.sum(act2.to(tl.int32), 1) > 0
    any_m = tl.zeros((BNB,), tl.int32)
    for b in range(NB):  # row by row (the [BNB, BL] tiles spilled): the masks of the new rows
        ab = tl.sum(tl.where((sl == b) & alive_new, 1, 0), 0) > 0
        lb = tl.sum(tl.where(sl == b, ln, 0), 0)
        xn = tl.load(o_x + b * L1 + qq, mask=q_ok, other=0)
        ism = (xn == mask_id) & (qq < lb) & ab & q_ok
        tl.store(p_ismask + b * L1 + qq, ism.to(tl.uint8), mask=q_ok)
        any_m = tl.where(sl == b, tl.sum(ism.to(tl.int32), 0), any_m)
    done = alive_new & (any_m == 0) & ~has_act
    rem = alive_new & ~done
    tl.store(p_done + sl, done.to(tl.uint8), mask=s_ok)
    tl.store(p_running + sl, rem.to(tl.uint8), mask=s_ok)
    lead = tl.sum(((tl.cumsum(((st == ACTIVE) | ~j_ok).to(tl.int32), 0) == 0) & j_ok).to(tl.int64), 0)
    spe = tl.load(block_end + lead - 1)
    tc = (st == TO_CACHE) & j_ok
    tl.store(p_tc + bj, tc.to(tl.uint8), mask=j_ok)
    has_tc = tl.sum(tc.to(tl.int32), 0) > 0
    bst = tl.load(block_start + bj, mask=j_ok, other=0)
    ben = tl.load(block_end + bj, mask=j_ok, other=0)
    s = tl.where(has_tc, tl.min(tl.where(tc, bst, Lb), 0), spe)
    u = tl.where(has_tc, tl.max(tl.where(tc, ben, 0), 0) - s, 0)
    wl = ln - s
    tl.store(p_wl + sl, wl, mask=s_ok)
    n = tl.max(tl.where(s_ok, tl.where(rem, wl, 0), -(2**62)), 0)
    nA = tl.sum(alive_new.to(tl.int64), 0)  # the new round's alive count (the winner's spawn)
    first_rem = tl.min(tl.where(rem, sl, NB - 1), 0)
    rem_last = tl.sum(tl.where((sl == nA - 1) & rem, 1, 0), 0) > 0
    lay = tl.where(rem_last, nA - 1, first_rem).to(tl.int64)
    ragged = tl.sum(((tl.where(alive_new, wl, n) != n) & s_ok).to(tl.int64), 0) > 0
    tl.debug_barrier()  # p_ismask written above is read back below
    R = tl.zeros((), tl.int64)
    last = (qq == s + u - 1) & (u > 0)
    for b in range(NB):
        ab = tl.sum(tl.where((sl == b) & alive_new, 1, 0), 0) > 0
        if SHIFT:  # row q predicts q + 1: needed when q + 1 is a mask, or q is the last cached position
            ism1 = tl.load(p_ismask + b * L1 + qq + 1, mask=qq + 1 < L1, other=0) != 0
            nd = (ism1 | last) & ab & (qq >= s) & q_ok
        else:
            nd = tl.load(p_ismask + b * L1 + qq, mask=q_ok, other=0) != 0
        tl.store(p_need + b * L1 + qq, nd.to(tl.uint8), mask=q_ok)
        R += tl.sum(nd.to(tl.int64), 0)
    tl.store(p_spe, spe)
    tl.store(p_lay, lay)
    tl.store(p_start, s)
    tl.store(p_commit, u)
    h7 = tl.arange(0, 8)
    head = tl.where(h7 == 0, (tl.sum(rem.to(tl.int32), 0) == 0).to(tl.int64), 0)
    head = tl.where(h7 == 1, nA, head)
    head = tl.where(h7 == 2, s, head)
    head = tl.where(h7 == 3, u, head)
    head = tl.where(h7 == 4, n, head)
    head = tl.where(h7 == 5, R, head)
    head = tl.where(h7 == 6, ragged.to(tl.int64), head)
    tl.store(p_head + h7, head, mask=h7 < 7)


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(int(n)))


def select_round(args, outs, *, bs: int, mask_id: int, eos_id: int, n_look: int, shift: bool, blend: bool,
                 score_all: bool) -> list[torch.Tensor]:
    """Launch the kernel on checked `args` (reference.ops.select_round's 35 tensors, in order) into `outs` (the 28
    `SelectRound` fields, fresh and contiguous; ops.select_round._outputs). Bool tensors travel as uint8 views."""
    x = args[3]
    NB, L1 = x.shape
    G1 = args[5].shape[0]
    Nb = args[21].shape[0]
    if Nb >= 1024 or NB > 16:
        raise ValueError(f"select_round (triton): window columns Nb={Nb}, slots NB={NB}; allowed: Nb < 1024 (the "
                         "sort key's column bits), NB <= 16")

    def v(t):
        t = t if t.is_contiguous() else t.contiguous()
        return t.view(torch.uint8) if t.dtype == torch.bool else t

    _select_round_kernel[(1,)](
        *[v(t) for t in args], *[v(t) for t in outs],
        NB=NB, L1=L1, G1=G1, Nb=Nb, bs=bs, mask_id=mask_id, eos_id=eos_id, n_look=n_look,
        SHIFT=bool(shift), BLEND=bool(blend), SCORE=bool(score_all),
        BNB=_p2(NB), BN=_p2(Nb), BG=_p2(G1), BL=_p2(L1), num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # the blend's a * c + (1 - a) * f stays two roundings, as the reference's
    )
    return outs
