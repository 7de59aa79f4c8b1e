"""confidence on every backend: torch (the reference, = the decoders' token_stats formula), Triton (interpreter
on CPU), the CUDA kernel (host emulation, GPU), vs the fp64 reference (2x rule for the
reductions, exact argmax)."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from lopa_fast.ops.cuda import launch
from lopa_fast.ops.cuda.emulation import EmuLauncher
from tests.utils import (  # noqa: F401 - cuda_emu, cuda_kernels: fixtures
    DEVICE,
    DTYPES,
    assert_2x_rule,
    cuda_emu,
    cuda_kernels,
    poisoned_empty,
)

DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
EMU_SMS = EmuLauncher.num_sms

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


# ----------------------------------------------------------------------------------------------------------------
# One reference: reference.ops.confidence computes with the decoders' token_stats formula (sampling.softmax_stats).
@pytest.mark.parametrize("strategy", ["default", "margin", "neg_entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_confidence_is_token_stats(strategy, dtype):
    """Bitwise: the op reference and the decoders' token_stats (T=0) agree on token, p and every confidence."""
    from lopa_fast.sampling import token_stats

    x = tie_free_logits(6, 300, dtype).cpu()
    x[2, 7] = x[2, 9] = x[2].max() + 1  # an exact tie: both take the lowest index, margin 0
    for suppress in (None, 9):
        conf, x0, p = token_stats(x, sampling_strategy=strategy, suppress_token=suppress)
        c = ref.confidence(x, suppress)
        assert torch.equal(c.token, x0) and torch.equal(c.p_max, p)
        assert torch.equal({"default": c.p_max, "margin": c.margin, "neg_entropy": c.neg_entropy}[strategy], conf)


# ----------------------------------------------------------------------------------------------------------------
# CUDA kernel (kernels/cuda/confidence.cu): host emulation on CPU, then a GPU (`gpu`).


def emu_vs_reference(cuda_emu, x, suppress=None):
    with poisoned_empty():
        got = cuda_emu.confidence(x, suppress)
    want = ref.confidence(x, suppress)
    assert torch.equal(got.token, want.token), (got.token, want.token)
    for name in ("p_max", "margin", "neg_entropy", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=2e-6, rtol=2e-6, msg=name)
    return got


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_cuda_emu_confidence_tail_and_suppress(cuda_emu, dt):
    """V=1003: a vectorised head plus a scalar tail; the suppressed id is the row's true argmax."""
    x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(5)).mul(3).to(DT[dt])
    x[:, 17] = 20.0
    got = emu_vs_reference(cuda_emu, x, suppress=17)
    assert (got.token != 17).all()


def test_cuda_emu_confidence_unaligned_rows_ties_and_neg_inf(cuda_emu):
    """Rows at an odd element offset (the scalar path), exact ties (lowest index, margin 0), -inf logits."""
    base = torch.randn(4, 262, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x = base[:, 1:]  # stride 262, data pointer 2 bytes past alignment
    x[0, 40] = x[0, 200] = 9.0  # tie: lowest index wins, margin exactly 0
    x[1, :] = float("-inf")
    x[1, 100] = 0.0  # a single finite logit: p_max 1, margin 1
    got = emu_vs_reference(cuda_emu, x)
    assert got.token[0] == 40 and got.margin[0] == 0 and got.margin[1] == 1


@pytest.mark.parametrize("aligned", [True, False])
def test_cuda_emu_confidence_split_v_path(cuda_emu, aligned):
    """Few rows: the vocabulary is cut into splits (3 launches, ordered merge); a tie across two splits keeps
    the lowest index, the suppressed id sits in split 0, the unaligned variant runs every split scalar."""
    base = torch.randn(2, 20001, generator=torch.Generator().manual_seed(7)).mul(3).to(torch.bfloat16)
    x = base[:, :20000] if aligned else base[:, 1:]
    assert launch.confidence_splits(2, x.shape[1], EMU_SMS)[0] == 4
    x[0, 4999] = x[0, 15000] = 25.0  # splits 0 and 3 (chunk 5000)
    x[1, 7] = 30.0
    got = emu_vs_reference(cuda_emu, x, suppress=7)
    assert got.token[0] == 4999 and got.margin[0] == 0 and got.token[1] != 7
    one_cta = cuda_emu.confidence(x, 7, split=False)
    assert torch.equal(one_cta.token, got.token)


@pytest.mark.parametrize("dt", list(DT))
@pytest.mark.parametrize("N,V", [(96, 152064), (7, 1003), (33, 126464)])
@pytest.mark.gpu
def test_confidence_cuda_matches_reference(cuda_kernels, N, V, dt):
    g = torch.Generator().manual_seed(N)
    x = (torch.randn(N, V, generator=g) * 4).to(DT[dt]).cuda()
    x[0, 5] = x[0, 9] = 30.0  # exact tie: lowest index, margin 0
    for suppress in (None, 9):
        with poisoned_empty():
            got = ops.confidence(x, suppress, backend="cuda")
        want = ref.confidence(x, suppress)
        assert torch.equal(got.token, want.token)
        for name in ("p_max", "margin", "neg_entropy", "lse"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=2e-5, msg=name)


# ------------------------------------------------- torch.library registration (Triton, interpreter on CPU)
def test_triton_confidence_custom_op_opcheck_and_fullgraph_compile():
    """lopa_fast::triton_confidence passes torch.library.opcheck (suppress id given and None) and
    torch.compile(fullgraph=True) traces the public op (namedtuple rebuilt outside the op) with no graph break."""
    x = tie_free_logits(4, 300, torch.float32, seed=3)
    op = torch.ops.lopa_fast.triton_confidence.default
    for args in [(x, None, 1e-10), (x, 5, 1e-6)]:
        torch.library.opcheck(op, args)

    def f(x):
        c = ops.confidence(x, suppress_token=5, backend="triton", check=False)
        return c.token, c.p_max, c.margin, c.neg_entropy, c.lse

    want = f(x)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
