"""The CUDA kernels' exact source, run on CPU through the host emulation (kernels/cuda/host_emu.cuh), vs the
reference ops. Checks what a GPU-less machine can check: index arithmetic, strides, masks, the prefix
split + LSE combine, tail/unaligned paths and the fp16/bf16 conversions. Shapes are tiny: every CUDA thread
is a std::thread here (~1 s per attention call on 2 cores)."""
from __future__ import annotations


import pytest
import torch

from lopa_fast.ops import _cuda
from lopa_fast.reference import ops as ref
from tests.utils import assert_2x_rule, attention_in_dtype, poisoned_empty

pytestmark = pytest.mark.skipif(_cuda.host_compiler() is None, reason="no host C++ compiler for the emulation")

DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def emu():
    try:
        return _cuda.emulator()
    except RuntimeError as e:  # e.g. a g++ older than 12 (no <barrier>)
        pytest.skip(f"host emulation does not build here: {e}")


def make_inputs(B, n, Hq, Hkv, D, L, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, kc, vc = r(B, n, Hq, D), r(L + 5, Hkv, D), r(L + 5, Hkv, D)  # rows past cache_len must be ignored
    kw, vw = r(B, n, Hkv, D), r(B, n, Hkv, D)
    win_lens = torch.tensor([max(1, n - 3 * b) for b in range(B)])  # ragged; the first branch is full
    block_ids = torch.sort(torch.randint(0, 3, (B, n), generator=g), dim=1).values
    return q, kc, vc, L, kw, vw, win_lens, block_ids


def check_attention(emu, inputs, mode, scale=None):
    q, kc, vc, L, kw, vw, wl, bid = inputs
    with poisoned_empty():
        o, lse = emu.branch_attention(q, kc, vc, L, kw, vw, wl, bid, mode, scale, True)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    d = lambda t: t.double()  # noqa: E731
    o_ref, lse_ref = ref.branch_attention(d(q), d(kc), d(vc), L, d(kw), d(vw), wl, bid, mode, scale, True)
    if q.dtype == torch.float32:
        torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    else:
        assert_2x_rule("o", o, o_ref, attention_in_dtype(q, kc, vc, L, kw, vw, wl, bid, mode, softmax_fp32=True))
    torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=1e-5)


# (B, n, Hq, Hkv, D, cache_len): GQA with a partial last row tile; MHA D=128; no prefix
@pytest.mark.parametrize("mode", ["full", "block_causal", "causal"])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_attention_d64_gqa(emu, dt, mode):
    check_attention(emu, make_inputs(3, 7, 6, 2, 64, 37, DT[dt]), mode)


@pytest.mark.parametrize("dt,mode", [("bf16", "block_causal"), ("f32", "causal")])
def test_attention_d128(emu, dt, mode):
    check_attention(emu, make_inputs(2, 5, 2, 2, 128, 45, DT[dt], seed=1), mode)


def test_attention_no_prefix_and_custom_scale(emu):
    check_attention(emu, make_inputs(2, 6, 4, 1, 64, 0, torch.float16, seed=2), "block_causal", scale=0.3)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_attention_prefix_splits_merge(emu, dt):
    """cache_len=300 is cut into 3 splits (the last one 44 keys, not a tile multiple) plus the window part."""
    inputs = make_inputs(1, 4, 2, 1, 64, 300, DT[dt], seed=3)
    S, split_len = _cuda.attention_splits(1, 4, 2, 1, 300, _cuda._EmuLauncher.num_sms,
                                          _cuda.attention_rows(DT[dt]))
    assert (S, split_len) == (3, 128)
    check_attention(emu, inputs, "full")


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_attention_in_place_mode_no_window_keys(emu, dt):
    """Fast-dLLM's in-place mode: win_lens = 0, every key comes from the cache (the window part is empty)."""
    q, kc, vc, L, kw, vw, _, _ = make_inputs(1, 6, 4, 2, 64, 40, DT[dt], seed=6)
    check_attention(emu, (q, kc, vc, L, kw, vw, torch.zeros(1, dtype=torch.long), None), "full")


def test_attention_window_longer_than_a_key_tile(emu):
    """n=70: the tensor-core kernel's window runs two 64-key tiles and three 64-row tiles per branch."""
    check_attention(emu, make_inputs(1, 70, 2, 1, 64, 5, torch.float16, seed=5), "block_causal")


def test_attention_strided_views(emu):
    """q and window K/V as views into larger buffers (kernel strides), the cache as one layer of [layers, L, Hkv, D]."""
    B, n, Hq, Hkv, D, L = 2, 5, 4, 2, 64, 20
    g = torch.Generator().manual_seed(4)
    big_q = torch.randn(B, n + 2, 2 * Hq, D, generator=g)
    scratch = torch.randn(2, 3, n + 3, Hkv, D, generator=g)  # [K/V, Bmax, nmax, Hkv, D]
    cache = torch.randn(2, 3, L + 4, Hkv, D, generator=g)  # [K/V, layers, Lmax, Hkv, D]
    q, kw, vw = big_q[:, 1 : n + 1, Hq:], scratch[0, :B, :n], scratch[1, :B, :n]
    assert not q.is_contiguous() and not kw.is_contiguous()
    check_attention(emu, (q, cache[0, 1], cache[1, 1], L, kw, vw, None, None), "causal")


def emu_vs_reference(emu, x, suppress=None):
    with poisoned_empty():
        got = emu.confidence(x, suppress)
    want = ref.confidence(x, suppress)
    assert torch.equal(got.token, want.token), (got.token, want.token)
    for name in ("p_max", "margin", "neg_entropy", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=2e-6, rtol=2e-6, msg=name)
    return got


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_confidence_tail_and_suppress(emu, dt):
    """V=1003: a vectorised head plus a scalar tail; the suppressed id is the row's true argmax."""
    x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(5)).mul(3).to(DT[dt])
    x[:, 17] = 20.0
    got = emu_vs_reference(emu, x, suppress=17)
    assert (got.token != 17).all()


def test_confidence_unaligned_rows_ties_and_neg_inf(emu):
    """Rows at an odd element offset (the scalar path), exact ties (lowest index, margin 0), -inf logits."""
    base = torch.randn(4, 262, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x = base[:, 1:]  # stride 262, data pointer 2 bytes past alignment
    x[0, 40] = x[0, 200] = 9.0  # tie: lowest index wins, margin exactly 0
    x[1, :] = float("-inf")
    x[1, 100] = 0.0  # a single finite logit: p_max 1, margin 1
    got = emu_vs_reference(emu, x)
    assert got.token[0] == 40 and got.margin[0] == 0 and got.margin[1] == 1


@pytest.mark.parametrize("aligned", [True, False])
def test_confidence_split_v_path(emu, aligned):
    """Few rows: the vocabulary is cut into splits (3 launches, ordered merge); a tie across two splits keeps
    the lowest index, the suppressed id sits in split 0, the unaligned variant runs every split scalar."""
    base = torch.randn(2, 20001, generator=torch.Generator().manual_seed(7)).mul(3).to(torch.bfloat16)
    x = base[:, :20000] if aligned else base[:, 1:]
    assert _cuda.confidence_splits(2, x.shape[1], _cuda._EmuLauncher.num_sms)[0] == 4
    x[0, 4999] = x[0, 15000] = 25.0  # splits 0 and 3 (chunk 5000)
    x[1, 7] = 30.0
    got = emu_vs_reference(emu, x, suppress=7)
    assert got.token[0] == 4999 and got.margin[0] == 0 and got.token[1] != 7
    one_cta = emu.confidence(x, 7, split=False)
    assert torch.equal(one_cta.token, got.token)


def random_round(B, n, nb, seed):
    g = torch.Generator().manual_seed(seed)
    value, conf = torch.rand(B, n, generator=g), torch.rand(B, n, generator=g)
    masked = torch.rand(B, n, generator=g) < 0.7
    block_ids = torch.sort(torch.randint(-1, nb, (B, n), generator=g), dim=1).values
    complete = torch.rand(B, nb, generator=g) < 0.6
    return value, conf, masked, block_ids, complete, torch.rand(B, generator=g), torch.rand(B, generator=g) < 0.8


def check_round(emu, *args):
    got, want = emu.select_round(*args), ref.select_round(*args)
    assert torch.equal(got.accept, want.accept)
    assert torch.equal(got.lookahead, want.lookahead)
    torch.testing.assert_close(got.score, want.score, atol=1e-6, rtol=1e-6)  # summation order: <= 1 ulp
    assert got.winner.item() == want.winner.item()
    return got


# B > 8 makes warps loop over branches; n > 32 gives lanes several positions; nb up to 4 fallback blocks
@pytest.mark.parametrize("B,n,nb,seed", [(3, 16, 2, 0), (9, 70, 4, 1), (1, 7, 1, 2), (4, 64, 2, 3)])
@pytest.mark.parametrize("cmp,tau,n_look,topp,alpha", [("gt", 0.9, 3, 0.5, 0.3), ("ge", 0.95, 0, 1.0, 0.0),
                                                       ("le", 0.05, 5, 0.25, 0.7)])
def test_select_round_matches_reference(emu, B, n, nb, seed, cmp, tau, n_look, topp, alpha):
    value, conf, masked, bid, complete, cc, active = random_round(B, n, nb, seed)
    check_round(emu, value, conf, masked, bid, complete, tau, cmp, n_look, topp, alpha, cc, active)


def test_select_round_ties_padding_and_unread_nan(emu):
    """Equal branches -> the earliest wins; more lookahead slots than candidates -> -1 padding; NaN at
    unmasked positions is never read; bf16 conf is upcast like the reference."""
    value, conf, masked, bid, complete, _, _ = random_round(1, 12, 2, 4)
    rep = lambda t: t.expand(3, *t.shape[1:]).clone()  # noqa: E731
    value, conf, masked, bid, complete = map(rep, (value, conf, masked, bid, complete))
    conf[~masked] = float("nan")
    got = check_round(emu, value, conf.to(torch.bfloat16), masked, bid, complete, 0.5, "gt", 12, 1.0, 0.0, None,
                      None)
    assert got.winner.item() == 0 and (got.lookahead[:, -1] == -1).all()
    none_active = torch.zeros(3, dtype=torch.bool)
    got = check_round(emu, value, conf, masked, bid, complete, 0.5, "gt", 2, 1.0, 0.0, None, none_active)
    assert got.winner.item() == -1


def test_model_forward_window_through_the_emulated_kernels(emu, monkeypatch):
    """The model's real call sites (prefill + commit, cache layer views, window scratch views, ragged
    block-causal branch windows, Fast-dLLM in-place mode) routed to the emulated CUDA attention: a bf16 model
    stays within 2x the error of the same model on the torch backend, both against the fp32 model."""
    from lopa_fast.ops import _backend
    from lopa_fast.testing import random_model, tiny_hf_config

    calls = []

    def counted(*args):
        calls.append(args[0].dtype)
        return emu.branch_attention(*args)

    monkeypatch.setattr(_cuda, "branch_attention", counted)
    usable = _backend._usable
    monkeypatch.setattr(_backend, "_usable", lambda op, b, dev: None if b == "cuda" else usable(op, b, dev))
    cfg = tiny_hf_config("dream", vocab_size=96, hidden_size=256, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2)  # head_dim 64, GQA 2
    g = torch.Generator().manual_seed(0)
    prompt, win = torch.randint(0, 90, (1, 20), generator=g), torch.randint(0, 90, (2, 16), generator=g)
    bid, wl = (torch.arange(16) // 8).expand(2, 16).contiguous(), torch.tensor([16, 9])

    def run(dtype, backend):
        monkeypatch.setenv("LOPA_FAST_BACKEND", backend)
        model = random_model(cfg, dtype=dtype)
        cache = model.new_cache(64)
        model.forward_window(prompt, cache=cache, commit=20)
        branches = model.forward_window(win, cache=cache, mask="block_causal", block_ids=bid, win_lens=wl)
        inplace = model.forward_window(win[:1, :8], cache=cache, start=12)  # overwrites cache rows 12..19
        return branches.float(), inplace.float()

    exact, got, torch_bf16 = run(torch.float32, "torch"), run(torch.bfloat16, "cuda"), run(torch.bfloat16, "torch")
    assert calls == [torch.bfloat16] * 6  # 3 forwards x 2 layers, all on the emulated kernel
    rows = torch.arange(16)[None, :] < wl[:, None]
    assert_2x_rule("branch logits", got[0][rows], exact[0][rows], torch_bf16[0][rows], slack=1e-3)
    assert_2x_rule("in-place logits", got[1], exact[1], torch_bf16[1], slack=1e-3)


def test_emulation_flags_misaligned_vector_access(emu, monkeypatch):
    """The loader copies unaligned inputs; bypassing that, the emulation reports the access a GPU would fault on."""
    monkeypatch.setattr(_cuda, "_aligned", lambda t, vec: t)
    q = torch.randn(2 * 2 * 64 + 1).to(torch.bfloat16)[1:].view(1, 2, 2, 64)  # 2 bytes past 16-byte alignment
    kc, kw = torch.randn(8, 1, 64).to(torch.bfloat16), torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="misaligned vector accesses"):
        emu.branch_attention(q, kc, kc, 8, kw, kw)
