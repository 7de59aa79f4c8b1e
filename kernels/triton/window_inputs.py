"""Triton `window_inputs`: a D2F / LoPA round's forward inputs on its bucket (the window's positions, every slot's
tokens and needed LM-head rows, the window lengths, the flat rows of the head in the stable order, the two LoPA
counters that read the plan) in ONE launch of ONE program: ~20 small torch ops of a captured round before.

The semantics are lopa_fast/reference/ops.py::window_inputs (integers and booleans only: exact by construction);
csrc/window_inputs_cpu.cpp states the same sequentially. The stable partition of the flat rows (needed ones first,
each part ascending) is two prefix counts over the [NB, Nb] tile in row-major order. No host read, no
value-dependent allocation: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4


@triton.jit
def _window_inputs_kernel(x, need_all, alive, window_lens, running, lens, layout_slot, counts, start, total_len,
                          pos_block, o_pos, o_valid, o_tokens, o_block, o_wl, o_need, o_rows, o_counts,
                          NB: tl.constexpr, L1: tl.constexpr, Nb: tl.constexpr, Rb: tl.constexpr,
                          BLOCKS: tl.constexpr, BNB: tl.constexpr, BN: tl.constexpr):
    c = tl.arange(0, BN)
    c_ok = c < Nb
    p = tl.load(start) + c
    valid = p < tl.load(total_len)
    wpos = tl.where(valid, p, L1 - 1)  # padding columns read / write the trash column
    tl.store(o_pos + c, wpos, mask=c_ok)
    tl.store(o_valid + c, valid.to(tl.uint8), mask=c_ok)
    if BLOCKS:
        tl.store(o_block + c, tl.load(pos_block + wpos, mask=c_ok, other=0), mask=c_ok)
    b = tl.arange(0, BNB)
    b_ok = b < NB
    al = (tl.load(alive + b, mask=b_ok, other=0) != 0) & b_ok
    tl.store(o_wl + b, tl.where(al, tl.load(window_lens + b, mask=b_ok, other=0), Nb), mask=b_ok)
    k8 = tl.arange(0, 8)
    cnt = tl.load(counts + k8)
    if NB > 1:  # the LoPA-only counters that read the plan
        run = (tl.load(running + b, mask=b_ok, other=0) != 0) & b_ok
        lay_len = tl.load(lens + tl.load(layout_slot))
        split = tl.sum((run & (tl.load(lens + b, mask=b_ok, other=0) != lay_len)).to(tl.int64), 0) > 0
        n_run = tl.sum(run.to(tl.int64), 0)
        cnt = tl.where(k8 == 5, cnt + split.to(tl.int64), cnt)
        cnt = tl.where(k8 == 7, tl.maximum(cnt, n_run), cnt)
    tl.store(o_counts + k8, cnt)
    ok = b_ok[:, None] & c_ok[None, :]
    tok = tl.load(x + b[:, None] * L1 + wpos[None, :], mask=ok, other=0)
    nd = (tl.load(need_all + b[:, None] * L1 + wpos[None, :], mask=ok, other=0) != 0) & valid[None, :] & ok
    flat = b[:, None] * Nb + c[None, :]
    tl.store(o_tokens + flat, tok, mask=ok)
    tl.store(o_need + flat, nd.to(tl.uint8), mask=ok)
    # rows: row-major order of the tile is the flat order; needed rows first, then the others, each ascending
    nd1 = tl.reshape(nd, [BNB * BN]).to(tl.int32)
    ok1 = tl.reshape(ok, [BNB * BN]).to(tl.int32)
    f1 = tl.reshape(flat, [BNB * BN])
    other1 = ok1 - nd1
    n_need = tl.sum(nd1, 0)
    rank = tl.where(nd1 != 0, tl.cumsum(nd1, 0) - 1, n_need + tl.cumsum(other1, 0) - 1)
    tl.store(o_rows + rank, f1.to(tl.int64), mask=(ok1 != 0) & (rank < Rb))


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(int(n)))


def window_inputs(args, outs, *, Nb: int, Rb: int, blocks: bool) -> list[torch.Tensor]:
    """Launch the kernel on checked `args` (reference.ops.window_inputs' 11 tensors, in order) into `outs` (the 8
    `WindowInputs` fields, fresh and contiguous). Bool tensors travel as uint8 views."""
    x = args[0]
    NB, L1 = x.shape

    def v(t):
        t = t if t.is_contiguous() else t.contiguous()
        return t.view(torch.uint8) if t.dtype == torch.bool else t

    _window_inputs_kernel[(1,)](*[v(t) for t in args], *[v(t) for t in outs], NB=NB, L1=L1, Nb=Nb, Rb=Rb,
                                BLOCKS=bool(blocks), BNB=_p2(NB), BN=_p2(Nb), num_warps=NUM_WARPS)
    return outs
