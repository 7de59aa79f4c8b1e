"""compile=True: the round compiled once per bucket (torch.compile fullgraph on CPU) is token- and
forward-exact with the eager fast path and the reference, and a second request of the same shapes compiles
nothing (no recompile inside a bucket). CI compiles at most 2 graphs, in one session-scoped fixture; the
compile grid runs under `-m slow`."""
from __future__ import annotations

import pytest
import torch

import lopa_fast
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import emulated_capture

# one geometry per config (same prompt length, block size, k, mode, thresholds): every bucket after the
# first request is a replay. max_new_tokens = block_size: the decode rounds all use the Nb = 8 bucket.
CONFIGS = {
    "lopa_full_k2": dict(strategy="lopa", branching_factor=2, use_full_attention=True, sampling_strategy="neg_entropy"),
    "d2f_block_causal": dict(strategy="d2f", use_full_attention=False, sampling_strategy="default"),
}
COMMON = dict(block_size=8, max_new_tokens=8, skip_threshold=0.8, block_add_threshold=0.1, decoded_token_threshold=0.9)
PROMPT_LEN = 9


@pytest.fixture(scope="session")
def compiled_runs():
    """For each config: (reference, eager fast, compiled) outputs on 3 prompts of one length. CI's only real-Inductor
    d2f and lopa rounds (solo: batch bucket 1), one graph each: both stay in the default run."""
    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 60, (PROMPT_LEN,), generator=g) for _ in range(3)]
    runs = {"model": model, "prompts": prompts}
    for name, kw in CONFIGS.items():
        kw = {**COMMON, **kw}
        strategy = kw.pop("strategy")
        runs[name] = [
            (
                lopa_fast.generate(model, p, strategy, "reference", **kw),
                lopa_fast.generate(model, p, strategy, "fast", **kw),
                lopa_fast.generate(model, p, strategy, "fast", compile=True, **kw),
            )
            for p in prompts
        ]
    return runs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_is_token_and_forward_exact(compiled_runs, name):
    for ref, eager, comp in compiled_runs[name]:
        assert comp.generated_ids == eager.generated_ids == ref.generated_ids
        assert comp.stats["forwards"] == eager.stats["forwards"] == ref.stats["forwards"]
        assert comp.stats["backend"] == "fast"
        for key in ("accepted_by_threshold", "fallback_fills", "multi_token_rounds", "eos_fills"):
            assert comp.stats[key] == eager.stats[key], key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiles_once_per_bucket(compiled_runs, name):
    runs = compiled_runs[name]
    first = runs[0][2].stats
    # the test has teeth only if decode rounds ran compiled (round 1, the prefill, is eager)
    assert first["forwards"] >= 2 and first["compiled_buckets"], first
    assert first["compiled_graphs"] == len(first["compiled_buckets"])  # one graph per bucket, no break
    for _, _, comp in runs[1:]:  # same shapes: replays only
        assert comp.stats["compiled_graphs"] == 0, comp.stats["compiled_buckets"]
        assert comp.stats["compile_seconds"] == {}  # per request: nothing compiled in this one
    assert len(first["compile_seconds"]) == first["compiled_graphs"]
    assert all(sec > 0 for sec in first["compile_seconds"].values())


def test_float_knobs_replay_the_compiled_round(compiled_runs):
    """A float knob is a runtime input of the compiled round, not a compile key (issue 28 finding 5): after the
    fixture compiled lopa_full_k2 at skip_threshold 0.8, requests at 0.95 (other tokens) compile nothing and each
    equals its eager run and the reference."""
    model = compiled_runs["model"]
    kw = {**COMMON, **CONFIGS["lopa_full_k2"], "skip_threshold": 0.95}
    strategy = kw.pop("strategy")
    for p, (_, before, _) in zip(compiled_runs["prompts"], compiled_runs["lopa_full_k2"]):
        eager = lopa_fast.generate(model, p, strategy, "fast", **kw)
        comp = lopa_fast.generate(model, p, strategy, "fast", compile=True, **kw)
        assert eager.generated_ids != before.generated_ids  # the knob changes this prompt's tokens
        assert comp.generated_ids == eager.generated_ids and comp.stats["forwards"] == eager.stats["forwards"]
        assert comp.generated_ids == lopa_fast.generate(model, p, strategy, "reference", **kw).generated_ids
        assert comp.stats["compiled_buckets"] and comp.stats["compiled_graphs"] == 0, comp.stats


def test_compile_needs_a_fast_backend():
    with pytest.raises(ValueError, match="compile=True applies to backend='fast'"):
        lopa_fast.GenerateConfig(backend="reference", compile=True).validate()
    with pytest.raises(TypeError, match="compile"):
        lopa_fast.GenerateConfig(compile="yes").validate()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("bs", [4, 8])
def test_compile_grid(k, full, bs):
    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    g = torch.Generator().manual_seed(k * 10 + bs)
    kw = dict(branching_factor=k, use_full_attention=full, block_size=bs, max_new_tokens=4 * bs, skip_threshold=0.7)
    for _ in range(2):
        p = torch.randint(0, 60, (11,), generator=g)
        ref = lopa_fast.generate(model, p, "lopa", "reference", **kw)
        comp = lopa_fast.generate(model, p, "lopa", "fast", compile=True, **kw)
        assert comp.generated_ids == ref.generated_ids and comp.stats["forwards"] == ref.stats["forwards"]


def test_graph_workspace_logic_on_cpu(monkeypatch):
    """The CUDA-graph path's workspace logic (a static state per geometry, a new request's state and tables
    loaded into it, the round written back in place, graph-owned trace facts) with the capture emulated on
    CPU: the "graph" reruns the captured body and rewrites the outputs captured the first time."""
    from lopa_fast.decode.compiled import CompiledRounds

    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=1, sharpen=6)
    cr = CompiledRounds.for_model(model)
    cr.emulate_graphs = True
    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    g = torch.Generator().manual_seed(9)
    kw = {**COMMON, "branching_factor": 2, "max_new_tokens": 16, "return_trace": True}
    outs = []
    for thresholds in ((0.1, 0.9), (0.1, 0.9), (0.3, 0.6)):  # the third: same geometry, other tables
        kw.update(block_add_threshold=thresholds[0], decoded_token_threshold=thresholds[1])
        p = torch.randint(0, 60, (PROMPT_LEN,), generator=g)
        ref = lopa_fast.generate(model, p, "lopa", "reference", **kw)
        got = lopa_fast.generate(model, p, "lopa", "fast", compile=True, **kw)
        assert got.generated_ids == ref.generated_ids and got.stats["forwards"] == ref.stats["forwards"]
        assert [r["accepted"] for r in got.trace] == [r["accepted"] for r in ref.trace]
        outs.append(got.stats)
    assert outs[0]["compiled_graphs"] >= 1 and outs[0]["forwards"] >= 3
    assert outs[1]["compiled_graphs"] == 0 and outs[2]["compiled_graphs"] == 0  # replays of the same captures
    assert len(cr.workspaces) == 1


@pytest.mark.slow  # two real-Inductor graphs, ~2 min each on the 2-core CI machine
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_fused_head(name, monkeypatch):
    """LOPA_FAST_FUSED_HEAD=1 (what CUDA runs by default): the compiled round traces the fused head, its logits
    kept for Dream's next last_logit row (`keep_logits`), and decodes what the eager fused round decodes."""
    from lopa_fast import ops

    monkeypatch.setenv("LOPA_FAST_FUSED_HEAD", "1")
    seen = []
    real = ops.head_confidence
    monkeypatch.setattr(ops, "head_confidence", lambda *a, **k: seen.append(k.get("keep_logits")) or real(*a, **k))
    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    kw = {**COMMON, **CONFIGS[name]}
    strategy = kw.pop("strategy")
    g = torch.Generator().manual_seed(5)
    for p in [torch.randint(0, 60, (PROMPT_LEN,), generator=g) for _ in range(2)]:
        eager = lopa_fast.generate(model, p, strategy, "fast", **kw)
        comp = lopa_fast.generate(model, p, strategy, "fast", compile=True, **kw)
        assert comp.generated_ids == eager.generated_ids and comp.stats["forwards"] == eager.stats["forwards"]
    assert seen and all(seen)  # the fused head ran (eager and traced), keeping its logits (Dream: the shift)
