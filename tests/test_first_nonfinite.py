"""first_nonfinite (the D2F / LoPA round's numerics guard): the C++ kernel returns the reference's value (an index
or -1) on every case; auto picks it for float32 CPU logits; the round refuses NaN / inf through it."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref


def _case(seed: int):
    """Random logits rows with NaN / +inf / -inf planted in some rows, rows ordered as window_inputs orders them
    (needed rows first, ascending, then the rest), an n_real at or below R, a temperature (none / float / knob)."""
    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, 10, (1,), generator=g))
    V = [2, 64, 1000][seed % 3]
    wide = torch.randn(R, V + 3, generator=g) * 5
    logits = wide[:, :V] if seed % 2 else wide[:, :V].contiguous()  # a row stride of V + 3, or V
    for r in range(R):
        kind = int(torch.randint(0, 6, (1,), generator=g))
        j = int(torch.randint(0, V, (1,), generator=g))
        if kind < 3:
            logits[r, j] = (float("nan"), float("inf"), float("-inf"))[kind]
        elif kind == 3:
            logits[r, j] = 3e38  # finite; overflows at T < 1
    need = torch.randint(0, 2, (R,), generator=g).bool()
    flat = torch.arange(R) * 3 + 1
    rows = torch.cat([flat[need], flat[~need]])
    n_real = int(need.sum())
    temperature = [0.0, 0.5, 2.0, torch.tensor(0.7, dtype=torch.float64)][seed % 4]
    return logits, rows, n_real, 3 * R + 5, temperature


@pytest.mark.parametrize("seed", range(48))
def test_cpp_kernel_is_the_reference(seed):
    logits, rows, n_real, none, t = _case(seed)
    for n in (n_real, torch.tensor(n_real), logits.shape[0], 0):
        want = ref.first_nonfinite(logits, rows, n, none, t)
        got = ops.first_nonfinite(logits, rows, n, none, t, backend="cpp")
        assert got.dtype == torch.long and got.dim() == 0 and int(got) == int(want), (n, t)


def test_auto_backend_and_refusals():
    cpu = torch.device("cpu")
    assert _backend.resolve("first_nonfinite", None, cpu) == "cpp"
    x = torch.randn(3, 8, dtype=torch.float64)
    x[1, 2] = float("inf")
    rows = torch.arange(3)
    assert int(ops.first_nonfinite(x, rows, 3, 9)) == 1  # auto: float64 goes to the torch backend
    with pytest.raises(TypeError, match="backend='cpp'; allowed: float32"):
        ops.first_nonfinite(x, rows, 3, 9, backend="cpp")
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops.first_nonfinite(torch.randn(8, 3).t(), rows, 3, 9, backend="cpp")
