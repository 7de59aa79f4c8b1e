"""The CUDA loader (lopa_fast.ops.cuda: probe, hooks, custom ops, launch maths, compile-time constants) and
the dispatch, on a machine where the CUDA path is unavailable (CPU torch / no CuPy)."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from lopa_fast import ops
import re

from lopa_fast.ops import _backend, cuda
from lopa_fast.ops.cuda import constants, launch, probe, source
from lopa_fast.reference import ops as ref

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@pytest.fixture
def fresh_probe():
    probe.probe.cache_clear()
    yield
    probe.probe.cache_clear()


@no_cuda
def test_unavailable_with_a_reason_and_logged(fresh_probe, caplog):
    with caplog.at_level(logging.INFO, logger="lopa_fast.ops.cuda"):
        assert not cuda.available() and not cuda.available("confidence")
    why = cuda.why_unavailable()
    assert "torch.cuda.is_available() is False" in why
    assert any(why in r.getMessage() for r in caplog.records)


def test_disable_switch(fresh_probe, monkeypatch):
    monkeypatch.setenv("LOPA_FAST_DISABLE_CUDA", "1")
    assert not cuda.available()
    assert cuda.why_unavailable() == "disabled by LOPA_FAST_DISABLE_CUDA"


def test_unknown_op_is_not_available():
    assert not cuda.available("no_such_op")
    with pytest.raises(ValueError, match="op='no_such_op'"):
        source.kernel_source("no_such_op")


@no_cuda
def test_dispatch_falls_back_and_refuses_explicit_cuda():
    x = torch.randn(3, 50)
    assert _backend.resolve("confidence", None, x.device) == "torch"
    assert _backend.resolve("branch_attention", None, torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend='cuda' is unavailable"):
        ops.confidence(x, backend="cuda")
    got = ops.confidence(x)  # auto: the torch backend
    assert torch.equal(got.token, ref.confidence(x).token)


def test_custom_ops_registered_with_fake_impls():
    """Shapes/dtypes from the fake implementations (what torch.compile / graph capture sees)."""
    q = torch.empty(2, 3, 4, 64, device="meta", dtype=torch.bfloat16)
    kc = torch.empty(10, 2, 64, device="meta", dtype=torch.bfloat16)
    kw = torch.empty(2, 3, 2, 64, device="meta", dtype=torch.bfloat16)
    o, lse = torch.ops.lopa_fast.cuda_branch_attention(q, kc, kc, 5, kw, kw, None, None, "full", None)
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (2, 3, 4), torch.float32)
    out = torch.ops.lopa_fast.cuda_confidence(torch.empty(7, 100, device="meta", dtype=torch.float16), 3, 1e-10)
    assert [t.dtype for t in out] == [torch.int64] + [torch.float32] * 4 and all(t.shape == (7,) for t in out)


def test_hooks_refuse_calls_without_a_kernel():
    """The hooks never run something else: a head dim without a kernel, or CPU tensors, raise a ValueError
    naming why (they used to answer with the reference op)."""
    g = torch.Generator().manual_seed(0)
    q, kc, kw = torch.randn(1, 3, 2, 96, generator=g), torch.randn(4, 1, 96, generator=g), torch.randn(1, 3, 1, 96)
    with pytest.raises(ValueError, match=r"head dim D=96 has no CUDA kernel \(D in \(64, 128\)\)"):
        cuda.branch_attention(q, kc, kc, 4, kw, kw, None, None, "causal")
    with pytest.raises(ValueError, match="cuda confidence: tensors are on cpu"):
        cuda.confidence(torch.randn(2, 30, generator=g), 4)
    with pytest.raises(ValueError, match="cuda confidence: dtype torch.float64"):
        cuda.confidence(torch.randn(2, 30, dtype=torch.float64), 4)


def test_kernel_sources_take_codes_and_tiles_from_the_defines():
    """Mode codes and tile sizes live once in Python (lopa_fast.reference.attention_modes,
    lopa_fast.ops.cuda.constants): every define is read by a source, and no source compares a mode with a
    literal."""
    texts = {p.name: p.read_text() for p in source.KERNEL_DIR.glob("*.cu*")}
    every = "".join(texts.values())
    for name in constants.defines():
        assert name in every, f"{name} is defined for the kernels but no source reads it"
    for fname, text in texts.items():
        assert not re.search(r"\b(mode|cmp|MODE|CMP)\s*==\s*\d", text), f"{fname} compares a code with a literal"
    assert all(f.startswith("-DLOPA_") for f in source.nvrtc_options(90)[3:])


@pytest.mark.parametrize("B,n,Hq,Hkv,L,sms", [(3, 32, 28, 4, 2048, 132), (1, 4, 2, 1, 300, 4), (9, 64, 28, 4, 97, 132),
                                              (2, 5, 4, 2, 0, 132), (1, 1, 28, 4, 1, 132)])
def test_attention_splits_cover_the_prefix(B, n, Hq, Hkv, L, sms):
    S, split_len = launch.attention_splits(B, n, Hq, Hkv, L, sms)
    assert split_len % constants.MMA_KEYS == 0 and split_len % constants.ATTN_KEYS == 0
    if L == 0:
        assert S == 0
    else:
        assert (S - 1) * split_len < L <= S * split_len  # every split non-empty, all keys covered
        assert S == 1 or split_len >= 128


def test_attention_smem_mirrors_the_kernel_layout():
    # SIMT (fp32): Q fp32 32xD + K 32x(D+4) + V 32xD + P fp32 4x8x32 (attn::Smem in branch_attention.cu)
    assert launch.attention_smem_bytes(torch.float32, 64) == 32 * 64 * 4 + 32 * 68 * 4 + 32 * 64 * 4 + 4096
    # tensor cores (16-bit): K 64x(D+8) + V^T Dx(64+8) (attn::mma::Smem)
    assert launch.attention_smem_bytes(torch.bfloat16, 128) == 64 * 136 * 2 + 128 * 72 * 2
    assert launch.attention_rows(torch.float16) == 64 and launch.attention_rows(torch.float32) == 32
    assert math.ceil(launch.attention_smem_bytes(torch.float32, 128) / 1024) == 53  # > 48 KiB: opt-in attribute
