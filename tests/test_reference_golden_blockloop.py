"""The reference vanilla / threshold decoders against golden trajectories of the UPSTREAM samplers.

tests/golden/blockloop_upstream.json was produced by `python tests/golden/make_blockloop_golden.py
--llada <ML-GSAI/LLaDA> --fastdllm <NVlabs/Fast-dLLM> --lopa <zhijie-group/LoPA>`, which runs LLaDA's
`generate`, Fast-dLLM's LLaDA threshold loops (no cache, prefix, dual) and Dream block sampler (prefix,
dual), and Dream's own `_sample` (vanilla) on seeded tiny models (CPU, fp32, T=0; the random orderings with
the global torch seed recorded in the case). Tokens and forward counts must match.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import lopa_fast
from tests.utils import golden_models

DATA = json.load(open(os.path.join(os.path.dirname(__file__), "golden", "blockloop_upstream.json")))


@pytest.fixture(scope="module")
def models():
    return golden_models(DATA, "tests/golden/make_blockloop_golden.py")


def test_golden_grid_covers_every_mode():
    seen = {(c["model"], c["strategy"], c["kw"].get("cache", c["kw"].get("alg", c["kw"].get("remasking"))))
            for c in DATA["cases"]}
    wanted = [("llada", "vanilla", "low_confidence"), ("llada", "vanilla", "random"), ("llada", "threshold", None),
              ("llada", "threshold", "prefix"), ("llada", "threshold", "dual"), ("dream", "threshold", "prefix"),
              ("dream", "threshold", "dual"), ("dream", "vanilla", "origin"), ("dream", "vanilla", "entropy")]
    for want in wanted:
        assert want in seen, want


@pytest.mark.parametrize("i", range(len(DATA["cases"])))
def test_reference_matches_upstream(models, i):
    case = DATA["cases"][i]
    kw = {k: v for k, v in case["kw"].items() if not (k == "cfg_scale" and v == 0.0)}
    if case.get("torch_seed") is not None:
        torch.manual_seed(case["torch_seed"])  # upstream draws from the global generator
        kw["sampler"] = "upstream"  # in upstream's order (the default keyed sampler draws by key)
    out = lopa_fast.generate(models[case["model"]], case["prompt"], case["strategy"], "reference",
                             max_new_tokens=case["max_new_tokens"], **kw)
    assert out.generated_ids == case["generated_ids"]
    assert out.stats["forwards"] == case["forwards"]
