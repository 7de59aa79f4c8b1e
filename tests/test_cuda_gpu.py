"""CUDA kernels on a GPU (`gpu` marker; skipped without one): parity against the reference ops for
fp32/fp16/bf16 and every mask mode, select_round, Dream-7B head shapes, torch.compile and CUDA-graph capture."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.ops import _cuda
from lopa_fast.reference import ops as ref
from tests.test_cuda_emu import attention_in_dtype, make_inputs, random_round
from tests.utils import assert_2x_rule, poisoned_empty

pytestmark = pytest.mark.gpu

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _need_cuda_path():
    if not _cuda.available():
        pytest.fail(f"a GPU is present but the CUDA kernels are unavailable: {_cuda.why_unavailable()}")


def to_cuda(inputs):
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs)


# (B, n, Hq, Hkv, D, cache_len): Dream-7B heads (28/4, D=128) with LoPA-sized windows; a prefix that
# needs several splits and ends mid-tile; D=64 MHA; no prefix; one branch of one position.
SHAPES = [(3, 32, 28, 4, 128, 1000), (9, 33, 28, 4, 128, 517), (2, 17, 8, 8, 64, 70), (4, 9, 6, 2, 64, 0),
          (1, 1, 28, 4, 128, 1)]


@pytest.mark.parametrize("mode", ["full", "block_causal", "causal"])
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_branch_attention_cuda_matches_reference(shape, dt, mode):
    q, kc, vc, L, kw, vw, wl, bid = to_cuda(make_inputs(*shape, DTYPES[dt]))
    with poisoned_empty():
        o, lse = ops.branch_attention(q, kc, vc, L, kw, vw, wl, bid, mode, return_lse=True, backend="cuda")
    d = lambda t: t.double()  # noqa: E731
    o_ref, lse_ref = ref.branch_attention(d(q), d(kc), d(vc), L, d(kw), d(vw), wl, bid, mode, return_lse=True)
    if dt == "f32":
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-5)
    else:
        assert_2x_rule("o", o, o_ref, attention_in_dtype(q, kc, vc, L, kw, vw, wl, bid, mode))
    torch.testing.assert_close(lse.double(), lse_ref, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("N,V", [(96, 152064), (7, 1003), (33, 126464)])
def test_confidence_cuda_matches_reference(N, V, dt):
    g = torch.Generator().manual_seed(N)
    x = (torch.randn(N, V, generator=g) * 4).to(DTYPES[dt]).cuda()
    x[0, 5] = x[0, 9] = 30.0  # exact tie: lowest index, margin 0
    for suppress in (None, 9):
        with poisoned_empty():
            got = ops.confidence(x, suppress, backend="cuda")
        want = ref.confidence(x, suppress)
        assert torch.equal(got.token, want.token)
        for name in ("p_max", "margin", "neg_entropy", "lse"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("B,n,nb", [(3, 32, 1), (9, 64, 2), (16, 128, 4), (1, 1000, 3)])
@pytest.mark.parametrize("cmp,tau,n_look,topp,alpha", [("gt", 0.9, 2, 0.5, 0.3), ("le", 0.05, 15, 1.0, 0.0)])
def test_select_round_cuda_matches_reference(B, n, nb, cmp, tau, n_look, topp, alpha):
    args = [t.cuda() for t in random_round(B, n, nb, seed=B)]
    value, conf, masked, bid, complete, cc, active = args
    call = (value, conf, masked, bid, complete, tau, cmp, n_look, topp, alpha, cc, active)
    with poisoned_empty():
        got = ops.select_round(*call, backend="cuda")
    want = ref.select_round(*call)
    assert torch.equal(got.accept, want.accept) and torch.equal(got.lookahead, want.lookahead)
    torch.testing.assert_close(got.score, want.score, atol=1e-6, rtol=1e-6)
    assert got.winner.item() == want.winner.item()


def test_model_forward_window_on_the_cuda_kernels(monkeypatch):
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


def test_compile_and_cuda_graph_capture():
    """The custom ops run inside torch.compile(fullgraph=True) and inside a captured CUDA graph."""
    q, kc, vc, L, kw, vw, wl, bid = to_cuda(make_inputs(3, 32, 28, 4, 128, 300, torch.bfloat16))
    logits = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)

    def step(q, logits):
        o = _cuda.branch_attention(q, kc, vc, L, kw, vw, wl, bid, "block_causal")
        return o, _cuda.confidence(logits, None, 1e-10)[0]

    want_o, want_t = step(q, logits)
    got_o, got_t = torch.compile(step, fullgraph=True)(q, logits)
    assert torch.equal(got_o, want_o) and torch.equal(got_t, want_t)

    static_q, static_l = q.clone(), logits.clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up off the default stream, as torch's graph docs ask
        step(static_q, static_l)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_o, out_t = step(static_q, static_l)
    static_q.copy_(q * 0.5)
    static_l.copy_(-logits)
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_t = step(q * 0.5, -logits)
    assert torch.equal(out_o, ref_o) and torch.equal(out_t, ref_t)
