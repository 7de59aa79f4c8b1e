"""CPU C++ ops (csrc/confidence_cpu.cpp, csrc/select_round_cpu.cpp; TORCH_LIBRARY lopa_fast_cpp) vs the references."""
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


@pytest.mark.parametrize("B,n,nb,seed", [(3, 16, 2, 0), (9, 70, 4, 1), (1, 7, 1, 2), (16, 128, 4, 3)])
@pytest.mark.parametrize("cmp,tau,n_look,topp,alpha", [("gt", 0.9, 3, 0.5, 0.3), ("ge", 0.95, 0, 1.0, 0.0),
                                                       ("le", 0.05, 5, 0.25, 0.7)])
def test_select_round_matches_reference(B, n, nb, seed, cmp, tau, n_look, topp, alpha):
    from tests.test_cuda_emu import random_round

    value, conf, masked, bid, complete, cc, active = random_round(B, n, nb, seed)
    args = (value, conf, masked, bid, complete, tau, cmp, n_look, topp, alpha, cc, active)
    got, want = _cpp.select_round(*args), ref.select_round(*args)
    assert torch.equal(got.accept, want.accept) and torch.equal(got.lookahead, want.lookahead)
    torch.testing.assert_close(got.score, want.score, atol=1e-6, rtol=1e-6)
    assert got.winner.item() == want.winner.item()


def test_select_round_ties_and_no_active_branch():
    g = torch.Generator().manual_seed(9)
    c = torch.rand(1, 10, generator=g).expand(3, 10).clone()
    masked = torch.ones(3, 10, dtype=torch.bool)
    bid = torch.zeros(3, 10, dtype=torch.long)
    done = torch.ones(3, 1, dtype=torch.bool)
    got = _cpp.select_round(c, c, masked, bid, done, 2.0, "gt", 12, 1.0, 0.0)  # nothing passes: fallback only
    want = ref.select_round(c, c, masked, bid, done, 2.0, "gt", 12, 1.0, 0.0)
    assert torch.equal(got.accept, want.accept) and got.accept.sum() == 3 and got.winner.item() == 0
    assert torch.equal(got.lookahead, want.lookahead) and (got.lookahead[:, -3:] == -1).all()
    none = _cpp.select_round(c, c, masked, bid, done, 2.0, "gt", 0, 1.0, 0.0, None, torch.zeros(3, dtype=torch.bool))
    assert none.winner.item() == -1
