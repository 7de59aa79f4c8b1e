"""first_bad (the fused head's numerics guard): the Triton kernel (interpreter on CPU) equals the reference exactly on
random rows, n_real as an int or a device tensor, empty and all-bad cases; bad inputs raise; the custom op compiles
without a graph break; the captured round takes it (one op, not ~8)."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE


@pytest.mark.parametrize("R", [1, 7, 300, 2500])
def test_kernel_equals_reference(R):
    g = torch.Generator().manual_seed(R)
    for trial in range(6):
        ok = (torch.rand(R, generator=g) > (0.02 if trial % 2 else 0.5)).to(DEVICE)
        if trial == 5:
            ok[:] = False
        real = torch.sort(torch.randperm(4 * R, generator=g)[:R]).values  # real rows ascend; the padding rows after
        rows = real.to(DEVICE)
        for n in sorted({0, 1, R // 3, R}):
            for n_real in (n, torch.tensor(n, device=DEVICE)):
                got = ops.first_bad(ok, rows, n_real, 4 * R, backend="triton")
                assert got.shape == () and got.dtype == torch.long
                assert int(got) == int(ref.first_bad(ok, rows, n_real, 4 * R)), (R, trial, n)


def test_bad_inputs_raise():
    ok, rows = torch.ones(4, dtype=torch.bool), torch.arange(4)
    with pytest.raises(ValueError, match=r"ok must be a \[R\] bool"):
        ops.first_bad(ok.long(), rows, 4, 9)
    with pytest.raises(ValueError, match=r"rows must be a \[R=4\] long"):
        ops.first_bad(ok, rows[:3], 4, 9)
    with pytest.raises(ValueError, match="n_real=-1"):
        ops.first_bad(ok, rows, -1, 9)
    with pytest.raises(ValueError, match="0-d int tensor"):
        ops.first_bad(ok, rows, torch.tensor([4]), 9)
    with pytest.raises(ValueError, match="none=None"):
        ops.first_bad(ok, rows, 4, None)


def test_custom_op_opcheck_and_compile():
    ok = torch.tensor([True, False, True, False])
    rows = torch.tensor([2, 5, 7, 9])
    n = torch.tensor(3)
    torch.library.opcheck(torch.ops.lopa_fast.triton_first_bad.default, (ok, rows, n, 0, 10))
    torch.library.opcheck(torch.ops.lopa_fast.triton_first_bad.default, (ok, rows, None, 1, 10))

    def guard(ok, rows, n):
        return ops.first_bad(ok, rows, n, 10, check=False, backend="triton") + 1

    assert int(torch.compile(guard, backend="aot_eager", fullgraph=True)(ok, rows, n)) == 6
