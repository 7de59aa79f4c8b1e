"""branch_attention: Triton kernel (interpreter on CPU, compiled on GPU) vs the fp64 reference, 2x rule."""
from __future__ import annotations


import pytest
import torch

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import DEVICE, DTYPES, TOLERANCES, assert_2x_rule, attention_in_dtype, poisoned_empty

# (B, n, Hq, Hkv, D, cache_len): ragged GQA with odd sizes; no prefix; MHA with D not a power of two
SHAPES = [(3, 13, 6, 2, 24, 70), (2, 8, 4, 4, 16, 0), (2, 5, 4, 1, 32, 33)]


def make_inputs(shape, dtype, seed=0):
    B, n, Hq, Hkv, D, L = shape
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    q, kc, vc = r(B, n, Hq, D), r(L + 3, Hkv, D), r(L + 3, Hkv, D)  # +3: rows past cache_len must be ignored
    kw, vw = r(B, n, Hkv, D), r(B, n, Hkv, D)
    win_lens = torch.tensor([max(1, n - 4 * b) for b in range(B)], device=DEVICE)  # ragged, first is full
    block_ids = torch.sort(torch.randint(0, 3, (B, n), generator=g), dim=1).values.to(DEVICE)
    return q, kc, vc, L, kw, vw, win_lens, block_ids


@pytest.mark.parametrize("mode", ["full", "block_causal", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_branch_attention_matches_reference(shape, dtype, mode):
    q, kc, vc, L, kw, vw, win_lens, block_ids = make_inputs(shape, dtype)
    with poisoned_empty():
        o, lse = ops.branch_attention(q, kc, vc, L, kw, vw, win_lens, block_ids, mode, return_lse=True,
                                      backend="triton")
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
    d = lambda t: t.double()  # noqa: E731
    o_ref, lse_ref = ref.branch_attention(d(q), d(kc), d(vc), L, d(kw), d(vw), win_lens, block_ids, mode,
                                          return_lse=True)
    o_pt = attention_in_dtype(q, kc, vc, L, kw, vw, win_lens, block_ids, mode)
    assert_2x_rule("o", o, o_ref, o_pt)
    lse32 = ref.branch_attention(q.float(), kc.float(), vc.float(), L, kw.float(), vw.float(), win_lens, block_ids,
                                 mode, return_lse=True)[1]
    assert_2x_rule("lse", lse, lse_ref, lse32)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_branch_attention_prefix_splits(num_splits):
    """The flash-decoding split of the prefix merges back to the same result for any split count."""
    from lopa_fast.kernels.triton.branch_attention import branch_attention as tri

    q, kc, vc, L, kw, vw, win_lens, block_ids = make_inputs((2, 6, 4, 2, 16, 150), torch.float32, seed=1)
    with poisoned_empty():
        o = tri(q, kc, vc, L, kw, vw, win_lens, block_ids, "block_causal", num_splits=num_splits)
    o_ref = ref.branch_attention(q.double(), kc.double(), vc.double(), L, kw.double(), vw.double(), win_lens,
                                 block_ids, "block_causal")
    assert_2x_rule("o", o, o_ref, ref.branch_attention(q, kc, vc, L, kw, vw, win_lens, block_ids, "block_causal"))


def test_branch_attention_strided_views_and_no_win_lens():
    """Window K/V as views into a larger scratch buffer (as KVCache.window_kv returns them), win_lens=None."""
    B, n, Hq, Hkv, D, L = 2, 7, 4, 2, 16, 20
    q, kc, vc, _, _, _, _, _ = make_inputs((B, n, Hq, Hkv, D, L), torch.float32)
    scratch = torch.randn(2, 4, 9, Hkv, D, device=DEVICE)  # [K/V, Bmax, nmax, Hkv, D]
    kw, vw = scratch[0, :B, :n], scratch[1, :B, :n]
    assert not kw.is_contiguous()
    o = ops.branch_attention(q, kc, vc, L, kw, vw, None, None, "causal", backend="triton")
    o_ref = ref.branch_attention(q.double(), kc.double(), vc.double(), L, kw.double(), vw.double(), None, None,
                                 "causal")
    assert_2x_rule("o", o, o_ref, ref.branch_attention(q, kc, vc, L, kw, vw, None, None, "causal"))


@pytest.mark.gpu
@pytest.mark.parametrize("B, n, L", [(3, 32, 1024), (16, 128, 2048)])
def test_branch_attention_dream7b_shapes_gpu(B, n, L):
    """Dream-7B geometry in bf16 with the launcher's own tiles and prefix splits (auto backend)."""
    shape = (B, n, 28, 4, 128, L)
    q, kc, vc, L, kw, vw, win_lens, block_ids = make_inputs(shape, torch.bfloat16)
    block_ids = (torch.arange(n, device=DEVICE) // 32).expand(B, n).contiguous()
    o = ops.branch_attention(q, kc, vc, L, kw, vw, win_lens, block_ids, "block_causal")
    d = lambda t: t.double()  # noqa: E731
    o_ref = ref.branch_attention(d(q), d(kc), d(vc), L, d(kw), d(vw), win_lens, block_ids, "block_causal")
    assert_2x_rule("o", o, o_ref, attention_in_dtype(q, kc, vc, L, kw, vw, win_lens, block_ids, "block_causal"))


def test_branch_attention_empty_window():
    q, kc, vc, L, kw, vw, _, _ = make_inputs((2, 4, 4, 2, 16, 8), torch.float32)
    o = ops.branch_attention(q[:, :0], kc, vc, L, kw[:, :0], vw[:, :0], backend="triton")
    assert o.shape == (2, 0, 4, 16)


def test_branch_attention_auto_backend_is_torch_on_cpu():
    q, kc, vc, L, kw, vw, win_lens, block_ids = make_inputs(SHAPES[0], torch.float32)
    if DEVICE != "cpu":
        pytest.skip("CPU dispatch")
    o = ops.branch_attention(q, kc, vc, L, kw, vw, win_lens, block_ids, "full")
    torch.testing.assert_close(o, ref.branch_attention(q, kc, vc, L, kw, vw, win_lens, block_ids, "full"))


@pytest.mark.parametrize(
    "mutate, err, word",
    [
        (lambda a: a.update(q=a["q"][0]), ValueError, "q"),
        (lambda a: a.update(k_win=a["k_win"][:, :3]), ValueError, "k_win"),
        (lambda a: a.update(k_cache=a["k_cache"].half()), TypeError, "k_cache"),
        (lambda a: a.update(cache_len=10**6), ValueError, "cache_len"),
        (lambda a: a.update(mode="sliding"), ValueError, "mode"),
        (lambda a: a.update(mode="block_causal", block_ids=None), ValueError, "block_ids"),
        (lambda a: a.update(win_lens=a["win_lens"].float()), TypeError, "win_lens"),
        (lambda a: a.update(q=a["q"].transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError, "q"),
        (lambda a: a.update(backend="tpu"), ValueError, "backend"),
        (lambda a: a.update(backend="cuda"), ValueError, "backend"),
    ],
)
def test_branch_attention_bad_input(mutate, err, word):
    q, kc, vc, L, kw, vw, win_lens, block_ids = make_inputs((2, 16, 4, 2, 16, 8), torch.float32)
    a = dict(q=q, k_cache=kc, v_cache=vc, cache_len=L, k_win=kw, v_win=vw, win_lens=win_lens, block_ids=block_ids,
             mode="full")
    mutate(a)
    if a.get("backend") == "cuda" and DEVICE == "cuda":
        pytest.skip("a CUDA backend may exist on GPU")
    with pytest.raises(err, match=word):
        ops.branch_attention(**a)


def test_model_forward_window_on_triton_backend(monkeypatch):
    """The model runtime's three attention call sites (no cache, window over a cache with ragged lengths
    and block-causal mask, Fast-dLLM in-place) give the same logits on the Triton backend as on torch."""
    from lopa_fast.testing import random_model, tiny_hf_config

    model = random_model(tiny_hf_config("dream", num_heads=4, num_kv_heads=2, hidden_size=64), seed=1)
    tokens = torch.randint(0, 60, (3, 6))
    prompt = torch.randint(0, 60, (1, 9))
    block_ids = torch.tensor([[0, 0, 0, 1, 1, 1]] * 3)

    def run():
        out = [model(tokens, mask="full")]
        cache = model.new_cache(32)
        model.forward_window(prompt, cache=cache, commit=9)
        out.append(model.forward_window(tokens, cache=cache, mask="block_causal", block_ids=block_ids,
                                        win_lens=torch.tensor([6, 4, 5])))
        out.append(model.forward_window(prompt[:, 3:7], cache=cache, start=3))  # in place, B=1, full
        return out

    monkeypatch.setenv("LOPA_FAST_BACKEND", "torch")
    want = run()
    import lopa_fast.kernels.triton.branch_attention as tri

    calls = []
    launcher = tri.branch_attention
    monkeypatch.setattr(tri, "branch_attention", lambda *a, **k: calls.append(1) or launcher(*a, **k))
    monkeypatch.setenv("LOPA_FAST_BACKEND", "triton")
    got = run()
    assert len(calls) == 2 * 4  # 2 layers x 4 forwards, all on the Triton kernel
    for i, (a, b) in enumerate(zip(got, want)):
        atol, rtol = TOLERANCES[torch.float32]
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"call site {i}: {m}")


@pytest.mark.parametrize("provider", ["sdpa", "flex"])
def test_benchmark_baselines_compute_the_same_attention(provider):
    """bench/bench_ops.py's SDPA / FlexAttention baselines (dense layout, boolean or block mask) solve the
    same problem as the op, so the benchmark compares like with like."""
    from bench.bench_ops import _attn_fn

    if provider == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    q, kc, vc, L, kw, vw, win_lens, block_ids = make_inputs((2, 8, 4, 2, 16, 20), torch.float32)
    out = _attn_fn(provider, q, kc, vc, L, kw, vw, win_lens, block_ids)().transpose(1, 2)
    want = ref.branch_attention(q, kc, vc, L, kw, vw, win_lens, block_ids, "block_causal")
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
