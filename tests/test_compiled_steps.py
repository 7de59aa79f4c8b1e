"""compile=True for the fast vanilla and threshold decoders (their step functions,
lopa_fast.decode.{vanilla,threshold}_step, at bucket sizes through the compiled batch step, a solo request being
bucket 1): token- and forward-exact with compile=False and the reference (fp32, CPU), one host read per step, and a second request of the same shapes
compiles nothing.

Three parts: (1) the CUDA-graph path (static workspace per StepGeometry, state loaded into it, caches written in
place, graph-owned logits) with the capture emulated on CPU, over a grid of every step kind (threshold: every
rule x cache None / prefix / dual, both families; vanilla: LLaDA cfg_scale / random remasking / EOS knobs, Dream
algs / alg_temp; T = 0 and the keyed sampler at T > 0): cheap, no compiler; (2) real Inductor compiles
(torch.compile fullgraph) on the tiny LLaDA model, one graph each: threshold in CI, vanilla under `-m slow` (CI's
real vanilla compile is the batched one of tests/test_compiled_batch.py);
(3) `-m slow`: the compile grid over every step kind on both families.
"""
from __future__ import annotations

import warnings

import pytest

import lopa_fast
from lopa_fast.decode.compiled import CompiledRounds
from lopa_fast.strategies.steps import StepGeometry
from tests.utils import emulated_capture, run_step, step_models

PROMPTS = ([3, 4, 5, 6], [9, 4, 5, 1], [7, 2, 8, 30])  # one length: a geometry's later requests replay


@pytest.fixture(scope="module")
def models() -> dict:
    return step_models()


def T(t=0.7, seed=5):
    return dict(temperature=t, seed=seed)


G16 = dict(max_new_tokens=16)
# (model, strategy, knobs): every step kind (full, refresh, refresh_first, prefix, dual, llada, dream), every rule
EMULATED = [
    ("llada", "threshold", dict(G16, block_length=8, threshold=0.5)),
    ("llada_mask", "threshold", dict(G16, block_length=4, factor=1.0, eos_token_id=7)),
    ("llada", "threshold", dict(G16, block_length=8, cache="prefix", entropy_threshold=0.3, **T())),
    ("llada_mask", "threshold", dict(G16, block_length=4, cache="dual", threshold=0.9, count_noop_forward=True)),
    ("dream", "threshold", dict(G16, block_length=4, factor=2.5, **T(1.0))),
    ("dream_mask", "threshold", dict(G16, block_length=8, cache="prefix", threshold=0.9, eos_token_id=7)),
    ("dream", "threshold", dict(G16, block_length=4, cache="dual", entropy_threshold=1.5, **T(0.7, 9))),
    ("dream_mask", "threshold", dict(G16, block_length=8, cache="dual", factor=1.0, top_p=0.9, top_k=20, **T())),
    ("llada", "vanilla", dict(G16, block_length=8, steps=8, cfg_scale=1.5)),
    ("llada_mask", "vanilla", dict(G16, block_length=4, steps=12, remasking="random", eos_token_id=7,
                                   confidence_eos_eot_inf=True, logits_eos_inf=True)),
    ("llada", "vanilla", dict(G16, block_length=16, steps=6, cfg_scale=1.5, **T(0.5))),
    ("dream", "vanilla", dict(G16, steps=8, alg="entropy")),
    ("dream_mask", "vanilla", dict(G16, steps=16, alg="maskgit_plus", alg_temp=0.5, eos_token_id=7)),
    ("dream", "vanilla", dict(G16, steps=8, alg="origin", **T(0.5))),
    ("dream", "vanilla", dict(G16, steps=4, alg="topk_margin", top_p=0.9, top_k=20, **T(1.0))),
]


def run(model, strategy, kw, prompt, **extra):
    kw = {"seed": 11, **kw}  # the keyed draws (T > 0, random remasking, origin, alg_temp) of one seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masks-left warnings of the mask-predicting models (every backend)
        return lopa_fast.generate(model, prompt, strategy, **kw, **extra)


def check(ref, eager, comp, case) -> None:
    assert comp.stats["backend"] == "fast"
    assert comp.generated_ids == eager.generated_ids == ref.generated_ids, case
    assert comp.stats["forwards"] == eager.stats["forwards"] == ref.stats["forwards"], case
    keys = ("transferred",) if case[1] == "vanilla" else ("multi_token_steps", "noop_forwards", "refresh_forwards")
    for k in keys:
        assert comp.stats[k] == eager.stats[k] == ref.stats[k], (k, case)
    assert comp.stats["host_reads"] == comp.stats["forwards"]  # one host read per step
    assert comp.stats["compiled_buckets"], comp.stats  # every step ran through CompiledRounds


@pytest.fixture
def emulated_graphs(monkeypatch):
    """CompiledRounds' CUDA-graph path on CPU for the models of a test: the "graph" reruns the captured body on
    the workspace and rewrites the outputs captured the first time (a real capture records without running, so
    those come from the warm-up on scratch copies), as tests/test_compiled_round.py does for D2F / LoPA."""

    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    touched = []

    def on(model):
        cr = CompiledRounds.for_model(model)
        cr.emulate_graphs = True
        touched.append(cr)
        return cr

    yield on
    for cr in touched:  # the per-model callables are shared with later tests: drop the emulated ones
        cr.emulate_graphs = False
        for key in [k for k in cr.fns if k[0] == "batch" and k[2][0] == "steps"]:
            del cr.fns[key]
        for key in [k for k in cr.workspaces if is_steps_workspace(k)]:
            del cr.workspaces[key]


def is_steps_workspace(key) -> bool:
    """A compiled batch's workspace of vanilla / threshold steps: ("batch", ("steps", StepGeometry))."""
    return key[0] == "batch" and isinstance(key[1][-1], StepGeometry)


@pytest.mark.parametrize("case", EMULATED, ids=lambda c: f"{c[0]}-{c[1]}-{c[2].get('cache')}")
def test_captured_steps_equal_eager_and_reference(models, emulated_graphs, case):
    name, strategy, kw = case
    m = models[name]
    cr = emulated_graphs(m)
    graphs = []
    for i, prompt in enumerate(PROMPTS[:2]):
        extra = dict(return_trace=True) if i == 0 else {}
        ref = run(m, strategy, dict(kw, **extra), prompt, backend="reference")
        eager = run(m, strategy, dict(kw, **extra), prompt, backend="fast")
        comp = run(m, strategy, dict(kw, **extra), prompt, backend="fast", compile=True)
        check(ref, eager, comp, case)
        if i == 0:
            assert comp.trace == eager.trace == ref.trace, case
        graphs.append(comp.stats["compiled_graphs"])
    assert graphs[0] >= 1
    # the second request captures only buckets the first never used (its own mask counts / row spans)
    second = comp.stats
    assert second["compiled_graphs"] <= len(second["compiled_buckets"])
    assert len([k for k in cr.workspaces if is_steps_workspace(k)]) == 1  # one workspace per geometry


def test_captured_error_and_stop(models, emulated_graphs):
    """A stop sequence ends the compiled loop where it ends the eager one; the round cap too."""
    m = models["dream"]
    emulated_graphs(m)
    for strategy, kw in (("threshold", dict(G16, block_length=4, threshold=0.9, cache="dual")),
                         ("vanilla", dict(G16, steps=16, alg="maskgit_plus"))):
        base = run(m, strategy, kw, [3, 4, 5], backend="reference").generated_ids
        kw = dict(kw, stop=[base[5:7]])
        ref = run(m, strategy, kw, [3, 4, 5], backend="reference")
        comp = run(m, strategy, kw, [3, 4, 5], backend="fast", compile=True)
        assert comp.generated_ids == ref.generated_ids and comp.stats["forwards"] == ref.stats["forwards"]
        assert comp.stats["finish_reason"] == "stop"
    kw = dict(G16, block_length=4, threshold=0.99, max_rounds=3)
    ref = run(models["llada"], "threshold", kw, [3, 4, 5], backend="reference")
    emulated_graphs(models["llada"])
    comp = run(models["llada"], "threshold", kw, [3, 4, 5], backend="fast", compile=True)
    assert comp.stats["forwards"] == ref.stats["forwards"] == 3 and comp.stats["hit_round_cap"]
    assert comp.generated_ids == ref.generated_ids


# ---- (2) Inductor: torch.compile(fullgraph=True) per bucket, CI ----------------------------------------------
# 16 new tokens on the tiny LLaDA model: every step's rows fit the smallest bucket (16), so each config compiles
# ONE graph (vanilla: block_length 16, 8 steps, k = 2 every step; keyed at T > 0); the later prompts replay it.
# About 25 s of Inductor each on a loaded 2-core machine (cfg_scale's batch of 2 took ~70 s: the slow grid).
# The default run keeps threshold's solo compile (the only real-Inductor threshold step in CI); vanilla's solo
# compile is `-m slow`: CI's real-Inductor vanilla step is tests/test_compiled_batch.py test_inductor_batched_step
# (the same step function, LLaDA model and block / steps, T > 0 keyed, at batch bucket 2), and the solo batch bucket 1 is
# compiled for real by threshold here and by d2f / lopa / apd (tests/test_compiled_round.py, test_fast_apd.py).
COMPILED_CI = [
    pytest.param(("llada", "threshold", dict(G16, block_length=8, threshold=0.5)), id="threshold"),
    pytest.param(("llada", "vanilla", dict(G16, block_length=16, steps=8, **T(0.5))), id="vanilla",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", COMPILED_CI)
def test_compiled_steps_are_exact_and_compile_once(models, case):
    """Each case compiles in its own test (no shared fixture), so a deselected case compiles nothing."""
    name, strategy, kw = case
    m = models[name]
    runs = [(run(m, strategy, kw, p, backend="reference"), run(m, strategy, kw, p, backend="fast"),
             run(m, strategy, kw, p, backend="fast", compile=True)) for p in PROMPTS[:2]]
    for ref, eager, comp in runs:
        check(ref, eager, comp, case)
    first, second = runs[0][2].stats, runs[1][2].stats
    assert first["forwards"] >= 2 and len(first["compiled_buckets"]) == 1, first
    assert first["compiled_graphs"] == 1 and len(first["compile_seconds"]) == 1  # one graph, no graph break
    assert second["compiled_graphs"] == 0 and second["compile_seconds"] == {}  # replays only


# ---- (3) the compile grid (every step kind, both families), -m slow -------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", EMULATED, ids=lambda c: f"{c[0]}-{c[1]}-{c[2].get('cache')}")
def test_compile_grid(models, case):
    name, strategy, kw = case
    m = models[name]
    for prompt in PROMPTS[:2]:
        ref = run(m, strategy, kw, prompt, backend="reference")
        eager = run(m, strategy, kw, prompt, backend="fast")
        comp = run(m, strategy, kw, prompt, backend="fast", compile=True)
        check(ref, eager, comp, case)
    assert comp.stats["compiled_graphs"] <= len(comp.stats["compiled_buckets"])  # no recompile inside a bucket


def test_every_index_in_range_on_a_finished_state(models):
    """A CUDA capture's warm-up runs a step on the workspace's LAST state, possibly a finished request's (no mask
    left, the last block, Dream's step index = steps): every kind must still index in range (on the device an
    out-of-range index is an assert, here an IndexError)."""
    import torch

    from lopa_fast.strategies import steps
    from lopa_fast.strategies.threshold import step as threshold_step
    from lopa_fast.strategies.vanilla import step as vanilla_step

    for name, strategy, kw in EMULATED:
        m = models[name]
        P = 4
        cfg = lopa_fast.GenerateConfig(strategy=strategy, **{"seed": 11, **kw}).bind(m)
        L = P + cfg.max_new_tokens
        geo = steps.geometry(m, cfg, L)
        x = torch.arange(L) % 50  # no mask left
        ts = torch.linspace(1, cfg.eps, cfg.steps + 1) if geo.alg is not None else None
        st, T = steps.init(m, x, P, geo, 11, ts, steps.step_knobs(cfg))
        st["fm"].fill_(L)
        st["i"].fill_(geo.n_steps)
        st["s"].fill_(L - geo.B)
        st["e"].fill_(L)
        if strategy == "vanilla":
            kinds = [("block_topk", (16, 1))] if m.config.vanilla_commit == "block_topk" else [("timestep", (16, 1))]
        else:
            kinds = [("full", (16,)), ("refresh", (16,)), ("refresh_first", (1,)), ("prefix", (16,)), ("dual", ())]
            kinds = [k for k in kinds if (k[0] == "full") == (geo.cache is None)]
        for kind, sizes in kinds:
            parts = vanilla_step.parts if strategy == "vanilla" else threshold_step.parts
            out, _ = run_step(parts, m, {k: v.clone() for k, v in st.items()}, T, geo, kind, sizes)
            assert out["head"][2] == L or kind in ("block_topk", "timestep"), (kind, name)  # still no mask
