"""branch_attention on every backend: torch (the reference), Triton (interpreter on CPU, compiled on GPU), the CUDA
kernels (host emulation on CPU, NVRTC-compiled on a GPU) vs the fp64 reference, 2x rule."""
from __future__ import annotations


import pytest
import torch

from lopa_fast import ops
from lopa_fast.reference import attention_modes
from lopa_fast.reference import ops as ref
from lopa_fast.ops import cuda
from lopa_fast.ops.cuda import launch
from lopa_fast.decode.compiled import CompiledRounds
from lopa_fast.ops.cuda.emulation import EmuLauncher
from tests.utils import (  # noqa: F401 - cuda_emu, cuda_kernels: fixtures
    DEVICE,
    DTYPES,
    TOLERANCES,
    assert_2x_rule,
    attention_in_dtype,
    cuda_emu,
    cuda_kernels,
    make_attention_inputs,
    poisoned_empty,
)

make_inputs = make_attention_inputs

# (B, n, Hq, Hkv, D, cache_len): ragged GQA with odd sizes; no prefix; MHA with D not a power of two
SHAPES = [(3, 13, 6, 2, 24, 70), (2, 8, 4, 4, 16, 0), (2, 5, 4, 1, 32, 33)]


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


@pytest.mark.parametrize("pooled", [False, True])
def test_one_launch_when_the_prefix_fits_one_split(monkeypatch, pooled):
    """A prefix of one split (<= 4 key tiles here, or num_splits=1) is read by the window kernel itself: ONE launch
    (no prefix kernel, no partials), equal to the reference and to the two-launch split path; past 4 key tiles the
    default plan splits again (two launches). Pooled: the slot's base and length per branch, as the split path.
    (float32 on a GPU keeps two launches: `one_launch`.)"""
    from lopa_fast.kernels.triton import branch_attention as tri

    launches = []
    real = tri._prefix_kernel
    monkeypatch.setattr(tri, "_prefix_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: launches.append(grid) or real[grid]})())
    _, bn, _ = tri.block_sizes(torch.float32)
    for L in (4 * bn, 4 * bn + 1):
        if pooled:
            inputs = pool_inputs(3, 5, 4, 2, 16, L, torch.float32, seed=4)
            q, kc, vc, cl, kw, vw, wl, bid, idx = inputs
        else:
            q, kc, vc, cl, kw, vw, wl, bid = make_inputs((2, 5, 4, 2, 16, L), torch.float32, seed=3)
            idx = None
        want = ref.branch_attention(q.double(), kc.double(), vc.double(), cl, kw.double(), vw.double(), wl, bid,
                                    "block_causal", cache_index=idx)
        outs = {}
        for splits in (None, 1, 2):
            launches.clear()
            with poisoned_empty():
                outs[splits] = tri.branch_attention(q, kc, vc, cl, kw, vw, wl, bid, "block_causal", num_splits=splits,
                                                    cache_index=idx)
            one = (splits == 1 or (splits is None and L == 4 * bn)) and tri.one_launch(1, q.dtype)  # (GPU fp32: 2)
            assert len(launches) == (0 if one else 1), (L, splits, launches)
            torch.testing.assert_close(outs[splits].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1], outs[2], atol=1e-5, rtol=1e-5)
        if pooled:  # each row is its single call, bitwise, on both paths
            for splits in (1, 2):
                for b in range(q.shape[0]):
                    ob = tri.branch_attention(*single_row(inputs, b), "block_causal", num_splits=splits)
                    assert torch.equal(tri.branch_attention(q, kc, vc, cl, kw, vw, wl, bid, "block_causal",
                                                            num_splits=splits, cache_index=idx)[b : b + 1], ob)


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


# ------------------------------------------------- device cache_len (graph-safe: no host read of the length)
LMAX = 70


def _device_len_inputs(dtype, seed=7, device=DEVICE):
    """Inputs over a static [LMAX, Hkv, D] cache (no extra rows: cache_len = LMAX is the full buffer)."""
    return make_attention_inputs((2, 5, 4, 2, 16, LMAX), dtype, seed, device=device, extra_rows=0)


@pytest.mark.parametrize("cache_len", [0, 33, LMAX])
@pytest.mark.parametrize("mode", ["full", "block_causal"])
def test_branch_attention_triton_device_cache_len(cache_len, mode):
    """A 0-d int64 cache_len tensor (grid and splits from Lmax, the kernel reads the length) equals the int path
    and the reference, for an empty, a partial and a full prefix."""
    from lopa_fast.kernels.triton.branch_attention import branch_attention as tri

    q, kc, vc, _, kw, vw, wl, bid = _device_len_inputs(torch.float32)
    cl = torch.tensor(cache_len, dtype=torch.int64, device=q.device)
    with poisoned_empty():
        o_t, lse_t = ops.branch_attention(q, kc, vc, cl, kw, vw, wl, bid, mode, return_lse=True, backend="triton")
        o_i, lse_i = tri(q, kc, vc, cache_len, kw, vw, wl, bid, mode, return_lse=True)
    d = lambda t: t.double()  # noqa: E731
    o_ref, lse_ref = ref.branch_attention(d(q), d(kc), d(vc), cache_len, d(kw), d(vw), wl, bid, mode,
                                          return_lse=True)
    torch.testing.assert_close(o_t, o_i, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_t, lse_i, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o_t.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_t.double(), lse_ref, atol=1e-5, rtol=1e-5)
    # the reference itself takes the tensor too (rows >= cache_len masked)
    torch.testing.assert_close(ref.branch_attention(d(q), d(kc), d(vc), cl, d(kw), d(vw), wl, bid, mode), o_ref)


def test_branch_attention_triton_device_cache_len_int32_and_split_count():
    """int32 length tensors work; a forced split count over Lmax leaves the splits past cache_len empty."""
    from lopa_fast.kernels.triton.branch_attention import branch_attention as tri

    q, kc, vc, _, kw, vw, wl, bid = _device_len_inputs(torch.float32, seed=8)
    o_ref = ref.branch_attention(q.double(), kc.double(), vc.double(), 20, kw.double(), vw.double(), wl, bid,
                                 "causal")
    for splits in (1, 3):
        o = tri(q, kc, vc, torch.tensor(20, dtype=torch.int32), kw, vw, wl, bid, "causal", num_splits=splits)
        torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_len", [0, 37, 300])
def test_cuda_emu_attention_device_cache_len(cuda_emu, cache_len):
    """The CUDA kernels with the length as a device int64 (splits sized for Lmax = 300, those past cache_len
    empty) equal the int path and the reference: empty, mid and full prefix."""
    for dt in ("f32", "bf16"):
        q, kc, vc, _, kw, vw, wl, bid = make_attention_inputs((1, 4, 2, 1, 64, 300), DT[dt], 9, device="cpu",
                                                              extra_rows=0, len_step=1)
        cl = torch.tensor(cache_len, dtype=torch.int64)
        with poisoned_empty():
            o_t, lse_t = cuda_emu.branch_attention(q, kc, vc, cl, kw, vw, wl, bid, "block_causal", None, True)
            o_i, lse_i = cuda_emu.branch_attention(q, kc, vc, cache_len, kw, vw, wl, bid, "block_causal", None, True)
        torch.testing.assert_close(o_t.float(), o_i.float(), atol=1e-5 if dt == "f32" else 1e-2, rtol=1e-5)
        torch.testing.assert_close(lse_t, lse_i, atol=2e-5, rtol=1e-5)
        check_attention(cuda_emu, (q, kc, vc, cache_len, kw, vw, wl, bid), "block_causal")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_branch_attention_device_cache_len_cuda_graph(backend):
    """A branch_attention call captured in a torch.cuda.CUDAGraph with a device cache_len replays at the length
    the tensor holds at replay time (the graph baked in no value)."""
    if backend == "cuda" and not cuda.available():
        pytest.skip(f"CUDA kernels unavailable: {cuda.why_unavailable()}")
    q, kc, vc, _, kw, vw, wl, bid = make_attention_inputs((3, 32, 28, 4, 128, 1024), torch.bfloat16, 11,
                                                          device="cuda", extra_rows=0)
    cl = torch.tensor(1000, dtype=torch.int64, device="cuda")

    def call():
        return ops.branch_attention(q, kc, vc, cl, kw, vw, wl, bid, "block_causal", backend=backend, check=False)

    replay, out = CompiledRounds.capture(call, call)  # warm-up (kernel compile) on a side stream, then the graph
    d = lambda t: t.double()  # noqa: E731
    for new_len in (1000, 17, 0, 1024, 512):
        cl.fill_(new_len)
        replay()
        torch.cuda.synchronize()
        o_ref = ref.branch_attention(d(q), d(kc), d(vc), new_len, d(kw), d(vw), wl, bid, "block_causal")
        o_pt = attention_in_dtype(q, kc, vc, new_len, kw, vw, wl, bid, "block_causal")
        assert_2x_rule(f"o@{new_len}", out, o_ref, o_pt)


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


# ----------------------------------------------------------------------------------------------------------------
# CUDA kernels (kernels/cuda/branch_attention.cu): the exact source on CPU through the host emulation (index
# arithmetic, strides, masks, the prefix split + LSE combine, fp16/bf16 conversions; tiny shapes: every CUDA
# thread is a std::thread, ~1 s per call on 2 cores), then on a GPU (`gpu`).
DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
EMU_SMS = EmuLauncher.num_sms


def emu_inputs(B, n, Hq, Hkv, D, L, dtype, seed=0):
    """CPU inputs of the CUDA tests: 5 cache rows past cache_len, win_lens n - 3 b."""
    return make_attention_inputs((B, n, Hq, Hkv, D, L), dtype, seed, device="cpu", extra_rows=5, len_step=3)


def to_cuda(inputs):
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs)


def check_attention(cuda_emu, inputs, mode, scale=None):
    q, kc, vc, L, kw, vw, wl, bid = inputs
    with poisoned_empty():
        o, lse = cuda_emu.branch_attention(q, kc, vc, L, kw, vw, wl, bid, mode, scale, True)
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
def test_cuda_emu_attention_d64_gqa(cuda_emu, dt, mode):
    check_attention(cuda_emu, emu_inputs(3, 7, 6, 2, 64, 37, DT[dt]), mode)


@pytest.mark.parametrize("dt,mode", [("bf16", "block_causal"), ("f32", "causal")])
def test_cuda_emu_attention_d128(cuda_emu, dt, mode):
    check_attention(cuda_emu, emu_inputs(2, 5, 2, 2, 128, 45, DT[dt], seed=1), mode)


def test_cuda_emu_attention_no_prefix_and_custom_scale(cuda_emu):
    check_attention(cuda_emu, emu_inputs(2, 6, 4, 1, 64, 0, torch.float16, seed=2), "block_causal", scale=0.3)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_cuda_emu_attention_prefix_splits_merge(cuda_emu, dt):
    """cache_len=300 is cut into 3 splits (the last one 44 keys, not a tile multiple) plus the window part."""
    inputs = emu_inputs(1, 4, 2, 1, 64, 300, DT[dt], seed=3)
    S, split_len = launch.attention_splits(1, 4, 2, 1, 300, EMU_SMS,
                                          launch.attention_rows(DT[dt]))
    assert (S, split_len) == (3, 128)
    check_attention(cuda_emu, inputs, "full")


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cuda_emu_attention_in_place_mode_no_window_keys(cuda_emu, dt):
    """Fast-dLLM's in-place mode: win_lens = 0, every key comes from the cache (the window part is empty)."""
    q, kc, vc, L, kw, vw, _, _ = emu_inputs(1, 6, 4, 2, 64, 40, DT[dt], seed=6)
    check_attention(cuda_emu, (q, kc, vc, L, kw, vw, torch.zeros(1, dtype=torch.long), None), "full")


def test_cuda_emu_attention_window_longer_than_a_key_tile(cuda_emu):
    """n=70: the tensor-core kernel's window runs two 64-key tiles and three 64-row tiles per branch."""
    check_attention(cuda_emu, emu_inputs(1, 70, 2, 1, 64, 5, torch.float16, seed=5), "block_causal")


def test_cuda_emu_attention_strided_views(cuda_emu):
    """q and window K/V as views into larger buffers (kernel strides), the cache as one layer of [layers, L, Hkv, D]."""
    B, n, Hq, Hkv, D, L = 2, 5, 4, 2, 64, 20
    g = torch.Generator().manual_seed(4)
    big_q = torch.randn(B, n + 2, 2 * Hq, D, generator=g)
    scratch = torch.randn(2, 3, n + 3, Hkv, D, generator=g)  # [K/V, Bmax, nmax, Hkv, D]
    cache = torch.randn(2, 3, L + 4, Hkv, D, generator=g)  # [K/V, layers, Lmax, Hkv, D]
    q, kw, vw = big_q[:, 1 : n + 1, Hq:], scratch[0, :B, :n], scratch[1, :B, :n]
    assert not q.is_contiguous() and not kw.is_contiguous()
    check_attention(cuda_emu, (q, cache[0, 1], cache[1, 1], L, kw, vw, None, None), "causal")


def test_cuda_emu_model_forward_window(cuda_emu, monkeypatch):
    """The model's real call sites (prefill + commit, cache layer views, window scratch views, ragged
    block-causal branch windows, Fast-dLLM in-place mode) routed to the emulated CUDA attention: a bf16 model
    stays within 2x the error of the same model on the torch backend, both against the fp32 model."""
    from lopa_fast.ops import _backend
    from lopa_fast.testing import random_model, tiny_hf_config

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return cuda_emu.branch_attention(*args, **kwargs)

    monkeypatch.setattr(cuda, "branch_attention", counted)
    usable = _backend._usable
    monkeypatch.setattr(_backend, "_usable", lambda op, b, dev, args=(): None if b == "cuda" else usable(op, b, dev, args))
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


def test_cuda_emu_flags_misaligned_vector_access(cuda_emu, monkeypatch):
    """The loader copies unaligned inputs; bypassing that, the emulation reports the access a GPU would fault on."""
    monkeypatch.setattr(launch, "aligned", lambda t, vec: t)
    q = torch.randn(2 * 2 * 64 + 1).to(torch.bfloat16)[1:].view(1, 2, 2, 64)  # 2 bytes past 16-byte alignment
    kc, kw = torch.randn(8, 1, 64).to(torch.bfloat16), torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="misaligned vector accesses"):
        cuda_emu.branch_attention(q, kc, kc, 8, kw, kw)


# (B, n, Hq, Hkv, D, cache_len): Dream-7B heads (28/4, D=128) with LoPA-sized windows; a prefix that
# needs several splits and ends mid-tile; D=64 MHA; no prefix; one branch of one position.
CUDA_SHAPES = [(3, 32, 28, 4, 128, 1000), (9, 33, 28, 4, 128, 517), (2, 17, 8, 8, 64, 70), (4, 9, 6, 2, 64, 0),
               (1, 1, 28, 4, 128, 1)]


@pytest.mark.parametrize("mode", ["full", "block_causal", "causal"])
@pytest.mark.parametrize("dt", list(DT))
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.gpu
def test_branch_attention_cuda_matches_reference(cuda_kernels, shape, dt, mode):
    q, kc, vc, L, kw, vw, wl, bid = to_cuda(emu_inputs(*shape, DT[dt]))
    with poisoned_empty():
        o, lse = ops.branch_attention(q, kc, vc, L, kw, vw, wl, bid, mode, return_lse=True, backend="cuda")
    d = lambda t: t.double()  # noqa: E731
    o_ref, lse_ref = ref.branch_attention(d(q), d(kc), d(vc), L, d(kw), d(vw), wl, bid, mode, return_lse=True)
    if dt == "f32":
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-5)
    else:
        assert_2x_rule("o", o, o_ref, attention_in_dtype(q, kc, vc, L, kw, vw, wl, bid, mode))
    torch.testing.assert_close(lse.double(), lse_ref, atol=5e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_model_forward_window(cuda_kernels, monkeypatch):
    """A bf16 model (D=128, GQA) whose attention runs on the CUDA kernels stays within 2x the error of the same
    model on the torch backend, both against the fp32 model (prefill + commit, then 3 ragged branch windows)."""
    from lopa_fast.testing import random_model, tiny_hf_config

    cfg = tiny_hf_config("dream", vocab_size=256, hidden_size=512, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 250, (1, 40), generator=g).cuda()
    win = torch.randint(0, 250, (3, 32), generator=g).cuda()
    bid = (torch.arange(32) // 16).expand(3, 32).contiguous().cuda()
    wl = torch.tensor([32, 32, 16]).cuda()

    def run(dtype, backend):
        monkeypatch.setenv("LOPA_FAST_BACKEND", backend)
        model = random_model(cfg, dtype=dtype).cuda()
        cache = model.new_cache(128, device="cuda")
        model.forward_window(prompt, cache=cache, commit=40)
        return model.forward_window(win, cache=cache, mask="block_causal", block_ids=bid, win_lens=wl).float()

    exact = run(torch.float32, "torch")
    got, torch_bf16 = run(torch.bfloat16, "cuda"), run(torch.bfloat16, "torch")
    rows = torch.arange(32, device="cuda")[None, :] < wl[:, None]  # padding rows are not compared
    assert_2x_rule("logits", got[rows], exact[rows], torch_bf16[rows], slack=1e-3)


def test_explicit_cuda_refuses_head_dims_without_a_kernel(monkeypatch):
    """backend="cuda" runs the CUDA kernel or raises naming why: D=96 has no kernel, so even where the CUDA path
    is available the call is refused (it used to run the reference silently)."""
    from lopa_fast.ops.cuda import probe

    monkeypatch.setattr(probe, "probe", lambda: None)  # as on a GPU machine with CuPy
    q, kc, vc, L, kw, vw, wl, bid = make_attention_inputs((1, 3, 2, 1, 96, 4), torch.float32, device="cpu")
    assert "D=96" in cuda.unsupported("branch_attention", q)
    with pytest.raises(ValueError, match="backend='cuda' is unavailable: head dim D=96"):
        ops.branch_attention(q, kc, vc, L, kw, vw, wl, bid, "causal", backend="cuda")
    with pytest.raises(ValueError, match="cuda branch_attention: head dim D=96"):
        cuda.branch_attention(q, kc, vc, L, kw, vw, wl, bid, "causal")  # the hook itself, called directly
    q64, kc64, vc64, _, kw64, vw64, _, _ = make_attention_inputs((1, 3, 2, 1, 64, 4), torch.float32, device="cpu")
    with pytest.raises(ValueError, match="tensors are on cpu"):  # a supported shape: the device is the reason
        ops.branch_attention(q64, kc64, vc64, L, kw64, vw64, backend="cuda")


def test_auto_backend_skips_a_cuda_kernel_that_cannot_take_the_call(monkeypatch):
    """auto on a CUDA tensor moves past a kernel backend whose kernel cannot take the shape (here: cuda first,
    D=96) instead of raising; the dispatcher consults cuda.unsupported with the op's arguments."""
    from lopa_fast.ops import _backend

    q = torch.empty(1, 3, 2, 96)
    monkeypatch.setattr(cuda, "available", lambda op=None: True)
    monkeypatch.setattr(_backend, "AUTO_ORDER", ("cuda",))
    assert _backend._usable("branch_attention", "cuda", torch.device("cuda"), (q,)).startswith("head dim D=96")
    assert _backend.resolve("branch_attention", None, torch.device("cuda"), (q,)) == "torch"


# ------------------------------------------------- torch.library registration (Triton, interpreter on CPU)
def test_triton_branch_attention_custom_op_opcheck_and_fullgraph_compile():
    """lopa_fast::triton_branch_attention passes torch.library.opcheck (int and device cache_len, optional
    tensors given and None) and torch.compile(fullgraph=True) traces the public op with no graph break."""
    q, kc, vc, _, kw, vw, wl, bid = _device_len_inputs(torch.float32, seed=12)
    cl = torch.tensor(33, dtype=torch.int64, device=q.device)
    op = torch.ops.lopa_fast.triton_branch_attention.default
    pq, pk, pv, pcl, pkw, pvw, pwl, pbid, pidx = pool_inputs(3, 4, 4, 2, 16, 40, torch.float32, seed=12)
    for args in [(q, kc, vc, cl, LMAX, kw, vw, wl, bid, "block_causal", None, True),
                 (q, kc, vc, None, 33, kw, vw, None, None, "causal", 0.3, False),
                 (pq, pk, pv, pcl, 40, pkw, pvw, pwl, pbid, "block_causal", None, True, pidx)]:  # pooled
        torch.library.opcheck(op, args)

    def f(q, cl):
        return ops.branch_attention(q, kc, vc, cl, kw, vw, wl, bid, "block_causal", return_lse=True,
                                    backend="triton", check=False)

    want_o, want_lse = f(q, cl)
    got_o, got_lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, cl)
    torch.testing.assert_close(got_o, want_o, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=0, rtol=0)

    def pooled(q, cache_len, cache_index):
        return ops.branch_attention(q, pk, pv, cache_len, pkw, pvw, pwl, pbid, "block_causal", backend="triton",
                                    check=False, cache_index=cache_index)

    torch.testing.assert_close(torch.compile(pooled, backend="aot_eager", fullgraph=True)(pq, pcl, pidx),
                               pooled(pq, pcl, pidx), atol=0, rtol=0)


# ------------------------------------------ pooled form: B requests' rows over one static pool [S, Lmax, Hkv, D]
# The contract (issue 15's batched round builds on it): row b of a pooled call is BITWISE the single-request call
# for that row alone on its slot (k_cache[slot], cache_len[slot] as a 0-d tensor: the masked static-buffer path)
# on the same backend, so a request's sums never see another request's keys nor depend on who shares the call.
def pool_inputs(B, n, Hq, Hkv, D, Lmax, dtype, seed=0, device=DEVICE, S=3):
    """(q, k_pool, v_pool, cache_len [S], k_win, v_win, win_lens, block_ids, cache_index [B]): slot lengths
    Lmax (full), 0 (empty) and a partial one; rows share slots (two rows per request slot where B allows)."""
    q, _, _, _, kw, vw, wl, bid = make_attention_inputs((B, n, Hq, Hkv, D, Lmax), dtype, seed, device=device)
    g = torch.Generator().manual_seed(seed + 100)
    kp = torch.randn(S, Lmax, Hkv, D, generator=g).to(dtype).to(device)
    vp = torch.randn(S, Lmax, Hkv, D, generator=g).to(dtype).to(device)
    cl = torch.tensor([Lmax, 0, (2 * Lmax) // 3][:S], device=device)
    idx = torch.tensor([(2, 0, 2, 1, 0)[b % 5] % S for b in range(B)], device=device)
    return q, kp, vp, cl, kw, vw, wl, bid, idx


def single_row(inputs, b):
    """The single-request arguments of pooled row b: (q, k_cache, v_cache, 0-d cache_len, k_win, v_win, win_lens,
    block_ids) on b's slot."""
    q, kp, vp, cl, kw, vw, wl, bid, idx = inputs
    s = int(idx[b])
    r = slice(b, b + 1)
    return q[r], kp[s], vp[s], cl[s].reshape(()), kw[r], vw[r], wl[r], bid[r]


# (B, n, Hq, Hkv, D, Lmax): GQA ragged; MHA (G = 1) with one window position; a one-row pool (the einsum path);
# Dream-7B heads at a 300-row pool (big enough for MKL's blocked GEMM paths)
POOL_SHAPES = [(4, 13, 6, 2, 24, 70), (3, 1, 4, 4, 16, 33), (3, 5, 4, 2, 16, 1), (3, 16, 28, 4, 128, 300)]


@pytest.mark.parametrize("mode", ["full", "block_causal", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", POOL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pooled_torch_backend_is_bitwise_the_single_call_per_row(shape, dtype, mode):
    """The public op's torch backend (the reference) pooled == the reference per row on the row's slot."""
    inputs = pool_inputs(*shape, dtype, seed=sum(shape), device="cpu")
    q, kp, vp, cl, kw, vw, wl, bid, idx = inputs
    o_ref, lse_ref = ops.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, mode, return_lse=True, backend="torch",
                                          cache_index=idx)
    for b in range(q.shape[0]):
        qb, kb, vb, clb, kwb, vwb, wlb, bidb = single_row(inputs, b)
        one_ref, one_lse = ref.branch_attention(qb, kb, vb, clb, kwb, vwb, wlb, bidb, mode, return_lse=True)
        assert torch.equal(o_ref[b : b + 1], one_ref) and torch.equal(lse_ref[b : b + 1], one_lse), f"ref row {b}"


# (B, n, Hq, Hkv, D, L): GQA with ragged windows; MHA with one window position; an empty prefix; Dream-7B heads
SDPA_SHAPES = [(4, 13, 6, 2, 24, 70), (3, 1, 4, 4, 16, 33), (3, 5, 4, 2, 16, 0), (3, 16, 28, 4, 128, 300)]


@pytest.mark.parametrize("mode", ["full", "block_causal", "causal"])
@pytest.mark.parametrize("device_len", [False, True], ids=["int_len", "device_len"])
@pytest.mark.parametrize("shape", SDPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_sdpa_attention_is_the_reference_within_rounding(shape, device_len, mode):
    """branch_attention_sdpa (the fast path's CPU attention: one SDPA over [prefix ; window] keys) equals the
    reference op within float rounding (fp32 vs the fp64 reference: the 2x rule) on every row's valid queries, for
    a host-int prefix length (the rows sliced) and a device one (the static buffer, rows past it masked: they hold
    garbage); the rows of a batch are bitwise the same rows alone (so batched requests equal solo ones)."""
    from lopa_fast.ops.branch_attention import branch_attention_sdpa, sdpa_mask

    q, kc, vc, L, kw, vw, wl, bid = make_attention_inputs(shape, torch.float32, seed=sum(shape), device="cpu")
    B, n = q.shape[:2]
    kc[L:], vc[L:] = 1e4, -1e4  # never read
    cache_len = torch.tensor(L) if device_len else L
    vis = attention_modes.window_key_mask(n, wl, bid, mode, B, "cpu")
    o = branch_attention_sdpa(q, kc, vc, cache_len, kw, vw, sdpa_mask(vis, cache_len, kc.shape[0]))
    d = lambda t: t.double()  # noqa: E731
    want = ref.branch_attention(d(q), d(kc), d(vc), L, d(kw), d(vw), wl, bid, mode)
    o_pt = attention_in_dtype(q, kc, vc, L, kw, vw, wl, bid, mode)
    for b in range(B):
        valid = slice(0, int(wl[b]))
        assert_2x_rule(f"row {b}", o[b, valid], want[b, valid], o_pt[b, valid])
        one = branch_attention_sdpa(q[b : b + 1], kc, vc, cache_len, kw[b : b + 1], vw[b : b + 1],
                                    sdpa_mask(vis[b : b + 1], cache_len, kc.shape[0]))
        assert torch.equal(o[b : b + 1], one), f"batch row {b} vs alone"


def test_pooled_rows_never_see_other_slots_or_rows_past_their_length():
    """Rewriting every other slot and the rows past a slot's length leaves that slot's rows bitwise unchanged
    (the torch backend: the reference); a row whose slot is empty sees its window only."""
    inputs = pool_inputs(4, 6, 4, 2, 16, 40, torch.float32, seed=3, device="cpu")
    q, kp, vp, cl, kw, vw, wl, bid, idx = inputs
    run = lambda kp, vp: (  # noqa: E731
        ops.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, "block_causal", cache_index=idx, backend="torch"),)
    before = run(kp, vp)
    for s in range(3):
        kp2, vp2 = kp.clone(), vp.clone()
        keep = torch.arange(40) < cl[s]
        for t in (kp2, vp2):
            t[torch.arange(3) != s] = 1e3 * torch.randn_like(t[torch.arange(3) != s])  # other requests' slots
            t[s, ~keep] = 7.0  # this slot's rows past its length
        rows = idx == s
        for got, want in zip(run(kp2, vp2), before):
            assert torch.equal(got[rows], want[rows]), f"slot {s}"
    empty_rows = idx == 1  # slot 1 holds no prefix: the window alone
    want = ref.branch_attention(q[empty_rows], kp[1], vp[1], 0, kw[empty_rows], vw[empty_rows], wl[empty_rows],
                                bid[empty_rows], "block_causal")
    torch.testing.assert_close(before[0][empty_rows], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["full", "block_causal"])
def test_pooled_triton_is_bitwise_the_single_call_per_row(mode):
    """Triton (interpreter on CPU, compiled on a GPU): per-tile slot base pointer and length; row b (o and lse)
    bitwise the single call with k_cache[slot] and a 0-d cache_len, for a full, an empty and a partial slot,
    with a prefix cut into several splits (Lmax 70 > 2 key tiles); mode "full" passes int32 slots and lengths."""
    inputs = pool_inputs(3, 5, 4, 2, 16, 70, torch.float32, seed=5)
    q, kp, vp, cl, kw, vw, wl, bid, idx = inputs
    if mode == "full":
        cl, idx = cl.int(), idx.int()
        inputs = (q, kp, vp, cl, kw, vw, wl, bid, idx)
    with poisoned_empty():
        o, lse = ops.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, mode, return_lse=True, backend="triton",
                                      cache_index=idx)
        for b in range(q.shape[0]):
            ob, lseb = ops.branch_attention(*single_row(inputs, b), mode, return_lse=True, backend="triton")
            assert torch.equal(o[b : b + 1], ob) and torch.equal(lse[b : b + 1], lseb), f"row {b}"
    o_ref, lse_ref = ref.branch_attention(q.double(), kp.double(), vp.double(), cl, kw.double(), vw.double(), wl,
                                          bid, mode, return_lse=True, cache_index=idx)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)


def test_pooled_triton_splits_do_not_depend_on_the_batch(monkeypatch):
    """The pooled launcher picks the prefix splits of a B = 1 call whatever B (a row's summation order is its
    own): the default split count equals the one chosen for one branch, and a forced count still matches."""
    from lopa_fast.kernels.triton import branch_attention as tri

    seen = []
    real = tri.default_num_splits
    inputs = pool_inputs(3, 4, 4, 2, 16, 100, torch.float32, seed=6, S=2)
    q, kp, vp, cl, kw, vw, wl, bid, idx = inputs
    monkeypatch.setattr(tri, "default_num_splits", lambda *a, **k: seen.append(a) or real(*a, **k))
    o = tri.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, "causal", cache_index=idx)
    tri.branch_attention(*single_row(inputs, 0), "causal")
    monkeypatch.undo()
    assert len(seen) == 2 and seen[0] == seen[1]  # (row tiles x Hkv, Lmax, BLOCK_N) of one branch
    o3 = tri.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, "causal", num_splits=3, cache_index=idx)
    want = ref.branch_attention(q.double(), kp.double(), vp.double(), cl, kw.double(), vw.double(), wl, bid, "causal",
                                cache_index=idx)
    for got in (o, o3):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _pool_call(**over):
    inputs = pool_inputs(3, 4, 4, 2, 16, 10, torch.float32, device="cpu")
    a = dict(zip(["q", "k_cache", "v_cache", "cache_len", "k_win", "v_win", "win_lens", "block_ids", "cache_index"],
                 inputs), mode="block_causal")
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, err, words",
    [
        (lambda a: dict(cache_index=a["cache_index"][:2]), ValueError, "cache_index must be a \\[B=3\\]"),
        (lambda a: dict(cache_index=a["cache_index"].float()), ValueError, "cache_index must be an int"),
        (lambda a: dict(cache_index=torch.tensor([0, 3, 1])), ValueError, "cache_index values must be in \\[0, S=3\\)"),
        (lambda a: dict(cache_index=torch.tensor([0, -1, 1])), ValueError, "cache_index values"),
        (lambda a: dict(cache_len=5), ValueError, "cache_len must be an \\[S=3\\] int tensor"),
        (lambda a: dict(cache_len=torch.tensor(5)), ValueError, "cache_len must be an \\[S=3\\]"),
        (lambda a: dict(cache_len=torch.tensor([11, 0, 5])), ValueError, "cache_len of the indexed slots"),
        (lambda a: dict(k_cache=a["k_cache"][0], v_cache=a["v_cache"][0]), ValueError, "must be a pool"),
        (lambda a: dict(cache_index=None), ValueError, "a pool \\[S, Lmax, Hkv, D\\] needs cache_index"),
        (lambda a: dict(v_cache=a["v_cache"][:2]), ValueError, "k_cache/v_cache"),
    ],
)
def test_pooled_bad_input(over, err, words):
    a = _pool_call()
    a.update(over(a))
    with pytest.raises(err, match=words):
        ops.branch_attention(**a)


def test_pooled_check_false_reads_nothing_on_the_host():
    """check=False pooled call (the captured round's): no host read of cache_len or cache_index."""
    from lopa_fast.decode import count_host_syncs

    a = _pool_call(check=False, backend="torch")
    with count_host_syncs() as c:
        ops.branch_attention(**a)
    assert c.total == 0


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_cuda_emu_pooled_is_bitwise_the_single_call_per_row(cuda_emu, dt):
    """The CUDA kernels' pooled form in the host emulation: per-branch prefix CTAs on the row's slot, the splits of
    a B = 1 call (Lmax 150: 2 splits on the emulated 4 SMs, the last one partial); row b (o and lse) bitwise the
    single call with k_cache[slot] and a 0-d cache_len, for a full, an empty and a partial slot."""
    inputs = pool_inputs(3, 4, 2, 1, 64, 150, DT[dt], seed=13, device="cpu")
    q, kp, vp, cl, kw, vw, wl, bid, idx = inputs
    assert launch.attention_splits(1, 4, 2, 1, 150, EMU_SMS, launch.attention_rows(DT[dt]))[0] == 2
    with poisoned_empty():
        o, lse = cuda_emu.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, "block_causal", None, True,
                                           cache_index=idx)
        for b in range(q.shape[0]):
            ob, lseb = cuda_emu.branch_attention(*single_row(inputs, b), "block_causal", None, True)
            assert torch.equal(o[b : b + 1], ob) and torch.equal(lse[b : b + 1], lseb), f"row {b}"
    d = lambda t: t.double()  # noqa: E731
    o_ref, lse_ref = ref.branch_attention(d(q), d(kp), d(vp), cl, d(kw), d(vw), wl, bid, "block_causal",
                                          return_lse=True, cache_index=idx)
    torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=1e-5)
    if dt == "f32":
        torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    else:
        for b in range(q.shape[0]):
            qb, kb, vb, clb, kwb, vwb, wlb, bidb = single_row(inputs, b)
            L = int(clb)
            assert_2x_rule(f"o row {b}", o[b : b + 1], o_ref[b : b + 1],
                           attention_in_dtype(qb, kb, vb, L, kwb, vwb, wlb, bidb, "block_causal", softmax_fp32=True))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_pooled_bitwise_the_single_call_per_row_gpu(backend):
    """Dream-7B heads in bf16 on the device: 6 rows of 3 requests over a [4, 1024, 4, 128] pool, each row bitwise
    the single call on its slot (same backend), then captured in a CUDA graph and replayed with other slot lengths
    and another row-to-slot map written into the same device tensors (nothing baked in)."""
    if backend == "cuda" and not cuda.available():
        pytest.skip(f"CUDA kernels unavailable: {cuda.why_unavailable()}")
    inputs = pool_inputs(6, 32, 28, 4, 128, 1024, torch.bfloat16, seed=21, device="cuda", S=4)
    q, kp, vp, cl, kw, vw, wl, bid, idx = inputs
    cl = torch.tensor([1024, 0, 517, 33], device="cuda")
    inputs = (q, kp, vp, cl, kw, vw, wl, bid, idx)

    def call():
        return ops.branch_attention(q, kp, vp, cl, kw, vw, wl, bid, "block_causal", backend=backend, check=False,
                                    cache_index=idx)

    def check(out):
        for b in range(q.shape[0]):
            one = ops.branch_attention(*single_row(inputs, b), "block_causal", backend=backend, check=False)
            assert torch.equal(out[b : b + 1], one), f"{backend} row {b}"
            qb, kb, vb, clb, kwb, vwb, wlb, bidb = single_row(inputs, b)
            L, d = int(clb), (lambda t: t.double())
            o_ref = ref.branch_attention(d(qb), d(kb), d(vb), L, d(kwb), d(vwb), wlb, bidb, "block_causal")
            o_pt = attention_in_dtype(qb, kb, vb, L, kwb, vwb, wlb, bidb, "block_causal")
            assert_2x_rule(f"{backend} row {b}", out[b : b + 1], o_ref, o_pt)

    check(call())
    replay, out = CompiledRounds.capture(call, call)  # the engine's capture: warm-up on a side stream, then the graph
    for lens, slots in [([1024, 0, 517, 33], [2, 0, 2, 1, 0, 3]), ([5, 1000, 0, 64], [3, 3, 1, 1, 0, 2])]:
        cl.copy_(torch.tensor(lens))
        idx.copy_(torch.tensor(slots))
        replay()
        torch.cuda.synchronize()
        check(out.clone())
