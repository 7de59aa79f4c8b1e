"""head_confidence (the LM head and the confidence statistics fused) against the unfused statistics,
`ops.confidence(F.linear(hidden, weight))`, on every backend the CPU runs: torch (the chunked reference),
Triton (interpreter), the CUDA kernel (host emulation; its sm_90 compile is tests/test_cuda_compile.py), and
on a GPU (`gpu`). Exact argmax (ties -> the first index), the 2x rule (tests.utils) for the reductions, the
rows' finiteness (the round's numerics guard)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, assert_2x_rule, cuda_emu, cuda_kernels, poisoned_empty  # noqa: F401 - fixtures

STATS = ("p_max", "margin", "neg_entropy", "lse")
DREAM_V, DREAM_MASK = 152064, 151666


def head_inputs(R, H, V, dtype, seed=0, ties=True):
    """hidden [R, H], weight [V, H] on DEVICE. ties: weight rows duplicated so that exact logit ties fall inside
    one chunk, across chunk / split boundaries and at the row's max (the duplicate row gets a boost)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.7
    if ties:
        top = torch.randint(0, V, (1,), generator=g).item()
        w[top] = h[0] * 0.5  # row 0's max (unique direction)
        for j in (V - 1, V // 2, 3):  # an equal later (or earlier) copy: the first index must win, margin 0
            if j != top:
                w[j] = w[top]
    return h.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def unfused(h, w, suppress=None, eps=1e-10):
    """The statistics the round computes today: the logits materialised, then `confidence` (fp64: exact)."""
    logits = F.linear(h, w)
    return (ref.confidence(logits.double(), suppress, eps), ref.confidence(logits.float(), suppress, eps),
            torch.isfinite(logits).all(-1))


def check(got, h, w, suppress=None, entropy=True):
    exact, fp32, finite = unfused(h, w, suppress)
    assert torch.equal(got.token.cpu(), exact.token.cpu()), (got.token, exact.token)
    assert torch.equal(got.finite.cpu(), finite.cpu())
    assert got.token.dtype == torch.int64 and got.finite.dtype == torch.bool
    for name in STATS:
        out = getattr(got, name)
        if name == "neg_entropy" and not entropy:
            assert out is None
            continue
        assert out.dtype == torch.float32 and out.shape == (h.shape[0],)
        assert_2x_rule(name, out, getattr(exact, name), getattr(fp32, name))


# ---------------------------------------------------------------------------------------------- torch (reference)
@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("suppress", [None, 3])
def test_reference_chunked_matches_unfused(chunk, suppress):
    """The chunked reference, chunk widths from one column to the whole row, ties across chunk boundaries."""
    h, w = head_inputs(6, 24, 301, torch.float32, seed=1)
    h, w = h.cpu(), w.cpu()
    got = ref.head_confidence(h, w, suppress, chunk=chunk)
    check(got, h, w, suppress)
    if suppress is not None:
        assert (got.token != suppress).all()


def test_reference_fp64_equals_unfused_exactly_on_integer_logits():
    """Integer-valued inputs: every logit is exact, so the token, the tie rule and (float64) the statistics are
    the unfused ones to rounding of the last sums."""
    g = torch.Generator().manual_seed(2)
    h = torch.randint(-3, 4, (5, 8), generator=g).double()
    w = torch.randint(-3, 4, (97, 8), generator=g).double()
    w[40] = w[10] = h[1] * 2  # row 1: an exact tie at the max between ids 10 and 40 (chunk 16: two chunks)
    got = ref.head_confidence(h, w, chunk=16)
    want = ref.confidence(F.linear(h, w))
    assert torch.equal(got.token, want.token) and got.token[1] == 10 and got.margin[1] == 0
    for name in STATS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-12, atol=1e-12)


def test_torch_backend_entropy_off_and_dtypes():
    h, w = head_inputs(4, 16, 200, torch.float16, seed=4)
    got = ops.head_confidence(h.cpu(), w.cpu(), 5, entropy=False, backend="torch")
    check(got, h.cpu(), w.cpu(), 5, entropy=False)


def test_real_vocabulary_torch():
    """V = 152,064 (Dream), the mask id suppressed, a tie across the chunk boundary at 8192."""
    h, w = head_inputs(3, 16, DREAM_V, torch.float32, seed=5, ties=False)
    w[8191] = w[8192] = h[2] * 3  # row 2: equal maxima in two chunks
    w[DREAM_MASK] = h[0] * 3  # row 0: the mask id would win unsuppressed
    got = ops.head_confidence(h.cpu(), w.cpu(), DREAM_MASK, backend="torch")
    check(got, h.cpu(), w.cpu(), DREAM_MASK)
    assert got.token[2] == 8191 and got.token[0] != DREAM_MASK


# ---------------------------------------------------------------------------------------------- keep_logits
def check_kept(got, h, w, suppress):
    """The kept logits are the values the statistics folded: the same arg-max under the suppression (ties -> the
    first id), the same lse, and F.linear's logits to the storage dtype's rounding (another summation order)."""
    assert got.logits is not None and got.logits.dtype == h.dtype and got.logits.shape == (h.shape[0], w.shape[0])
    kept = got.logits.float()
    if suppress is not None:
        kept[:, suppress] = float("-inf")
    assert torch.equal(kept.argmax(-1).cpu(), got.token.cpu())
    torch.testing.assert_close(torch.logsumexp(kept, -1), got.lse, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if h.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.logits.float(), F.linear(h.float(), w.float()).to(h.dtype).float(), **tol)


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda_emu"])
def test_keep_logits_on_every_backend(backend, entropy, request):
    """keep_logits=True returns the raw logits [R, V] (hidden.dtype, before the suppression) the one pass
    computed, with and without the entropy pass; the statistics are unchanged by it; without it, None."""
    h, w = head_inputs(11, 40, 2100, torch.float16, seed=12)
    h, w = h.cpu(), w.cpu()
    if backend == "cuda_emu":
        run = request.getfixturevalue("cuda_emu").head_confidence
    else:
        def run(*a, **kw):
            return ops.head_confidence(*a, backend=backend, **kw)
    got = run(h, w, 3, 1e-10, entropy, keep_logits=True)
    plain = run(h, w, 3, 1e-10, entropy)
    assert plain.logits is None
    check(got, h, w, 3, entropy=entropy)
    check_kept(got, h, w, 3)
    for a, b in zip(got[:6], plain[:6]):
        assert (a is None and b is None) or torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- Triton (interpreter)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=str)
@pytest.mark.parametrize("num_splits,suppress", [(1, None), (3, 3)])
def test_triton_matches_unfused(dtype, num_splits, suppress):
    from lopa_fast.kernels.triton.head_confidence import head_confidence as tri

    h, w = head_inputs(19, 40, 2500, dtype, seed=6)  # 19 rows: two row tiles of 16, a ragged one
    with poisoned_empty():
        got = ops.HeadConfidence(*tri(h, w, suppress, num_splits=num_splits, tiles=(16, 256, 16)))
    check(got, h, w, suppress)


def test_triton_entropy_pass_reads_the_logits_back_not_the_weight(monkeypatch):
    """The entropy pass reads the stats pass's [R, V] logits scratch (storage dtype), not the head weight a second
    time (at Dream-7B: 49 MB instead of 1.09 GB): the weight zeroed between the passes changes nothing."""
    from lopa_fast.kernels.triton import head_confidence as hc

    h, w = head_inputs(19, 40, 2500, torch.float16, seed=6)
    want = w.clone()
    entropy_kernel = hc._hc_entropy_kernel

    class ZeroWeightFirst:
        def __getitem__(self, grid):
            def run(*args, **kw):
                w.zero_()  # a recomputing pass would now see logits of 0
                return entropy_kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(hc, "_hc_entropy_kernel", ZeroWeightFirst())
    got = ops.HeadConfidence(*hc.head_confidence(h, w, 3, num_splits=3, tiles=(16, 256, 16)))
    assert not w.any()  # the entropy pass ran
    check(got, h, want, 3)


def test_triton_public_op_entropy_off():
    h, w = head_inputs(5, 24, 700, torch.float32, seed=7)
    got = ops.head_confidence(h, w, entropy=False, backend="triton")
    check(got, h, w, entropy=False)


def test_triton_real_vocabulary():
    """V = 152,064, a few rows: the launcher's own tiles and splits, the mask id suppressed."""
    h, w = head_inputs(3, 16, DREAM_V, torch.float32, seed=8)
    w[DREAM_MASK] = h[1]
    got = ops.head_confidence(h, w, DREAM_MASK, backend="triton")
    check(got, h, w, DREAM_MASK)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_nonfinite_rows_are_reported_not_hidden():
    """A NaN / inf in a row's logits marks it not finite on every backend (before the suppression: an inf at the
    suppressed id is still reported, as the round's guard reads raw logits); other rows are unaffected."""
    h, w = head_inputs(5, 16, 300, torch.float32, seed=9, ties=False)
    h[1, 3] = float("nan")
    h[3] = h[3] * 1e30  # overflows fp32 in the dot
    w[7] = 0.0
    w[7, 0] = 1e38
    h[4, 0] = 1e10  # logit 7 of row 4: 1e48 -> inf, at the suppressed id
    for backend in ("torch", "triton"):
        got = ops.head_confidence(h, w, 7, backend=backend)
        assert got.finite.tolist() == [True, False, True, False, False], backend
        ok = torch.tensor([0, 2])
        exact, _, _ = unfused(h[ok], w, 7)
        assert torch.equal(got.token[ok].cpu(), exact.token.cpu()), backend


@pytest.mark.parametrize(
    "kwargs, err, word",
    [
        (dict(hidden=torch.zeros(3), weight=torch.zeros(5, 3)), ValueError, "hidden"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 4)), ValueError, "H="),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(1, 3)), ValueError, "V=1"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 3, dtype=torch.float64)), TypeError, "weight.dtype"),
        (dict(hidden=torch.zeros(2, 3, dtype=torch.long), weight=torch.zeros(5, 3, dtype=torch.long)), TypeError,
         "hidden.dtype"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 3), suppress_token=5), ValueError, "suppress_token"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 3), suppress_token=True), TypeError, "suppress_token"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 3), eps=-1.0), ValueError, "eps"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 3), entropy=1), TypeError, "entropy"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 3), chunk=0), ValueError, "chunk"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(3, 5).t()), ValueError, "weight"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(5, 3), backend="jax"), ValueError, "backend"),
    ],
)
def test_bad_input(kwargs, err, word):
    with pytest.raises(err, match=word):
        ops.head_confidence(**kwargs)


def test_triton_custom_op_opcheck_and_fullgraph_compile():
    """lopa_fast::triton_head_confidence passes torch.library.opcheck and torch.compile(fullgraph=True) traces the
    public op (namedtuple rebuilt outside the op) with no graph break."""
    h, w = head_inputs(4, 16, 300, torch.float32, seed=10)
    op = torch.ops.lopa_fast.triton_head_confidence.default
    torch.library.opcheck(op, (h, w, None, 1e-10, True, False))
    torch.library.opcheck(op, (h, w, 5, 1e-6, False, False))
    torch.library.opcheck(op, (h, w, 5, 1e-6, False, True))

    def f(h, w):
        c = ops.head_confidence(h, w, 5, backend="triton", keep_logits=True, check=False)
        return c.token, c.p_max, c.margin, c.neg_entropy, c.lse, c.finite, c.logits

    want = f(h, w)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(h, w)
    for g, x in zip(got, want):
        assert torch.equal(g, x)


# ---------------------------------------------------------------------------------------------- CUDA (host emulation)
# kernels/cuda/head_confidence.cu run on CPU (lopa_fast.ops.cuda.emulation, 4 "SMs": the split path at
# small V); its sm_90 compile (nvcc, NVRTC) is tests/test_cuda_compile.py.
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_emu_matches_unfused(cuda_emu, dt):
    """Two row tiles (11 rows, the second ragged), 3 vocabulary splits, ties across splits, the suppressed id."""
    from lopa_fast.ops.cuda import launch

    h, w = head_inputs(11, 40, 2100, dt, seed=11)
    assert launch.head_confidence_splits(11, 2100, 4)[0] == 3
    with poisoned_empty():
        got = cuda_emu.head_confidence(h.cpu(), w.cpu(), 3)
    check(got, h.cpu(), w.cpu(), 3)


def test_cuda_emu_entropy_pass_reads_the_logits_back_not_the_weight(cuda_emu):
    """As the Triton test above, through kernels/cuda/head_confidence.cu: the weight zeroed before the entropy
    launch changes nothing, and the entropy launch is handed no pointer to it."""
    from lopa_fast.ops.cuda import launch

    h, w = head_inputs(11, 40, 2100, torch.bfloat16, seed=11)
    want = w.clone()
    L = cuda_emu._l["head_confidence"]
    seen = []

    def zero_weight_first(name, grid, block, smem, args):
        if name.startswith("head_confidence_entropy"):
            seen.append([v for kind, v in args if kind == "p"])
            w.zero_()
        return L(name, grid, block, smem, args)

    out = launch.run_head_confidence(zero_weight_first, h.cpu(), w.cpu(), 3, 1e-10, True, L.num_sms)
    assert len(seen) == 1 and w.data_ptr() not in seen[0] and not w.any()
    check(ops.HeadConfidence(*out), h.cpu(), want.cpu(), 3)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_cuda_emu_nonfinite_rows_and_entropy_off(cuda_emu):
    h, w = head_inputs(5, 16, 300, torch.float32, seed=9, ties=False)
    h[1, 3] = float("nan")
    h[3] = h[3] * 1e30
    w[7] = 0.0
    w[7, 0] = 1e38  # row 3's logit 7: inf
    got = cuda_emu.head_confidence(h.cpu(), w.cpu(), None, entropy=False)
    assert got.finite.tolist() == [True, False, True, False, True] and got.neg_entropy is None
    ok = torch.tensor([0, 2, 4])
    check(ops.HeadConfidence(*[None if t is None else t[ok] for t in got]), h[ok].cpu(), w.cpu(), entropy=False)


# ---------------------------------------------------------------------------------------------- GPU
def check_vs_exact(got, h, w, suppress):
    """At a real width (H = 3584) the head's own rounding (fused or cuBLAS: different summation orders, and a bf16
    logit's rounding) dominates: the 2x rule against the fp64 head, with the unfused torch path as the yardstick;
    the token equals the exact argmax unless the exact top-2 gap is within the unfused logits' own error."""
    exact = F.linear(h.double(), w.double())
    unf = F.linear(h, w)
    e, t = ref.confidence(exact, suppress), ref.confidence(unf.float(), suppress)
    assert got.finite.all()
    for name in STATS:
        assert_2x_rule(name, getattr(got, name), getattr(e, name), getattr(t, name), slack=1e-4)
    err = (unf.double() - exact).abs().amax(-1)  # per row
    rows = torch.nonzero(got.token != e.token).flatten()
    gap = exact[rows, e.token[rows]] - exact[rows, got.token[rows]]
    assert (gap <= 2 * err[rows]).all(), (rows, gap, err[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("R", [33, 289])
def test_gpu_real_shape(cuda_kernels, backend, dtype, R):
    """Dream's head at a LoPA k=8 round (R = 9 x 32 + 1 rows) and a D2F one: H 3584, V 152,064, model-like
    logit scale (weights x 0.02), an exact tie at row 0's max, the mask id suppressed."""
    g = torch.Generator().manual_seed(R)
    h = torch.randn(R, 3584, generator=g)
    w = torch.randn(DREAM_V, 3584, generator=g) * 0.02
    w[77] = w[90000] = h[0] * 0.01  # equal maxima of row 0: the first index
    h, w = h.to(dtype).cuda(), w.to(dtype).cuda()
    got = ops.head_confidence(h, w, DREAM_MASK, backend=backend)
    check_vs_exact(got, h, w, DREAM_MASK)
    assert got.token[0] == 77 and got.margin[0] == 0
