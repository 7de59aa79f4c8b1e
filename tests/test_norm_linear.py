"""norm_linear (a layer's pre-norm GEMM with the residual add + RMSNorm as its prologue and SwiGLU / RoPE as its
epilogue): the reference is bitwise the model's separate ops; the Triton kernel (interpreter on CPU) matches it
within the dtype tolerances (its norm and GEMM sum in their own order, as a GEMM library does) and writes the
residual sum exactly; bad inputs raise; the custom op compiles without a graph break; the layer loop runs every
layer through it on the Triton layer backend and agrees with the torch layer loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, DTYPES, TOLERANCES, poisoned_empty

EPS = 1e-6


def _inputs(B, n, K, N, dtype, seed=0, D=None):
    """x, residual [B, n, K], norm weight [K], weight [N, K] (|y| ~4: both silu tails), bias [N], cos / sin [n, D]."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, r = rnd(B, n, K).to(dtype).to(DEVICE), rnd(B, n, K).to(dtype).to(DEVICE)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype).to(DEVICE)
    w = (rnd(N, K) * 4 / K**0.5).to(dtype).to(DEVICE)
    bias = rnd(N).to(dtype).to(DEVICE)
    cos, sin = ref.rope_cos_sin(torch.arange(7, 7 + n, device=DEVICE), D or 8, 1e4)
    return x, r, nw, w, bias, cos, sin


def _close(got, want):
    atol, rtol = TOLERANCES[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=4 * atol, rtol=4 * rtol)  # reordered sums under 3-4 roundings


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_is_the_model_formula(dtype):
    x, r, nw, w, bias, cos, sin = _inputs(2, 5, 16, 4 * 8, dtype, D=8)
    s = x + r
    h = ref.rms_norm(s, nw, EPS)
    gate, up = F.linear(h, w).chunk(2, dim=-1)
    out = ops.norm_linear(x, w, "swiglu", norm_weight=nw, residual=r, eps=EPS, backend="torch")
    assert torch.equal(out.out, F.silu(gate) * up) and torch.equal(out.residual, s)
    y = F.linear(h, w, bias).view(2, 5, 4, 8)  # 4 heads: the first 3 rotated, the last as it is
    q, k = ref.rope(y[:, :, :2], y[:, :, 2:3], cos, sin)
    want = torch.cat([q, k, y[:, :, 3:]], dim=2).reshape(2, 5, 32)
    got = ops.norm_linear(x, w, "rope", norm_weight=nw, residual=r, eps=EPS, bias=bias, cos=cos, sin=sin, rot_heads=3,
                          backend="torch")
    assert torch.equal(got.out, want) and torch.equal(got.residual, s)
    plain = ops.norm_linear(x, w, "swiglu", backend="torch")  # no norm, no residual: the old gate_up_silu
    assert torch.equal(plain.out, ref.silu_mul(*F.linear(x, w).chunk(2, dim=-1))) and plain.residual is None


# (B, n, K, heads, D): ragged row / column tiles, K past one BLOCK_K step, a single row, a 64-wide head
SHAPES = [(1, 5, 40, 5, 8), (2, 35, 96, 3, 16), (1, 1, 8, 2, 4), (1, 9, 72, 2, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("prologue", ["add_norm", "norm", "none"])
def test_kernel_matches_reference(shape, prologue, dtype):
    B, n, K, H, D = shape
    x, r, nw, w, bias, cos, sin = _inputs(B, n, K, H * D, dtype, seed=1, D=D)
    kw = dict(norm_weight=None if prologue == "none" else nw, residual=r if prologue == "add_norm" else None, eps=EPS)
    for epilogue, extra in (("swiglu", {}), ("rope", dict(bias=bias, cos=cos, sin=sin, rot_heads=H - 1))):
        for fp32 in (False, True) if epilogue == "rope" else (False,):
            with poisoned_empty():
                got = ops.norm_linear(x, w, epilogue, **kw, **extra, rope_fp32=fp32, backend="triton")
            want = ref.norm_linear(x, w, epilogue, **kw, **extra, rope_fp32=fp32)
            _close(got.out, want[0])
            if prologue == "add_norm":  # the sum is one rounding of the same add: exact
                assert torch.equal(got.residual, want[1])
            else:
                assert got.residual is None


def test_kernel_small_tiles_per_request_tables_and_empty():
    """Tiles smaller than the problem in every dimension (several column tiles per half-head), [B, n, D] cos / sin
    (forward_requests' per-request tables), zero rows."""
    from lopa_fast.kernels.triton.norm_linear import norm_linear as tri

    x, r, nw, w, bias, cos, sin = _inputs(2, 9, 40, 3 * 64, torch.float32, seed=2, D=64)
    cos3 = torch.stack([cos, cos.flip(0)])
    sin3 = torch.stack([sin, sin.flip(0)])
    with poisoned_empty():
        got, s = tri(x, w, "rope", nw, r, EPS, bias, cos3, sin3, 2, tiles=(16, 16, 16))
        sw, _ = tri(x, w, "swiglu", nw, None, EPS, tiles=(16, 16, 16))
        empty = ops.norm_linear(x[:, :0], w, "swiglu", norm_weight=nw, residual=r[:, :0], backend="triton")
    want = ref.norm_linear(x, w, "rope", nw, r, EPS, bias, cos3, sin3, 2)
    _close(got, want[0])
    assert torch.equal(s, want[1])
    _close(sw, ref.norm_linear(x, w, "swiglu", nw, None, EPS)[0])
    assert empty.out.shape == (2, 0, 96) and empty.residual.shape == (2, 0, 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_forms_the_tables_from_positions(dtype):
    """positions ([n], or [B, n] per request) and inv_freq instead of cos / sin: the reference forms the tables as
    DecoderLM.rope_tables does (bitwise), the kernel forms them itself (within the dtype tolerance)."""
    B, n, K, H, D = 2, 9, 40, 4, 16
    x, r, nw, w, bias, _, _ = _inputs(B, n, K, H * D, dtype, seed=4, D=D)
    inv_freq = (1.0 / (1e4 ** (torch.arange(0, D, 2).float() / D))).to(DEVICE)
    for pos in (torch.arange(500, 500 + n, device=DEVICE),
                torch.stack([torch.arange(3, 3 + n), torch.arange(4000, 4000 + n)]).to(DEVICE)):
        freqs = pos.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        tables = ref.norm_linear(x, w, "rope", nw, r, EPS, bias, emb.cos(), emb.sin(), H - 1)
        want = ref.norm_linear(x, w, "rope", nw, r, EPS, bias, None, None, H - 1, False, pos, inv_freq)
        assert torch.equal(want[0], tables[0])
        with poisoned_empty():
            got = ops.norm_linear(x, w, "rope", norm_weight=nw, residual=r, eps=EPS, bias=bias, positions=pos,
                                  inv_freq=inv_freq, rot_heads=H - 1, backend="triton")
        _close(got.out, want[0])
        assert torch.equal(got.residual, want[1])


def test_bad_inputs_raise():
    x, r, nw, w, bias, cos, sin = _inputs(1, 3, 8, 16, torch.float32, D=8)
    cases = [
        (dict(epilogue="gelu"), ValueError, "epilogue='gelu'; allowed: swiglu, rope"),
        (dict(weight=w[:, :6]), ValueError, r"\[N, K\]"),
        (dict(weight=w[:15]), ValueError, "odd"),
        (dict(weight=w.half()), TypeError, "weight is"),
        (dict(norm_weight=nw[:4]), ValueError, "norm_weight must be None or a tensor of shape"),
        (dict(residual=r[:, :2]), ValueError, "residual must be None or a tensor of shape"),
        (dict(residual=r.half()), TypeError, "residual is"),
        (dict(eps=-1.0), ValueError, "eps=-1.0"),
        (dict(x=x.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "contiguous last dim"),
        (dict(backend="nope"), ValueError, "backend="),
        (dict(cos=cos), ValueError, "belong to epilogue 'rope'"),
        (dict(epilogue="rope"), ValueError, "needs cos and sin"),
        (dict(epilogue="rope", cos=cos[:2], sin=sin[:2]), ValueError, r"must both be \[n, D\]"),
        (dict(epilogue="rope", cos=cos.double(), sin=sin.double()), TypeError, "float32"),
        (dict(epilogue="rope", cos=cos, sin=sin, weight=w[:12]), ValueError, "whole heads of D = 8"),
        (dict(epilogue="rope", cos=cos, sin=sin, rot_heads=3), ValueError, r"rot_heads=3; allowed: an int in \[0, 2\]"),
        (dict(epilogue="rope", cos=cos, sin=sin, positions=torch.arange(3), inv_freq=torch.ones(4)), ValueError,
         "not both"),
        (dict(epilogue="rope", positions=torch.arange(3), inv_freq=torch.ones(4).double()), ValueError,
         "inv_freq must be a float32"),
        (dict(epilogue="rope", positions=torch.arange(4), inv_freq=torch.ones(4)), ValueError,
         r"positions must be an int \[n\] or \[B, n\] tensor"),
        (dict(positions=torch.arange(3), inv_freq=torch.ones(4)), ValueError, "belong to epilogue 'rope'"),
    ]
    for change, err, match in cases:
        kw = dict(x=x, weight=w, epilogue="swiglu", norm_weight=nw)
        kw.update(change)
        with pytest.raises(err, match=match):
            ops.norm_linear(kw.pop("x"), kw.pop("weight"), kw.pop("epilogue"), **kw)


def test_custom_op_opcheck_and_compile():
    x, r, nw, w, bias, cos, sin = _inputs(1, 4, 16, 32, torch.float16, D=8)
    op = torch.ops.lopa_fast.triton_norm_linear.default
    torch.library.opcheck(op, (x, w, "swiglu", nw, r, EPS, None, None, None, 0, False))
    torch.library.opcheck(op, (x, w, "rope", nw, None, EPS, bias, cos, sin, 3, False))

    def layer(x, r):
        a = ops.norm_linear(x, w, "rope", norm_weight=nw, residual=r, bias=bias, cos=cos, sin=sin, rot_heads=2,
                            check=False, backend="triton")
        return a.out * 2, a.residual

    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, r)
    want = layer(x, r)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_layer_loop_runs_every_layer_through_it(monkeypatch):
    """On the Triton layer ops a forward is TWO norm_linear calls a layer (q/k/v with RoPE, gate/up with SwiGLU), no
    separate norm / add_norm / rope / silu_mul, up to NORM_LINEAR_MAX_ROWS rows; past them the unfused loop. The
    logits and window K/V equal the torch layer loop's within tolerance (interpreter, fp32)."""
    from lopa_fast.models import static_forward as sf
    from lopa_fast.testing import random_model, tiny_hf_config

    model = random_model(tiny_hf_config("qwen2", vocab_size=64, num_kv_heads=2, num_layers=2), seed=3)
    cfg = model.config
    tokens = torch.randint(0, 64, (2, 6))
    L = 12
    ck = torch.randn(cfg.num_layers, L, cfg.num_kv_heads, cfg.head_dim)
    cv = torch.randn_like(ck)

    def fwd(backend):
        return model.forward_static(tokens, 5, ck, cv, 5, torch.tensor([6, 4]), None, "full", torch.arange(12),
                                    attn_backend=backend)

    want = fwd("torch")
    seen = []
    real = {name: getattr(ops, name) for name in ("norm_linear", "rms_norm", "add_rms_norm", "rope", "silu_mul")}
    for name, fn in real.items():
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _f=fn, **k: seen.append((_n, a[2] if _n == "norm_linear"
                                                                                    else None)) or _f(*a, **k))
    sf._LAYER_OPS.clear()
    try:
        got = fwd("triton")
        assert [s for s in seen if s[0] != "rms_norm"] == [("norm_linear", "rope"), ("norm_linear", "swiglu")] * 2
        assert seen.count(("rms_norm", None)) == 1  # the final norm, on the LM-head rows
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        # a device window start (a compiled / captured round): the kernel forms the RoPE tables from the positions
        monkeypatch.setattr(model, "rope_tables", lambda *a: pytest.fail("rope_tables on the norm_linear path"))
        got = model.forward_static(tokens, torch.tensor(5), ck, cv, torch.tensor(5), torch.tensor([6, 4]), None,
                                   "full", torch.arange(12), attn_backend="triton")
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        monkeypatch.undo()
        for name, fn in real.items():
            monkeypatch.setattr(ops, name, lambda *a, _n=name, _f=fn, **k: seen.append((_n, a[2] if _n == "norm_linear"
                                                                                        else None)) or _f(*a, **k))
        seen.clear()
        monkeypatch.setattr(sf, "NORM_LINEAR_MAX_ROWS", 11)  # 12 rows: the unfused loop
        fwd("triton")
        assert ("norm_linear", "rope") not in seen and ("rope", None) in seen and ("silu_mul", None) in seen
    finally:
        sf._LAYER_OPS.clear()


def test_forward_dual_on_the_triton_layer():
    """Fast-dLLM's dual-cache forward (`forward_dual`: the block's K/V into the cache in place, then attention over
    the whole cache) on the Triton layer ops, two requests packed, one with a host start and one with a device start
    (the kernel forms its RoPE tables): its logits, hidden rows and the caches it wrote equal the torch layer's within
    tolerance (interpreter, fp32)."""
    from lopa_fast.models import static_forward as sf
    from lopa_fast.testing import random_model, tiny_hf_config

    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2, num_layers=2), seed=4)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    L = 16
    caches = [(torch.randn(cfg.num_layers, L, cfg.num_kv_heads, cfg.head_dim, generator=g),
               torch.randn(cfg.num_layers, L, cfg.num_kv_heads, cfg.head_dim, generator=g)) for _ in range(2)]

    def run(backend, device_start):
        parts = []
        for r, (ck, cv) in enumerate(caches):
            start = 4 + 4 * r
            parts.append(dict(tokens=torch.randint(0, 60, (1, 4), generator=torch.Generator().manual_seed(r)),
                              start=torch.tensor(start) if device_start and r == 1 else start,
                              cache_k=ck.clone(), cache_v=cv.clone(), prefix_len=L, rows=torch.arange(4),
                              attn_backend=backend, output="hidden" if r == 1 else "logits"))
        return model.forward_dual(parts), [(p["cache_k"], p["cache_v"]) for p in parts]

    sf._LAYER_OPS.clear()
    try:
        want, want_caches = run("torch", False)
        for device_start in (False, True):
            got, got_caches = run("triton", device_start)
            assert got[0].shape == (4, cfg.vocab_size) and got[1].shape == (4, cfg.hidden_size)
            for a, b in zip(got + [t for c in got_caches for t in c], want + [t for c in want_caches for t in c]):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    finally:
        sf._LAYER_OPS.clear()
