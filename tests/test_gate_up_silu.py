"""gate_up_silu (SwiGLU's gate/up GEMM with its activation as the epilogue): the reference is bitwise the model's
F.linear + chunk + silu_mul; the Triton kernel (interpreter on CPU) matches it within the dtype tolerances (its
GEMM sums in its own order, as a GEMM library does); bad inputs raise; the custom op compiles without a graph
break; the layer loop takes it on the Triton layer backend."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, DTYPES, TOLERANCES, poisoned_empty

# (rows, K, F): ragged row and column tiles, K past one BLOCK_K step, a single row
SHAPES = [(5, 40, 24), (70, 96, 72), (1, 8, 3)]


def _inputs(M, K, F_, dtype, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * F_, K, generator=g) * 4 / K**0.5).to(dtype).to(DEVICE)  # |gate| ~4: both silu tails
    return x, w


def _close(got, want):
    atol, rtol = TOLERANCES[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=2 * atol, rtol=2 * rtol)  # two roundings of a reordered sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_is_the_model_formula(dtype):
    x, w = _inputs(5, 16, 12, dtype)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(ops.gate_up_silu(x, w, backend="torch"), F.silu(gate) * up)
    assert torch.equal(ref.gate_up_silu(x, w), ref.silu_mul(gate, up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(shape, dtype):
    x, w = _inputs(*shape, dtype, seed=1)
    with poisoned_empty():
        got = ops.gate_up_silu(x, w, backend="triton")
    _close(got, ref.gate_up_silu(x, w))


def test_kernel_small_tiles_batched_rows_and_empty():
    """[B, n, K] rows (the layer's [1, n, H]), tiles smaller than the problem in every dimension, zero rows."""
    from lopa_fast.kernels.triton.gate_up_silu import gate_up_silu as tri

    x, w = _inputs(9, 40, 20, torch.float32, seed=2, lead=(2,))
    with poisoned_empty():
        got = tri(x, w, tiles=(16, 16, 16))
        empty = ops.gate_up_silu(x[:, :0], w, backend="triton")
    _close(got, ref.gate_up_silu(x, w))
    assert got.shape == (2, 9, 20) and empty.shape == (2, 0, 20)


def test_bad_inputs_raise():
    x, w = _inputs(3, 8, 4, torch.float32)
    with pytest.raises(ValueError, match=r"\[2F, K\]"):
        ops.gate_up_silu(x, w[:, :6])
    with pytest.raises(ValueError, match=r"\[2F, K\]"):
        ops.gate_up_silu(x, w[:7])
    with pytest.raises(TypeError, match="weight is"):
        ops.gate_up_silu(x, w.half())
    with pytest.raises(TypeError, match="x.dtype"):
        ops.gate_up_silu(x.long(), w.long())
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops.gate_up_silu(x.t().contiguous().t(), w)
    with pytest.raises(ValueError, match="backend="):
        ops.gate_up_silu(x, w, backend="nope")


def test_custom_op_opcheck_and_compile():
    x, w = _inputs(4, 16, 8, torch.float16, lead=(1,))
    torch.library.opcheck(torch.ops.lopa_fast.triton_gate_up_silu.default, (x, w))

    def mlp(x, w):
        return ops.gate_up_silu(x, w, check=False, backend="triton") * 2

    got = torch.compile(mlp, backend="aot_eager", fullgraph=True)(x, w)
    assert torch.equal(got, mlp(x, w))


def test_layer_loop_takes_it_on_the_triton_layer_ops(monkeypatch):
    """The layer loop's MLP on the Triton layer backend is ONE gate_up_silu call a layer (no silu_mul) up to
    GATE_UP_SILU_MAX_ROWS rows (past them the GEMM is compute-bound: cuBLAS + silu_mul), on the torch backend
    F.linear + silu_mul (the CPU path's bits)."""
    from lopa_fast.models import static_forward as sf

    calls = []
    monkeypatch.setattr(ops, "gate_up_silu", lambda *a, **k: calls.append(k["backend"]) or ref.gate_up_silu(*a[:2]))
    sf._LAYER_OPS.clear()
    x, w = _inputs(3, 8, 4, torch.float32, lead=(1,))
    try:
        tri = sf._layer_ops("triton", 1e-6, torch.float32, x.device, False)
        tch = sf._layer_ops("torch", 1e-6, torch.float32, x.device, False)
        assert torch.equal(tri.gate_up_silu(x, w), ref.gate_up_silu(x, w)) and calls == ["triton"]
        assert torch.equal(tch.gate_up_silu(x, w), ref.gate_up_silu(x, w)) and calls == ["triton"]
        many = _inputs(sf.GATE_UP_SILU_MAX_ROWS + 1, 8, 4, torch.float32, lead=(1,))[0]  # compute-bound: the pair
        _close(tri.gate_up_silu(many, w), ref.gate_up_silu(many, w))  # (F.linear + the Triton silu_mul)
        assert calls == ["triton"]
    finally:
        sf._LAYER_OPS.clear()
