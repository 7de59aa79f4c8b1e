"""silu_mul: the reference twin is bitwise the model's `F.silu(gate) * up`; the Triton kernel (interpreter on
CPU) matches it within the dtype tolerances; the registered custom op compiles without a graph break."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, DTYPES, TOLERANCES, poisoned_empty

SHAPES = [(2, 3, 40), (3, 600), (1, 1)]  # 600 > the interpreter's 256-wide block: several column programs


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(*shape, generator=g) * 4).to(dtype).to(DEVICE)  # |gate| up to ~16: both silu tails
    up = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    return gate, up


def _close(got, want):
    atol, rtol = TOLERANCES[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_twin_is_the_model_formula(dtype):
    gate, up = _inputs((2, 3, 40), dtype)
    assert torch.equal(ops.silu_mul(gate, up, backend="torch"), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_silu_mul_kernel_matches_reference(shape, dtype):
    gate, up = _inputs(shape, dtype)
    with poisoned_empty():
        got = ops.silu_mul(gate, up, backend="triton")
    _close(got, ref.silu_mul(gate, up))


def test_silu_mul_kernel_merged_gate_up_and_empty():
    """gate and up as the two halves of one merged [.., 2F] projection (row stride 2F), and zero rows."""
    gu = torch.randn(2, 5, 2 * 24, device=DEVICE) * 4
    gate, up = gu[..., :24], gu[..., 24:]
    with poisoned_empty():
        got = ops.silu_mul(gate, up, backend="triton")
        empty = ops.silu_mul(gate[:, :0], up[:, :0], backend="triton")
    _close(got, ref.silu_mul(gate, up))
    assert empty.shape == (2, 0, 24)


def test_silu_mul_bad_inputs_raise():
    gate, up = _inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        ops.silu_mul(gate, up[:, :4])
    with pytest.raises(TypeError, match="up is"):
        ops.silu_mul(gate, up.half())
    with pytest.raises(TypeError, match="gate.dtype"):
        ops.silu_mul(gate.long(), up.long())
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops.silu_mul(gate.t(), up.t())
    with pytest.raises(ValueError, match="backend="):
        ops.silu_mul(gate, up, backend="nope")


def test_silu_mul_custom_op_opcheck_and_compile():
    gate, up = _inputs((2, 3, 16), torch.float16)
    torch.library.opcheck(torch.ops.lopa_fast.triton_silu_mul.default, (gate, up))

    def mlp(gate, up):
        return ops.silu_mul(gate, up, check=False, backend="triton") * 2

    got = torch.compile(mlp, backend="aot_eager", fullgraph=True)(gate, up)
    assert torch.equal(got, mlp(gate, up))


@pytest.mark.gpu
def test_silu_mul_dream_shape_gpu():
    """Dream-7B intermediate size (18944) in bf16, 96 rows."""
    gate, up = _inputs((96, 18944), torch.bfloat16)
    _close(ops.silu_mul(gate, up), ref.silu_mul(gate, up))
