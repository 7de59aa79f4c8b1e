"""CPU C++ confidence (csrc/confidence_cpu.cpp, TORCH_LIBRARY lopa_fast_cpp) vs the reference op."""
from __future__ import annotations

import shutil

import pytest
import torch

from lopa_fast.ops import _cpp
from lopa_fast.reference import ops as ref

def _ninja() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return is_ninja_available()


pytestmark = [
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"),
    pytest.mark.skipif(not _ninja(), reason="torch.utils.cpp_extension.load needs ninja (pip install ninja)"),
]


@pytest.fixture(scope="module", autouse=True)
def built():
    _cpp.build()
    assert _cpp.loaded()


def check(x, suppress=None):
    got = _cpp.confidence(x, suppress)
    want = ref.confidence(x.double(), suppress)  # fp64 oracle
    assert torch.equal(got.token, want.token)
    for name in ("p_max", "margin", "neg_entropy", "lse"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=2e-6, msg=name)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,V", [(5, 1003), (3, 152064)])
def test_matches_reference(N, V, dtype):
    x = (torch.randn(N, V, generator=torch.Generator().manual_seed(V)) * 4).to(dtype)
    x[:, 7] = 40.0
    check(x)
    assert (check(x, suppress=7).token != 7).all()


def test_ties_neg_inf_and_strided_rows():
    base = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    x = base[:, 1:]  # row stride 300, last dim contiguous
    x[0, 10] = x[0, 20] = 9.0
    x[1] = float("-inf")
    x[1, 5] = 1.0
    got = check(x)
    assert got.token[0] == 10 and got.margin[0] == 0 and got.p_max[1] == 1


def test_float64_runs_the_reference():
    x = torch.randn(2, 50, dtype=torch.float64)
    assert _cpp.confidence(x).p_max.dtype == torch.float64
