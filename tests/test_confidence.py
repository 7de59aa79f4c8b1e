"""confidence: Triton kernel vs the fp64 reference (2x rule for the reductions, exact argmax)."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, DTYPES, assert_2x_rule, poisoned_empty

# (N, V): odd vocab sizes; 2500 spans several 1024-wide interpreter chunks with a ragged tail
SHAPES = [(7, 2500), (3, 129), (1, 2)]


def tie_free_logits(N, V, dtype, seed=0, scale=3.0):
    """Random logits whose row max is unique after the cast to dtype (exact argmax is well defined)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * scale
    top = torch.randint(0, V, (N,), generator=g)
    x[torch.arange(N), top] = x.max(dim=1).values + 1.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("suppress", [None, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_confidence_matches_reference(shape, dtype, suppress):
    N, V = shape
    if suppress is not None and V < 3:
        pytest.skip("suppressing one of two tokens leaves no top-2")
    x = tie_free_logits(N, V, dtype)
    if suppress is not None:
        x[:, suppress] = x.max() + 5.0  # the suppressed id would win if it were not suppressed
    with poisoned_empty():
        out = ops.confidence(x, suppress, backend="triton")
    exact = ref.confidence(x.double(), suppress)
    fp32 = ref.confidence(x.float(), suppress)  # what plain PyTorch gets with the contract's fp32 softmax
    assert torch.equal(out.token.cpu(), exact.token.cpu()), (out.token, exact.token)
    if suppress is not None:
        assert (out.token != suppress).all()
    for name in ("p_max", "margin", "neg_entropy", "lse"):
        got = getattr(out, name)
        assert got.dtype == torch.float32 and got.shape == (N,)
        assert_2x_rule(name, got, getattr(exact, name), getattr(fp32, name))


@pytest.mark.parametrize("num_splits", [2, 3])
def test_confidence_split_vocab_matches_reference(num_splits):
    """The split-V path (few rows): partials per (row, split) merged in order, ties across splits included."""
    from lopa_fast.kernels.triton.confidence import confidence as tri

    x = tie_free_logits(4, 3000, torch.float32, seed=3)
    x[1, [5, 2048]] = 50.0  # equal maxima in different splits: the earlier index wins, margin 0
    x[2, [1500, 2999]] = 50.0
    with poisoned_empty():
        got = tri(x, 7, num_splits=num_splits)
    exact, fp32 = ref.confidence(x.double(), 7), ref.confidence(x.float(), 7)
    assert got[0].tolist() == exact.token.tolist()
    for i, name in enumerate(("p_max", "margin", "neg_entropy", "lse"), start=1):
        assert_2x_rule(name, got[i], getattr(exact, name), getattr(fp32, name))


@pytest.mark.gpu
@pytest.mark.parametrize("N", [32, 600])
def test_confidence_dream_vocab_gpu(N):
    """V = 152,064 in bf16 with the launcher's own split choice (N=32: split-V, N=600: one program per row)."""
    x = tie_free_logits(N, 152064, torch.bfloat16, seed=5)
    out = ops.confidence(x, 151666)
    exact, fp32 = ref.confidence(x.double(), 151666), ref.confidence(x.float(), 151666)
    assert torch.equal(out.token, exact.token)
    for name in ("p_max", "margin", "neg_entropy", "lse"):
        assert_2x_rule(name, getattr(out, name), getattr(exact, name), getattr(fp32, name))


def test_confidence_ties_pick_lowest_index_and_zero_margin():
    x = torch.zeros(3, 50)
    x[0, [7, 31]] = 2.0  # tie inside one chunk
    x[1, [3, 1000 % 50]] = 2.0
    x[2, :] = -1.0
    x[2, [49, 48]] = 4.0
    x = x.to(DEVICE)
    for backend in ("torch", "triton"):
        c = ops.confidence(x, backend=backend)
        assert c.token.tolist() == [7, 0, 48], backend
        assert torch.allclose(c.margin.cpu(), torch.zeros(3), atol=1e-7), backend


def test_confidence_tie_across_chunks_keeps_first():
    """A later chunk with an equal maximum must not replace the earlier index (interpreter chunks are 1024)."""
    x = torch.zeros(2, 3000)
    x[0, [5, 2048]] = 3.0
    x[1, [1500, 2999]] = 3.0
    c = ops.confidence(x.to(DEVICE), backend="triton")
    assert c.token.tolist() == [5, 1500]


def test_confidence_values_by_hand():
    # p = softmax([0, log 2, log 3, log 4]) = [0.1, 0.2, 0.3, 0.4]
    x = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    for backend in ("torch", "triton"):
        c = ops.confidence(x.to(DEVICE), backend=backend)
        p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
        assert c.token.item() == 3
        assert abs(c.p_max.item() - 0.4) < 1e-6 and abs(c.margin.item() - 0.1) < 1e-6
        assert abs(c.lse.item() - torch.log(torch.tensor(10.0)).item()) < 1e-6
        assert abs(c.neg_entropy.item() - (p * torch.log(p + 1e-10)).sum().item()) < 1e-6
        s = ops.confidence(x.to(DEVICE), suppress_token=3, backend=backend)  # p -> [1/6, 2/6, 3/6, 0]
        assert s.token.item() == 2 and abs(s.p_max.item() - 0.5) < 1e-6 and abs(s.margin.item() - 1 / 6) < 1e-6


def test_confidence_non_contiguous_rows():
    """Row-strided logits (a slice of a wider buffer) are read in place."""
    full = tie_free_logits(4, 300, torch.float32)
    x = full[:, :257]
    c = ops.confidence(x, backend="triton")
    assert torch.equal(c.token.cpu(), ref.confidence(x.double()).token.cpu())


@pytest.mark.parametrize(
    "kwargs, err, word",
    [
        (dict(logits=torch.zeros(3)), ValueError, "logits"),
        (dict(logits=torch.zeros(3, 1)), ValueError, "V=1"),
        (dict(logits=torch.zeros(3, 8, dtype=torch.long)), TypeError, "logits.dtype"),
        (dict(logits=torch.zeros(3, 8), suppress_token=8), ValueError, "suppress_token"),
        (dict(logits=torch.zeros(3, 8), suppress_token=1.0), TypeError, "suppress_token"),
        (dict(logits=torch.zeros(3, 8), eps=-1.0), ValueError, "eps"),
        (dict(logits=torch.zeros(8, 3).t()), ValueError, "logits"),
        (dict(logits=torch.zeros(3, 8), backend="jax"), ValueError, "backend"),
    ],
)
def test_confidence_bad_input(kwargs, err, word):
    with pytest.raises(err, match=word):
        ops.confidence(**kwargs)
