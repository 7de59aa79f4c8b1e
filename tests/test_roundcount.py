"""bench/roundcount.py (issue 33's round counter and H200 projection) at tiny shapes: its counts are the ones the
formulas give (a linear's FLOPs and bytes, a gather's bytes), the fast round reads the host once and calls the model
once per round while the reference calls it once per branch, the per-layer stages scale with depth, and the
projection orders eager > captured > roofline. Real shapes run only in bench/bench_real_shapes.py (`bench` marker)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import lopa_fast
from bench import roundcount as rc
from lopa_fast.testing import random_model, tiny_hf_config

KN = dict(block_size=8, max_new_tokens=16, block_add_threshold=1.0, skip_threshold=0.9,
          sampling_strategy="neg_entropy")


def _counted(fn):
    r = rc.Rounds(num_layers=1)
    with torch.inference_mode(), rc.OpCounter(r):
        out = fn()
    return r.rec["host"], out


def test_linear_flops_and_bytes():
    M, K, N = 5, 24, 40
    x, w, b = torch.randn(M, K), torch.randn(N, K), torch.randn(N)
    st, _ = _counted(lambda: F.linear(x, w))
    assert st["flops"] == 2 * M * N * K
    assert st["bytes_f32"] == 4 * (M * K + N * K + M * N) and st["bytes_other"] == 0
    assert st["launches"] == 1 and st["syncs"] == 0
    with FlopCounterMode(display=False) as fc:  # torch's own counter agrees (bias add included in addmm's count)
        F.linear(x, w, b)
    st_b, _ = _counted(lambda: F.linear(x, w, b))
    assert st_b["flops"] == fc.get_total_flops() == 2 * M * N * K


def test_views_and_allocations_are_not_launches():
    """A 3-d linear is mm + matmul's _unsafe_view back to 3-d (no kernel, no bytes); torch.empty allocates (the
    transient peak) but launches nothing; each counted once or not at all."""
    B, n, K, N = 2, 3, 8, 5
    x, w = torch.randn(B, n, K), torch.randn(N, K)
    st, _ = _counted(lambda: F.linear(x, w))
    assert st["launches"] == 1 and st["bytes_f32"] == 4 * (B * n * K + N * K + B * n * N)
    st, _ = _counted(lambda: torch.empty(1000, 10))
    assert st["launches"] == 0 and st["bytes_f32"] == 0 and st["peak"] >= 4 * 10_000


def test_gather_counts_rows_not_table_and_syncs():
    table = torch.randn(1000, 16)
    idx = torch.tensor([3, 7, 7, 9, 0])
    st, _ = _counted(lambda: F.embedding(idx, table))
    assert st["bytes_f32"] == 2 * 5 * 16 * 4 and st["bytes_other"] == 5 * 8
    t = torch.tensor([1.5, 2.0])
    st, v = _counted(lambda: (t.sum().item(), bool(t[0] > 1), torch.nonzero(t > 1.8)))
    assert v[0] == 3.5 and st["syncs"] == 3


@pytest.mark.parametrize("entropy,keep", [(True, False), (True, True), (False, True), (False, False)])
def test_fused_head_counts_its_kernels_gemm_and_logits_buffer(entropy, keep):
    """The fused head (ONE custom op, its body the torch reference as in kernel_bodies_in_torch) counts the
    launcher's kernels (stats + merge, + entropy pass + split sum), the head GEMM's FLOPs and the [R, V] buffer's
    traffic: written once (an output when kept), read back by the entropy pass; the weight read once."""
    R, H, V = 6, 16, 300
    h, w = torch.randn(R, H), torch.randn(V, H)
    with rc.kernel_bodies_in_torch():
        st, out = _counted(lambda: torch.ops.lopa_fast.triton_head_confidence(h, w, 5, 1e-10, entropy, keep))
    assert out[6].shape == ((R, V) if keep else (0, V))
    assert st["launches"] == (4 if entropy else 2) and st["flops"] == 2 * R * V * H
    buf = 4 * R * V  # the [R, V] logits buffer (fp32 here)
    # inputs hidden + weight, 4 fp32 stats out, the buffer: kept (an output) and / or read back by the entropy pass
    f32 = 4 * (R * H + V * H) + 4 * R * 4 + (buf if keep else 0) + (2 * buf if entropy and not keep else 0) \
        + (buf if entropy and keep else 0)
    assert st["bytes_f32"] == f32 and st["bytes_other"] == 8 * R + R  # token int64, finite bool


def _model(layers=1):
    return random_model(tiny_hf_config("dream", vocab_size=64, num_layers=layers, hidden_size=32,
                                       intermediate_size=48), seed=2)


def _run(model, backend, k, rounds=3):
    prompt = torch.arange(3, 19)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            kw = dict(KN, max_rounds=1 + rounds)
            if k > 1:
                kw["branching_factor"] = k
            return lopa_fast.generate(model, prompt, "lopa" if k > 1 else "d2f", backend, **kw)

    return rc.count_rounds(model, run)


@pytest.mark.parametrize("k", [1, 4])
def test_fast_round_one_host_read_one_model_call(k):
    model = _model()
    rs = rc.steady(_run(model, "fast", k))
    assert len(rs) == 3
    for r in rs:
        assert r["meta"]["calls"] == 1  # one batched forward: one weight pass per round
        assert sum(r[s]["syncs"] for s in rc.STAGES) == 1 == r["host"]["syncs"]  # the head read
        assert r["lm_head"]["flops"] > 0 and r["mlp"]["flops"] > 0 and r["attn_core"]["flops"] > 0
        H, V = 32, 64
        rows = r["lm_head"]["flops"] / (2 * H * V)  # the LM head runs on whole rows only
        assert rows == int(rows) and 1 <= rows <= (k + 1 if k > 1 else 1) * 8
    # the MLP: 3 GEMMs of 2 * rows * H * I per layer over the branch windows (tau_add = 1: 8 columns per slot)
    summ = rc.summarize(_run(model, "fast", k))
    slots = k + 1 if k > 1 else 1
    assert summ["mlp"]["flops"] == 2 * (slots * 8) * 3 * 32 * 48


@pytest.mark.parametrize("k", [1, 2])
def test_gpu_sequence_counts_the_fused_head_as_one_op(k):
    """bench_real_shapes' fastgpu path (`gpu_sequence`: the Triton kernels as one custom op each, the fused head):
    one model call and one host read per round; the head's GEMM is the fused op's (in lm_head, no [R, V] fp32
    statistics passes), the stats stage only the stale last_logit row's `confidence` (Dream's shift: 1 row). The
    layer is 4 kernels and attention (`ops.norm_linear` twice, the o and down GEMMs), its stages told apart by the
    norm_linear calls; `_branch_attention_cost` plans the attention as the launcher does."""
    L = 2
    model = _model(L)
    with rc.gpu_sequence():
        rs = rc.steady(_run(model, "fast", k))
    assert len(rs) == 3
    H, V = 32, 64
    for r in rs:
        # attention: one kernel a layer (the short prefix fits one split: the window kernel reads it)
        assert r["attn_proj"]["launches"] == 2 * L and r["attn_core"]["launches"] == L
        assert 2 * L <= r["mlp"]["launches"] <= 2 * L + 4  # + the last residual add, the K / V stacks, the rows
        assert r["meta"]["calls"] == 1 and sum(r[s]["syncs"] for s in rc.STAGES) == 1
        rows = r["lm_head"]["flops"] / (2 * H * V)  # the fused op's GEMM, whole rows
        assert rows == int(rows) and 1 <= rows <= (k + 1 if k > 1 else 1) * 8
        assert r["stats"]["flops"] == 0 and r["stats"]["launches"] <= 3  # one triton_confidence, no softmax ops


def test_reference_calls_the_model_once_per_branch():
    model = _model()
    summ = rc.summarize(_run(model, "reference", 4))
    assert summ["calls"] == 5  # anchor + 4 lookaheads, each its own forward (k + 1 weight passes)
    assert sum(summ[s]["syncs"] for s in rc.STAGES) > 1


def test_layer_stages_scale_with_depth_and_projection_orders():
    one = rc.summarize(_run(_model(1), "fast", 1))
    two = rc.summarize(_run(_model(2), "fast", 1))
    for s in ("attn_proj", "mlp"):
        assert two[s]["flops"] == 2 * one[s]["flops"]  # same windows: the per-layer work is the same at any depth
    scaled = rc.scale_depth(one, 1, 2)
    assert scaled["mlp"]["flops"] == two["mlp"]["flops"] and scaled["lm_head"]["flops"] == one["lm_head"]["flops"]
    p = rc.project(scaled)
    assert p["eager_ms"][0] > p["captured_ms"][1] > p["roofline_ms"] > 0
    assert p["captured_real_ms"][0] > p["captured_ms"][0]


def test_floor_matches_the_published_arithmetic():
    from bench.shapes import REAL_SHAPES, kv_bytes_per_token, streamed_params

    d = REAL_SHAPES["dream7b"]
    assert abs(streamed_params(d) * 2 / 1e9 - 14.14) < 0.01 and kv_bytes_per_token(d) == 57344
    assert abs(rc.floor_ms(32, 1024) - 3.30) < 0.01  # docs/performance.md: ~3.3 ms
    assert abs(rc.floor_ms(256, 1024) - 4.58) < 0.05  # compute-bound from ~184 rows on (measured constants)


def test_scale_depth_two_point_fit_counts_once_per_forward_ops_once():
    """A layer stage holding ops that run once per forward (the last layer's residual add, the K/V stacking) is
    projected exactly by the two-point fit: per layer = deeper - measured, the rest once; the 1-layer scaling
    multiplies those ops by the depth."""
    from bench import roundcount as rc

    def summary(layers: int) -> dict:  # 6 launches a layer in mlp plus 4 once per forward; 21 in select
        s = {st: {f: 0.0 for f in rc.FIELDS} for st in rc.STAGES}
        s["mlp"]["launches"] = 6.0 * layers + 4.0
        s["select"]["launches"] = 21.0
        return s

    fit = rc.scale_depth(summary(1), 1, 28, deeper=summary(2))
    assert fit["mlp"]["launches"] == 6 * 28 + 4 and fit["select"]["launches"] == 21
    assert rc.scale_depth(summary(1), 1, 28)["mlp"]["launches"] == 10 * 28  # the old scaling's over-count


def test_branch_attention_cost_follows_the_launch_plan():
    """The counter's attention launches are the Triton launcher's plan at the GPU's bf16 tiles: one kernel while the
    prefix fits one split (<= 4 key tiles, or enough row tiles), two past it; a device length plans for Lmax."""
    q = torch.zeros(1, 32, 14, 64)
    kw = torch.zeros(1, 32, 2, 64)
    cache = torch.zeros(2048, 2, 64)
    cost = lambda cl_t, cl: rc._branch_attention_cost((q, cache, cache, cl_t, cl, kw, kw), None)[0]  # noqa: E731
    assert cost(None, 0) == 1 and cost(None, 256) == 1 and cost(None, 257) == 2 and cost(None, 2048) == 2
    assert cost(torch.tensor(5), 0) == 2  # planned for Lmax = 2048
    assert rc._branch_attention_cost((q[:, :0], cache, cache, None, 64, kw[:, :0], kw[:, :0]), None)[0] == 0
