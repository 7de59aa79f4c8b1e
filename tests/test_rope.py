"""rope: the reference twin is bitwise the model's `_rope` + `_apply_rope`; the Triton kernel (interpreter on
CPU) performs the same roundings in the same order, so it is bitwise equal too; positions reach it only
through the table (a tensor), so a compiled caller does not recompile for new positions."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lopa_fast import ops
from lopa_fast.models import transformer
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, DTYPES, TOLERANCES, poisoned_empty

THETA = 10000.0


def _qk(B, n, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, Hq, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(B, n, Hkv, D, generator=g).to(dtype).to(DEVICE)
    return q, k


def _table(positions, D, theta=THETA):
    return ops.rope_cos_sin(torch.as_tensor(positions, device=DEVICE), D, theta)


def _same(got, want):
    atol, rtol = TOLERANCES[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert torch.equal(got, want), f"{int((got != want).sum())} elements differ from the reference"


@pytest.mark.parametrize("fp32", [False, True], ids=["qwen2", "llada"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_twin_is_the_model_formula(dtype, fp32):
    D, theta = 16, 1e6
    model = SimpleNamespace(config=SimpleNamespace(head_dim=D, rope_theta=theta), rope_in_fp32=fp32)
    model.rope_inv_freq = lambda device: transformer.DecoderLM.rope_inv_freq(model, device)
    positions = torch.arange(1000, 1009)
    with torch.inference_mode():  # (the first call keeps the inverse frequencies: a normal tensor even here)
        cos, sin = transformer.DecoderLM.rope_tables(model, positions)
    c2, s2 = ops.rope_cos_sin(positions, D, theta)
    assert torch.equal(cos, c2) and torch.equal(sin, s2)
    again = transformer.DecoderLM.rope_tables(model, positions)  # from the kept ones: the same values
    assert torch.equal(again[0], cos) and torch.equal(again[1], sin)
    assert model.rope_inv_freq("cpu") is model._inv_freq and not model._inv_freq.is_inference()
    q, k = _qk(2, 9, 3, 1, D, dtype)
    got = ops.rope(q, k, cos, sin, fp32, backend="torch")
    assert torch.equal(got[0], transformer.DecoderLM._apply_rope(model, q, cos, sin))
    assert torch.equal(got[1], transformer.DecoderLM._apply_rope(model, k, cos, sin))


@pytest.mark.parametrize("fp32", [False, True], ids=["qwen2", "llada"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row_positions"])
def test_rope_heads_is_bitwise_the_reference(dtype, fp32, per_row):
    """The torch layer loop's form (ops.rope.rope_heads: q and k heads side by side, sin's first half negated):
    bitwise ref.rope on every head, from slices of a merged q/k/v projection, extreme values included."""
    from lopa_fast.ops.rope import rope_heads, rope_rotation

    B, n, Hq, Hkv, D = 3, 7, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(B, n, Hq + 2 * Hkv, D, generator=g) * 30).to(dtype)
    qkv[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 65504.0, -1e-8]).to(dtype)
    pos = torch.arange(B * n).reshape(B, n) * 997 if per_row else torch.arange(n) + 4093
    cos, sin = ref.rope_cos_sin(pos, D, THETA)
    want_q, want_k = ref.rope(qkv[:, :, :Hq], qkv[:, :, Hq: Hq + Hkv], cos, sin, fp32)
    got = rope_heads(qkv[:, :, : Hq + Hkv], rope_rotation(cos, sin, dtype, fp32))
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got[:, :, :Hq], want_q) and torch.equal(got[:, :, Hq:], want_k)


@pytest.mark.parametrize("fp32", [False, True], ids=["qwen2", "llada"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row_positions"])
@pytest.mark.parametrize("shape", [(3, 7, 4, 2, 16), (1, 24, 4, 2, 8), (2, 5, 28, 4, 128), (1, 1, 2, 2, 2)], ids=str)
def test_cpp_kernel_is_bitwise_the_reference(shape, per_row, fp32):
    """The C++ kernel (float32, the CPU fast forward's rope when lopa_fast._C is built): bitwise ref.rope on q and
    k read as slices of a merged q/k/v projection (Dream-7B's 28 / 4 heads of 128 included), extreme values too;
    an empty window; auto picks it on CPU for float32 only (half types keep the torch backend; asked explicitly,
    they are refused by name)."""
    from lopa_fast.ops import _backend

    B, n, Hq, Hkv, D = shape
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, n, Hq + 2 * Hkv, D, generator=g) * 30
    qkv[0, 0, 0, :2] = torch.tensor([-0.0, 3.4e38])
    pos = torch.arange(B * n).reshape(B, n) * 997 if per_row else torch.arange(n) + 4093
    cos, sin = ref.rope_cos_sin(pos, D, THETA)
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hkv]
    want = ref.rope(q, k, cos, sin, fp32)
    got = ops.rope(q, k, cos, sin, fp32, backend="cpp")
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.shape == b.shape and torch.equal(a, b)
    empty = ops.rope(q[:, :0], k[:, :0], cos[..., :0, :], sin[..., :0, :], fp32, backend="cpp")
    assert empty[0].shape == (B, 0, Hq, D) and empty[1].shape == (B, 0, Hkv, D)
    assert _backend.resolve("rope", None, torch.device("cpu")) == "cpp"
    half = ops.rope(q.bfloat16(), k.bfloat16(), cos, sin, fp32)  # auto: the torch backend
    torch.testing.assert_close(half[0], ref.rope(q.bfloat16(), k.bfloat16(), cos, sin, fp32)[0], rtol=0, atol=0,
                               equal_nan=True)  # (3.4e38 is inf in bfloat16)
    with pytest.raises(TypeError, match="backend='cpp'; allowed: float32"):
        ops.rope(q.bfloat16(), k.bfloat16(), cos, sin, fp32, backend="cpp")


def test_cpp_kernel_writes_k_into_the_rows_it_is_given():
    """rope_cpp's k_out (the in-cache forward writes each layer's k straight into the cache rows after the prefix):
    the same k as a fresh output, in those rows and nowhere else, returned as given; a k_out of another size or a
    strided one is refused naming it."""
    from lopa_fast.ops.rope import rope_cpp

    B, n, Hq, Hkv, D = 1, 6, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, n, Hq + 2 * Hkv, D, generator=g)
    cos, sin = ref.rope_cos_sin(torch.arange(n) + 11, D, THETA)
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hkv]
    want_q, want_k = ref.rope(q, k, cos, sin, False)
    cache = torch.full((2, 20, Hkv, D), 7.0)
    rows = cache[1, 5 : 5 + n]
    got_q, got_k = rope_cpp(q, k, cos, sin, rows)
    assert got_k is rows and torch.equal(got_q, want_q) and torch.equal(rows, want_k[0])
    untouched = torch.ones(2, 20, dtype=torch.bool)
    untouched[1, 5 : 5 + n] = False
    assert (cache[untouched] == 7.0).all()
    for bad in (cache[1, 5 : 5 + n - 1], cache[1:, 5 : 5 + n].transpose(1, 2)):
        with pytest.raises(ValueError, match="k_out"):
            rope_cpp(q, k, cos, sin, bad)


@pytest.mark.parametrize("fp32", [False, True], ids=["qwen2", "llada"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kernel_matches_reference(dtype, fp32):
    B, n, Hq, Hkv, D = 2, 5, 3, 1, 12  # 3 / 1 heads and D/2 = 6: ragged tiles
    q, k = _qk(B, n, Hq, Hkv, D, dtype)
    cos, sin = _table(torch.arange(300, 300 + n), D)
    with poisoned_empty():
        got = ops.rope(q, k, cos, sin, fp32, backend="triton")
    want = ref.rope(q, k, cos, sin, fp32)
    _same(got[0], want[0])
    _same(got[1], want[1])


def test_rope_kernel_per_branch_positions_and_strided_qkv():
    """cos/sin [B, n, D] (per-request offsets) and q, k as head slices of one merged qkv projection."""
    B, n, Hq, Hkv, D = 3, 4, 2, 1, 8
    qkv = torch.randn(B, n, (Hq + 2 * Hkv) * D, dtype=torch.float16, device=DEVICE)
    q = qkv[..., : Hq * D].unflatten(-1, (Hq, D))
    k = qkv[..., Hq * D : (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    positions = torch.tensor([[0, 1, 2, 3], [17, 18, 19, 20], [5, 6, 7, 8]], device=DEVICE)
    cos, sin = _table(positions, D)
    assert cos.shape == (B, n, D)
    with poisoned_empty():
        got = ops.rope(q, k, cos, sin, backend="triton")
        empty = ops.rope(q[:, :0], k[:, :0], cos[:, :0], sin[:, :0], backend="triton")
    want = ref.rope(q, k, cos, sin)
    _same(got[0], want[0])
    _same(got[1], want[1])
    assert empty[0].shape == (B, 0, Hq, D) and empty[1].shape == (B, 0, Hkv, D)


def test_rope_bad_inputs_raise():
    q, k = _qk(1, 3, 2, 1, 8, torch.float32)
    cos, sin = _table(torch.arange(3), 8)
    with pytest.raises(ValueError, match="q must be"):
        ops.rope(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="must match q"):
        ops.rope(q, k[:, :2], cos, sin)
    with pytest.raises(TypeError, match="k is"):
        ops.rope(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="even"):
        ops.rope(q[..., :7], k[..., :7], cos[:, :7], sin[:, :7])
    with pytest.raises(ValueError, match="cos must be"):
        ops.rope(q, k, cos[:2], sin)
    with pytest.raises(TypeError, match="float32"):
        ops.rope(q, k, cos.half(), sin)
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops.rope(q.transpose(2, 3).contiguous().transpose(2, 3), k, cos, sin)
    with pytest.raises(TypeError, match="positions"):
        ops.rope_cos_sin(torch.arange(3.0), 8, THETA)
    with pytest.raises(ValueError, match="head_dim"):
        ops.rope_cos_sin(torch.arange(3), 7, THETA)


def test_rope_custom_op_opcheck_and_compile_without_recompiles():
    """The custom op passes opcheck; a compiled (fullgraph) table + rope replays for new positions
    without recompiling and equals eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k = _qk(1, 4, 2, 1, 8, torch.float16)
    cos, sin = _table(torch.arange(4), 8)
    torch.library.opcheck(torch.ops.lopa_fast.triton_rope.default, (q, k, cos, sin, False))

    def f(q, k, positions):
        c, s = ops.rope_cos_sin(positions, 8, THETA)
        return ops.rope(q, k, c, s, True, check=False, backend="triton")

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=False)
    for start in (0, 37):
        positions = torch.arange(start, start + 4, device=DEVICE)
        got, want = compiled(q, k, positions), f(q, k, positions)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fp32", [False, True], ids=["qwen2", "llada"])
def test_rope_dream_shape_gpu(fp32):
    """Dream-7B heads (28 q, 4 kv, D 128) in bf16, 4 branches x 32 positions at prefix ~1000."""
    q, k = _qk(4, 32, 28, 4, 128, torch.bfloat16)
    cos, sin = _table(torch.arange(1000, 1032), 128, 1e6)
    got = ops.rope(q, k, cos, sin, fp32)
    want = ref.rope(q, k, cos, sin, fp32)
    _same(got[0], want[0])
    _same(got[1], want[1])
