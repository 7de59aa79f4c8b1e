"""Parity gate of the fast decoder: token-for-token and forward-for-forward equal to backend="reference",
fp32 on CPU, over a grid of configs and sharpened random tiny models.

The grid is the product of branching_factor {1,2,4,8} x sampling_strategy x attention mode x block size
{4,8,16,32} x threshold settings x models; prompt length (1..64) and the EOS id are drawn per case.
CI runs a seeded subset (GRID_CI cases); `-m slow` runs the whole product. Coverage counters summed over
the grid are asserted so that it cannot pass while a path (threshold accepts, fallbacks, multi-token
rounds, lookahead wins, branch-specific growth, ragged windows, EOS stops, the round cap) never runs.
"""
from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch

import lopa_fast
from lopa_fast.testing import random_model, tiny_hf_config

KS = (1, 2, 4, 8)
SAMPLING = ("default", "margin", "neg_entropy")
FULL = (True, False)
BLOCKS = (4, 8, 16, 32)
# (block_add_threshold, decoded_token_threshold, skip_threshold): the scripts' setting, then looser and
# stricter ones that make fallbacks, early activation and multi-block windows frequent
THRESHOLDS = ((0.1, 0.95, 0.9), (0.5, 0.8, 0.7), (0.3, 0.5, 0.95), (0.0, 0.0, 0.99))
MODELS = ("gqa64", "mha128", "gqa96", "llada64")
GRID_CI = 90
COUNTERS = ("accepted_by_threshold", "fallback_fills", "multi_token_rounds", "lookahead_wins", "branch_growth",
            "winner_grew", "eos_fills", "ragged_rounds")


def build_models() -> dict:
    """Three sharpened Dream-family models (GQA / MHA, vocab 64 / 128 / 96, one with the mask-token head
    row NOT zeroed so it can predict the mask id) and a LLaDA one (no logit shift)."""
    return {
        "gqa64": random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6),
        "mha128": random_model(
            tiny_hf_config("dream", vocab_size=128, num_kv_heads=4), seed=1, sharpen=4, zero_mask_row=False
        ),
        "gqa96": random_model(
            tiny_hf_config("dream", vocab_size=96, hidden_size=48, num_kv_heads=1), seed=2, sharpen=8
        ),
        "llada64": random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=6),
    }


def frequent_token(model) -> int:
    """The token the model predicts most often on random inputs (used as EOS so that EOS stops happen)."""
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    ids = torch.randint(0, V - 3, (4, 48), generator=g)
    pred = model(ids).argmax(-1).flatten()
    pred = pred[pred != model.mask_token_id]
    return int(torch.bincount(pred, minlength=V).argmax())


def full_product() -> list[dict]:
    cases = []
    grid = itertools.product(KS, SAMPLING, FULL, BLOCKS, THRESHOLDS, MODELS)
    for i, (k, samp, full, bs, th, mname) in enumerate(grid):
        r = random.Random(i)
        cases.append(
            dict(
                model=mname,
                prompt_len=r.randint(1, 64),
                prompt_seed=i,
                eos="frequent" if r.random() < 0.5 else "default",
                strategy="d2f" if (k == 1 and r.random() < 0.5) else "lopa",
                branching_factor=k,
                sampling_strategy=samp,
                use_full_attention=full,
                block_size=bs,
                max_new_tokens=bs * r.choice((1, 2, 3, 4)),
                block_add_threshold=th[0],
                decoded_token_threshold=th[1],
                skip_threshold=th[2],
                # the less common knobs ride along on a fraction of the cases
                branch_topp=r.choice((1.0, 1.0, 1.0, 0.5)),
                selection_conf_alpha=r.choice((0.0, 0.0, 0.0, 0.3)),
                top_p=r.choice((None, None, None, 0.9)),
                top_k=r.choice((None, None, None, 5)),
                suppress_mask_token=r.random() < 0.15,
                max_rounds=r.choice((None,) * 7 + (5,)),
            )
        )
    return cases


def ci_subset(n: int = GRID_CI) -> list[dict]:
    cases = full_product()
    return random.Random(1234).sample(cases, n)


def run_case(models: dict, eos_ids: dict, case: dict):
    case = dict(case)
    m = models[case.pop("model")]
    P, seed = case.pop("prompt_len"), case.pop("prompt_seed")
    eos = case.pop("eos")
    V = m.config.vocab_size
    prompt = torch.randint(0, V - 3, (P,), generator=torch.Generator().manual_seed(seed))
    if eos == "frequent":
        case["eos_token_id"] = eos_ids[id(m)]
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # round-cap warnings are expected on some cases
        for backend in ("reference", "fast"):
            out[backend] = lopa_fast.generate(m, prompt, backend=backend, **case)
    return out["reference"], out["fast"], case


def check_cases(cases: list[dict]) -> dict:
    """Run every case on both backends; assert parity; return summed coverage counters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second intra-op thread only adds synchronisation (10x slower
    try:  # measured on a loaded 2-core machine)
        return _check_cases(cases)
    finally:
        torch.set_num_threads(threads)


def _check_cases(cases: list[dict]) -> dict:
    models = build_models()
    eos_ids = {id(m): frequent_token(m) for m in models.values()}
    cov = dict.fromkeys(COUNTERS + ("eos_stops", "round_caps", "multi_branch_rounds"), 0)
    bad = []
    for case in cases:
        ref, fast, used = run_case(models, eos_ids, case)
        same = ref.generated_ids == fast.generated_ids and ref.stats["forwards"] == fast.stats["forwards"]
        for key in ("accepted_by_threshold", "fallback_fills", "eos_fills", "multi_token_rounds", "lookahead_wins",
                    "branch_growth", "winner_grew", "hit_round_cap", "eos_detected"):
            if key in ref.stats and ref.stats[key] != fast.stats.get(key):
                same = False
        if not same:
            bad.append((case, ref.stats["forwards"], fast.stats["forwards"], ref.generated_ids, fast.generated_ids))
        for key in COUNTERS:
            cov[key] += int(fast.stats.get(key, 0))
        cov["round_caps"] += int(fast.stats["hit_round_cap"])
        cov["eos_stops"] += int(fast.stats["eos_detected"] and len(fast.generated_ids) < used["max_new_tokens"])
        cov["multi_branch_rounds"] += int(fast.stats.get("max_branches", 1) > 1)
    assert not bad, f"{len(bad)}/{len(cases)} cases differ; first: {bad[0]}"
    return cov


def assert_coverage(cov: dict) -> None:
    missing = [k for k, v in cov.items() if v == 0]
    assert not missing, f"paths never exercised by the grid: {missing} (counters: {cov})"


def test_parity_grid_ci():
    """A seeded subset of the product (every axis value appears); parity + coverage counters."""
    cases = ci_subset()
    for axis, values in (("branching_factor", KS), ("sampling_strategy", SAMPLING), ("use_full_attention", FULL),
                         ("block_size", BLOCKS), ("model", MODELS)):
        assert {c[axis] for c in cases} == set(values), axis
    cov = check_cases(cases)
    assert_coverage(cov)


@pytest.mark.slow
def test_parity_grid_full():
    cov = check_cases(full_product())
    assert_coverage(cov)


def test_grid_sizes():
    assert len(full_product()) == len(KS) * len(SAMPLING) * len(FULL) * len(BLOCKS) * len(THRESHOLDS) * len(MODELS)
    assert {c["prompt_len"] for c in full_product()} == set(range(1, 65))


def test_lopa_k1_fast_equals_d2f_fast():
    """branching_factor=1 LoPA is plain D2F on the fast path too."""
    m = build_models()["gqa64"]
    prompt = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(5))
    kw = dict(block_size=8, max_new_tokens=32, skip_threshold=0.7, block_add_threshold=0.5)
    a = lopa_fast.generate(m, prompt, "lopa", "fast", branching_factor=1, **kw)
    b = lopa_fast.generate(m, prompt, "d2f", "fast", **kw)
    assert a.generated_ids == b.generated_ids and a.stats["forwards"] == b.stats["forwards"]


def test_fast_stats_and_single_forward_per_round():
    """One model call per round whatever k (the reference issues one per branch)."""
    m = build_models()["gqa64"]
    prompt = torch.randint(0, 60, (12,), generator=torch.Generator().manual_seed(1))
    kw = dict(block_size=8, max_new_tokens=32, skip_threshold=0.7, branching_factor=4)
    ref = lopa_fast.generate(m, prompt, "lopa", "reference", **kw)
    fast = lopa_fast.generate(m, prompt, "lopa", "fast", **kw)
    assert fast.stats["backend"] == "fast" and ref.stats["backend"] == "reference"
    assert fast.stats["model_calls"] == fast.stats["forwards"] == ref.stats["forwards"]
    assert ref.stats["model_calls"] > ref.stats["forwards"]  # several branches per round there
    for key in ("generated_tokens", "tokens_until_eos", "tpf", "upstream_steps", "masks_left"):
        assert fast.stats[key] == ref.stats[key], key


def test_trace_matches_reference():
    m = build_models()["gqa64"]
    prompt = torch.randint(0, 60, (7,), generator=torch.Generator().manual_seed(2))
    kw = dict(block_size=4, max_new_tokens=16, skip_threshold=0.7, branching_factor=2, return_trace=True)
    ref = lopa_fast.generate(m, prompt, "lopa", "reference", **kw)
    fast = lopa_fast.generate(m, prompt, "lopa", "fast", **kw)
    assert len(ref.trace) == len(fast.trace) == fast.stats["forwards"]
    for r, f in zip(ref.trace, fast.trace):
        for key in ("round", "window_start", "cached", "winner", "accepted"):
            assert r[key] == f[key], (key, r, f)
        assert [b["lookahead"] for b in r["branches"]] == [b["lookahead"] for b in f["branches"]]
        assert [b["window_len"] for b in r["branches"]] == [b["window_len"] for b in f["branches"]]
        # the fast path's attention is SDPA, the reference's the split formula: scores agree within rounding (~3e-6
        # measured), not bitwise (docs/fast_decoder.md "Parity"); the winner and every token are exact
        assert [b["score"] for b in r["branches"]] == pytest.approx([b["score"] for b in f["branches"]], abs=2e-5)


def test_parity_on_the_torch_layer_ops(monkeypatch):
    """LOPA_FAST_BACKEND=torch (what an install without lopa_fast._C runs): the fast path's layer ops are the torch
    formulas (rms_norm / rope / the guard: no C++ call) and its tokens still equal the reference's on a quarter of
    the CI subset (the C++ norms are within 2 ulp of the formula, so both paths are gated)."""
    from lopa_fast.ops import _backend

    monkeypatch.setenv("LOPA_FAST_BACKEND", "torch")
    called = []
    real = _backend.cpp_module()
    monkeypatch.setattr(_backend, "cpp_module", lambda: called.append(1) or real)
    check_cases(ci_subset()[::4])
    assert not called, "a C++ op ran under LOPA_FAST_BACKEND=torch"
