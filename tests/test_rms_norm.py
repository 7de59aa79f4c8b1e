"""rms_norm / add_rms_norm: the reference twin is bitwise the model's formula; the Triton kernel (interpreter
on CPU) matches it within the dtype tolerances; the registered custom ops compile without a graph break."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.models import transformer
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, DTYPES, TOLERANCES, poisoned_empty

EPS = 1e-6
SHAPES = [(2, 3, 40), (5, 33), (1, 1)]  # 40 and 33: a ragged tail inside one power-of-two tile


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)
    r = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    return x, r, w


def _close(got, want):
    atol, rtol = TOLERANCES[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_twin_is_the_model_formula(dtype):
    x, r, w = _inputs((2, 3, 40), dtype)
    assert torch.equal(ref.rms_norm(x, w, EPS), transformer.rms_norm(x, w, EPS))
    assert torch.equal(ops.rms_norm(x, w, EPS, backend="torch"), transformer.rms_norm(x, w, EPS))
    normed, s = ops.add_rms_norm(x, r, w, EPS, backend="torch")
    assert torch.equal(s, x + r) and torch.equal(normed, transformer.rms_norm(x + r, w, EPS))


@pytest.mark.parametrize("shape", [(1, 16, 32), (5, 896), (2, 3, 4096), (4, 13, 100), (3, 7)], ids=str)
def test_torch_backend_fp32_is_the_model_formula_at_every_width(shape):
    """The torch backend runs fp32 through F.rms_norm (one call instead of 7 ops): bitwise the model's formula at
    widths of the tiny models, Qwen2.5-0.5B (896), Dream-7B (4096) and odd ones (vectorised bodies and tails)."""
    x, r, w = _inputs(shape, torch.float32)
    for eps in (EPS, 1e-5):
        assert torch.equal(ops.rms_norm(x, w, eps, backend="torch"), transformer.rms_norm(x, w, eps))
        normed, s = ops.add_rms_norm(x, r, w, eps, backend="torch")
        assert torch.equal(normed, transformer.rms_norm(x + r, w, eps))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_kernel_matches_reference(shape, dtype):
    x, r, w = _inputs(shape, dtype)
    with poisoned_empty():
        got = ops.rms_norm(x, w, EPS, backend="triton")
        normed, s = ops.add_rms_norm(x, r, w, EPS, backend="triton")
    _close(got, ref.rms_norm(x, w, EPS))
    want_n, want_s = ref.add_rms_norm(x, r, w, EPS)
    assert torch.equal(s, want_s)  # one rounding of the dtype add: exact
    _close(normed, want_n)


def test_rms_norm_kernel_strided_rows_and_empty():
    """Rows of a wider buffer (last dim contiguous, row stride != H) and zero rows."""
    big, r, w = _inputs((4, 6, 50), torch.float32)
    x = big[..., 5:45]
    w = w[:40].contiguous()
    with poisoned_empty():
        got = ops.rms_norm(x, w, EPS, backend="triton")
        normed, s = ops.add_rms_norm(x, r[..., :40], w, EPS, backend="triton")
        empty = ops.rms_norm(x[:0], w, EPS, backend="triton")
    _close(got, ref.rms_norm(x, w, EPS))
    _close(normed, ref.rms_norm(x + r[..., :40], w, EPS))
    assert torch.equal(s, x + r[..., :40]) and s.is_contiguous()
    assert empty.shape == (0, 6, 40)


def test_rms_norm_bad_inputs_raise():
    x, r, w = _inputs((2, 3, 8), torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        ops.rms_norm(x, w[:4], EPS)
    with pytest.raises(TypeError, match="weight.dtype"):
        ops.rms_norm(x, w.half(), EPS)
    with pytest.raises(TypeError, match="x.dtype"):
        ops.rms_norm(x.long(), w.long(), EPS)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops.rms_norm(x.transpose(1, 2), w[:3].contiguous(), EPS)
    with pytest.raises(ValueError, match="residual must have"):
        ops.add_rms_norm(x, r[:1], w, EPS)
    with pytest.raises(TypeError, match="residual is"):
        ops.add_rms_norm(x, r.half(), w, EPS)
    with pytest.raises(ValueError, match="backend="):
        ops.rms_norm(x, w, EPS, backend="nope")


def test_rms_norm_custom_ops_opcheck_and_compile():
    """Registered with torch.library: opcheck passes and torch.compile(fullgraph=True) traces the public
    ops (Triton backend, interpreter) with no graph break and the eager result."""
    x, r, w = _inputs((2, 3, 16), torch.float16)
    torch.library.opcheck(torch.ops.lopa_fast.triton_rms_norm.default, (x, w, EPS))
    torch.library.opcheck(torch.ops.lopa_fast.triton_add_rms_norm.default, (x, r, w, EPS))

    def layer(x, r, w):
        n, s = ops.add_rms_norm(x, r, w, EPS, check=False, backend="triton")
        return ops.rms_norm(n * 2, w, EPS, check=False, backend="triton"), s

    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, r, w)
    want = layer(x, r, w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_rms_norm_dream_shape_gpu():
    """Dream-7B hidden size (3584) and LLaDA-8B (4096) in bf16 with the launcher's GPU tiling."""
    for H in (3584, 4096):
        x, r, w = _inputs((96, H), torch.bfloat16)
        _close(ops.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))
        normed, s = ops.add_rms_norm(x, r, w, EPS)
        assert torch.equal(s, x + r)
        _close(normed, ref.rms_norm(x + r, w, EPS))


@pytest.mark.parametrize("shape", [(1, 16, 32), (5, 896), (2, 3, 4096), (4, 13, 100), (3, 7)], ids=str)
def test_cpp_kernel_is_the_formula_within_two_ulp(shape):
    """The C++ kernel (float32, the CPU fast forward's norms when lopa_fast._C is built): the residual sum bitwise
    torch's add, the normed rows within 2 ulp of the model's formula (only mean(x^2)'s summation order differs:
    accumulated in double), on the widths of the tiny models, Qwen2.5-0.5B, Dream-7B and odd ones; strided inputs
    are copied first; auto picks it for float32 only, half types keep the torch backend and are refused by name."""
    from lopa_fast.ops import _backend

    x, r, w = (t.cpu() for t in _inputs(shape, torch.float32))  # a CPU kernel, whatever the suite's device
    for eps in (EPS, 1e-5):
        want = transformer.rms_norm(x, w, eps)
        got = ops.rms_norm(x, w, eps, backend="cpp")
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2.5e-7)
        normed, s = ops.add_rms_norm(x, r, w, eps, backend="cpp")
        assert torch.equal(s, x + r) and s.is_contiguous() and normed.is_contiguous()
        torch.testing.assert_close(normed, transformer.rms_norm(x + r, w, eps), rtol=2.5e-7, atol=2.5e-7)
    if len(shape) == 3:  # a strided view (every other row): copied, the same rows
        torch.testing.assert_close(ops.rms_norm(x[:, ::2], w, EPS, backend="cpp"),
                                   transformer.rms_norm(x[:, ::2], w, EPS), rtol=2.5e-7, atol=2.5e-7)
    cpu = torch.device("cpu")
    assert _backend.resolve("rms_norm", None, cpu) == "cpp" and _backend.resolve("add_rms_norm", None, cpu) == "cpp"
    xh, rh, wh = (t.cpu() for t in _inputs(shape, torch.bfloat16))
    assert torch.equal(ops.rms_norm(xh, wh, EPS), transformer.rms_norm(xh, wh, EPS))  # auto: the torch backend
    with pytest.raises(TypeError, match="backend='cpp'; allowed: float32"):
        ops.add_rms_norm(xh, rh, wh, EPS, backend="cpp")
