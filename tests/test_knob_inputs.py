"""Float knobs are runtime inputs of compiled / captured steps, not compile keys (issue 28 finding 5): requests that
differ only in a float knob (two temperatures > 0 with a seed, two top_p, two thresholds, two APD mixture weights,
...) reuse ONE graph, and each gives the tokens of its eager run. Under the emulated CUDA-graph capture here (every
strategy family: the D2F / LoPA round, the threshold and vanilla steps, the APD step); with Inductor in
tests/test_compiled_round.py (`test_float_knobs_replay_the_compiled_round`)."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import lopa_fast
from lopa_fast.decode.compiled import CompiledRounds
from lopa_fast.testing import model_from_spec, random_model, tiny_hf_config
from tests.utils import emulated_capture

HERE = os.path.dirname(__file__)
SAMPLE = dict(temperature=0.7, seed=3)
ROUND = dict(block_size=4, max_new_tokens=16, block_add_threshold=0.1, decoded_token_threshold=0.9,
             skip_threshold=0.8)
# (model, strategy, the shared knobs, the knob that differs, its two values, the prompt)
CASES = [
    ("dream", "lopa", dict(ROUND, branching_factor=2, **SAMPLE), "temperature", (0.5, 1.5), [5, 9, 2, 7]),
    ("dream", "lopa", dict(ROUND, branching_factor=2, temperature=1.0, seed=3), "top_p", (0.5, 0.95), [5, 9, 2, 7]),
    ("dream", "d2f", dict(ROUND, block_size=8, max_new_tokens=8), "skip_threshold", (0.9, 0.5), [5, 9, 2, 7]),
    ("dream", "lopa", dict(ROUND, branching_factor=4, skip_threshold=0.95), "selection_conf_alpha", (0.1, 0.9),
     [5, 9, 2, 7]),
    ("llada", "threshold", dict(max_new_tokens=16, block_length=8), "threshold", (0.3, 0.95), [3, 4, 5, 6]),
    ("dream", "threshold", dict(max_new_tokens=16, block_length=4, cache="prefix", factor=1.0, **SAMPLE),
     "temperature", (0.5, 1.5), [3, 4, 5, 6]),
    ("llada", "threshold", dict(max_new_tokens=16, block_length=4, cache="dual"), "factor", (0.5, 3.0), [3, 4, 5, 6]),
    ("llada", "vanilla", dict(max_new_tokens=16, block_length=8, steps=8, **SAMPLE), "cfg_scale", (0.5, 2.5),
     [3, 4, 5, 6]),
    ("dream", "vanilla", dict(max_new_tokens=16, steps=8, alg="maskgit_plus", seed=3), "alg_temp", (0.3, 2.0),
     [3, 4, 5, 6]),
]
# W = 2, M = 4: every step's window and draft fall in the smallest bucket (16 x 16), whatever is accepted
APD = dict(strategy="apd", kv_window=2, max_lookahead=4, max_new_tokens=16, eos_token_id=61)
APD_CASES = [(dict(APD), "apd_mixture_weight", (0.3, 0.9)),
             (dict(APD, apd_mixture_weight=0.7, sampler="keyed", seed=3), "temperature", (0.4, 1.3))]


@pytest.fixture(scope="module")
def models() -> dict:
    spec = json.load(open(os.path.join(HERE, "golden", "apd_upstream.json")))["models"]
    return {
        "dream": random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=3),
        "llada": random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=3),
        "apd": tuple(model_from_spec(spec[k]["hf"], spec[k]["random"]) for k in ("d64", "q64")),
    }


@pytest.fixture
def captured(monkeypatch):
    """CompiledRounds' CUDA-graph path on the CPU (the capture emulated) for a model; its graphs are dropped after."""
    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    touched = []

    def on(model) -> CompiledRounds:
        cr = CompiledRounds.for_model(model)
        cr.emulate_graphs = True
        cr.fns.clear()
        cr.workspaces.clear()
        touched.append(cr)
        return cr

    yield on
    for cr in touched:  # the per-model callables are shared with later tests: drop the emulated ones
        cr.emulate_graphs = False
        cr.fns.clear()
        cr.workspaces.clear()


def _generate(model, prompt, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masks-left warnings of a vanilla run (every backend alike)
        return lopa_fast.generate(model, prompt, backend="fast", **kw)


def _one_graph_for_both(cr, run, name, values) -> None:
    """run(value, compile) -> GenerateOutput: the two values decode differently (eager), the first request compiles
    (captures), the second adds no graph, bucket or workspace, and each compiled run equals its eager one."""
    eager = [run(v, False) for v in values]
    assert eager[0].generated_ids != eager[1].generated_ids, (name, values)  # the knob matters for this prompt
    first = run(values[0], True)
    assert first.stats["compiled_graphs"] >= 1, first.stats
    graphs, fns, workspaces = cr.graphs, len(cr.fns), len(cr.workspaces)
    second = run(values[1], True)
    assert second.stats["compiled_graphs"] == 0 and second.stats["compile_seconds"] == {}, (name, second.stats)
    assert (cr.graphs, len(cr.fns), len(cr.workspaces)) == (graphs, fns, workspaces), name
    assert set(map(tuple, second.stats["compiled_buckets"])) <= set(map(tuple, first.stats["compiled_buckets"]))
    for got, want in zip((first, second), eager):
        assert got.generated_ids == want.generated_ids and got.stats["forwards"] == want.stats["forwards"], name


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{c[3]}")
def test_float_knobs_share_one_captured_graph(models, captured, case):
    name, strategy, kw, knob, values, prompt = case
    model = models[name]
    cr = captured(model)
    _one_graph_for_both(cr, lambda v, comp: _generate(model, prompt, strategy=strategy, compile=comp,
                                                      **{**kw, knob: v}), knob, values)


@pytest.mark.parametrize("case", APD_CASES, ids=lambda c: c[1])
def test_apd_float_knobs_share_one_captured_graph(models, captured, case):
    kw, knob, values = case
    drafter, verifier = models["apd"]
    cr = captured(drafter)
    _one_graph_for_both(cr, lambda v, comp: _generate(drafter, [5, 9, 2], verifier=verifier, compile=comp,
                                                      **{**kw, knob: v}), knob, values)


def test_structural_knobs_still_key_a_graph(models, captured):
    """Whether T > 0 changes the round's graph (the keyed draw, the overflow guard): greedy and sampling requests
    never share one."""
    model = models["dream"]
    cr = captured(model)
    kw = dict(ROUND, strategy="lopa", branching_factor=2, seed=3)
    _generate(model, [5, 9, 2, 7], compile=True, temperature=0.0, **kw)
    n = len(cr.fns)
    _generate(model, [5, 9, 2, 7], compile=True, temperature=0.7, **kw)
    assert len(cr.fns) > n


def test_compiling_server_adds_no_graph_per_float_knob(captured):
    """`serve --compile` (the operator's `compile` default): requests that differ only in temperature / top_p
    replay the graphs the first one built, and each answers what the eager `generate` answers."""
    from fastapi.testclient import TestClient

    from lopa_fast.assets import model_dir
    from lopa_fast.server.app import create_app
    from lopa_fast.server.worker import Worker
    from lopa_fast.request.text import answer_text, text_decoder

    model = lopa_fast.load_model(model_dir(), dtype=torch.float32)
    tok = lopa_fast.load_tokenizer(model_dir())
    cr = captured(model)
    # block 32 given: at the embedded model's own block 8 (lopa_fast.request.model_defaults) this request shape counted no
    # CompiledRounds graph (issue 42 changed the default, not the subject: float knobs add no graph)
    knobs = dict(strategy="lopa", branching_factor=2, max_new_tokens=16, seed=3, block_size=32)
    worker = Worker(model, tok, concurrency=1)
    prompt = "Lily has 3 apples . She buys 5 more . How many apples does she have ?"
    ids = tok(prompt)["input_ids"]
    try:
        with TestClient(create_app(worker, model_id="m", defaults={**knobs, "compile": True})) as http:
            seen = []
            requests = [dict(temperature=0.6), dict(temperature=1.4), dict(temperature=1.4, top_p=0.9),
                        dict(temperature=1.4, top_p=0.6)]
            for i, sampling in enumerate(requests):
                r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, **sampling})
                assert r.status_code == 200, r.text
                want = lopa_fast.generate(model, ids, **knobs, **sampling)
                assert r.json()["usage"]["forwards"] == want.stats["forwards"], sampling
                assert r.json()["choices"][0]["text"] == answer_text(want, text_decoder(tok), model.eos_token_id, [])
                seen.append(tuple(want.generated_ids))
                if i == 0:
                    assert cr.graphs >= 1
                    graphs, fns = cr.graphs, len(cr.fns)
                elif i == 2:  # the first request with a top-p filter: another graph (a structural knob)
                    assert cr.graphs > graphs
                    graphs, fns = cr.graphs, len(cr.fns)
                else:
                    assert (cr.graphs, len(cr.fns)) == (graphs, fns), sampling
            assert len(set(seen)) >= 3  # the knobs change the answers
    finally:
        worker.close()
