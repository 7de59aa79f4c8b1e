"""The reference D2F / LoPA decoders against golden trajectories of the UPSTREAM code.

tests/golden/lopa_upstream.json was produced by `python tests/golden/make_lopa_golden.py <LoPA checkout>
--d2f <Discrete-Diffusion-Forcing checkout>`, which runs zhijie-group/LoPA's own decoding loops
(`_generate_enhanced_speculative`, `_generate_original_single_branch`, at 433177a) and D2F's own
`_generate_block_single` (block-causal; 771f745) on the same seeded tiny models (CPU, fp32, T=0). Every
case must match token for token, in upstream's step count (forwards + 1) and in model calls (branches
forwarded, summed over rounds; for LoPA upstream's count includes the duplicate anchor it forwards after a
spawn with no lookahead, which we count in stats["upstream_model_calls"] without running it).
"""
from __future__ import annotations

import json
import os

import pytest

import lopa_fast
from tests.utils import golden_models

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "lopa_upstream.json")
DATA = json.load(open(GOLDEN))
KNOBS = ("max_new_tokens", "block_size", "block_add_threshold", "decoded_token_threshold", "skip_threshold",
         "sampling_strategy", "branching_factor", "branch_topp", "selection_conf_alpha", "use_full_attention",
         "eos_token_id")


@pytest.fixture(scope="module")
def models():
    return golden_models(DATA, "tests/golden/make_lopa_golden.py")


def test_changed_golden_weights_fail_not_skip():
    name, spec = next(iter(DATA["models"].items()))
    tampered = {"models": {name: dict(spec, fingerprint="0" * 16)}}
    with pytest.raises(pytest.fail.Exception, match="builds different weights"):
        golden_models(tampered, "tests/golden/make_lopa_golden.py")


def test_golden_cases_cover_the_grid():
    cases = DATA["cases"]
    assert len(cases) >= 52 and sum(c.get("source") == "D2F-eval" for c in cases) >= 6
    assert {c.get("branching_factor") for c in cases} == {None, 1, 2, 4}
    assert {c["sampling_strategy"] for c in cases} == {"default", "margin", "neg_entropy"}
    assert {c["use_full_attention"] for c in cases} == {True, False}
    assert any(len(c["generated_ids"]) < c["max_new_tokens"] for c in cases)  # EOS stops growth somewhere


@pytest.mark.parametrize("i", range(len(DATA["cases"])))
def test_reference_matches_upstream(models, i):
    case = DATA["cases"][i]
    kw = {k: case[k] for k in KNOBS if k in case}
    kw.update({k: case[k] for k in ("top_p", "top_k") if case.get(k) is not None})
    if case["strategy"] == "d2f":
        kw.pop("branching_factor", None)
    out = lopa_fast.generate(models[case["model"]], case["prompt"], case["strategy"], "reference", **kw)
    assert out.generated_ids == case["generated_ids"]
    if case.get("source") == "D2F-eval":  # D2F's own loop: returns text, counted by forwards
        assert out.stats["forwards"] == case["forwards"]
        return
    assert out.stats["upstream_steps"] == case["upstream_steps"]
    calls = out.stats["upstream_model_calls"] if case["strategy"] == "lopa" else out.stats["model_calls"]
    assert calls == case["model_calls"]
