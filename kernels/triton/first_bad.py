"""Triton `first_bad`: the fused LM head's numerics guard as ONE launch (its torch form is ~8 graph nodes a round:
arange, lt, not, and, any, where, min, where).

out = rows[r] of the first of the n_real real rows r whose ok[r] is False, else -1: one program walks the rows in
tiles of BLOCK, keeping the running minimum of rows[r] over the bad rows (rows ascend over the real rows, so the
minimum is the first one's; `none` is above every flat row). Matches lopa_fast.reference.ops.first_bad (exact:
integer minimum).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # rows a step (a LoPA k = 8 round has ~300 LM-head rows; the largest bucket 9 x 256 = 2,304)


@triton.jit
def _first_bad_kernel(ok_ptr, rows_ptr, n_ptr, out_ptr, R, n_int, none, N_PTR: tl.constexpr, BLOCK: tl.constexpr):
    if N_PTR:  # the real row count from the device (a captured round): no host read
        n = tl.load(n_ptr).to(tl.int64)
    else:
        n = n_int.to(tl.int64)
    first = tl.full((), none, tl.int64)
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        m = r < R
        ok = tl.load(ok_ptr + r, mask=m, other=1)
        rows = tl.load(rows_ptr + r, mask=m, other=none)
        bad = m & (r.to(tl.int64) < n) & (ok == 0)
        first = tl.minimum(first, tl.min(tl.where(bad, rows, none), axis=0))
    tl.store(out_ptr, tl.where(first < none, first, -1))


def first_bad(ok: torch.Tensor, rows: torch.Tensor, n_real, none: int) -> torch.Tensor:
    """ok [R] bool, rows [R] int64 (contiguous), n_real an int or a 0-d int tensor on ok's device -> 0-d int64."""
    out = torch.empty((), dtype=torch.long, device=ok.device)
    R = ok.shape[0]
    n_ptr = torch.is_tensor(n_real)
    okb = ok.contiguous().view(torch.uint8)
    _first_bad_kernel[(1,)](
        okb, rows.contiguous(), n_real if n_ptr else okb, out, R, 0 if n_ptr else int(n_real), int(none),
        N_PTR=n_ptr, BLOCK=min(BLOCK, max(16, triton.next_power_of_2(max(R, 1)))), num_warps=4,
    )
    return out
