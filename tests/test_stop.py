"""Stop sequences (every strategy): decoding ends once a stop sequence lies in the finalised prefix (the tokens
before the first mask), the output is cut before it, finish_reason "stop"; the fast backend ends at the same
round as the reference (the check rides on the round's one host read); vanilla, threshold and apd check the
finalised prefix after every step (lopa_fast.output.progress.after_step)."""
from __future__ import annotations

import pytest
import torch

import lopa_fast
from lopa_fast.output.progress import first_stop
from lopa_fast.testing import random_model, tiny_hf_config

KW = dict(block_size=4, max_new_tokens=24, skip_threshold=0.7)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)


def test_first_stop():
    assert first_stop([5, 6, 7, 6, 7], [(6, 7)]) == 1
    assert first_stop([5, 6, 7, 6, 7], [(7, 6), (9,)]) == 2
    assert first_stop([5, 6, 63, 6, 7], [(6, 7)], mask_token_id=63) is None  # only the finalised prefix
    assert first_stop([5, 6], [(6, 7)]) is None and first_stop([1], None) is None


@pytest.mark.parametrize("strategy, extra", [("d2f", {}), ("lopa", dict(branching_factor=2)),
                                             ("lopa", dict(branching_factor=4, use_full_attention=False))])
def test_stop_ends_early_and_cuts(model, strategy, extra):
    prompt = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(4))
    full = lopa_fast.generate(model, prompt, strategy, "reference", **KW, **extra)
    ids = full.generated_ids
    # the first token pair from position 6 on that first occurs where it stands: a stop well inside the answer
    i = min(j for j in range(6, len(ids) - 1) if first_stop(ids, [ids[j : j + 2]]) == j)
    stop, want = [ids[i : i + 2]], i
    assert want >= 6, ids  # the subject of the test: a stop after several filled positions
    outs = {b: lopa_fast.generate(model, prompt, strategy, b, stop=stop, **KW, **extra) for b in ("reference", "fast")}
    for b, out in outs.items():
        assert out.generated_ids == ids[:want], b
        assert out.stats["finish_reason"] == "stop" and out.stats["stop_sequence_at"] == want, b
        assert out.stats["forwards"] <= full.stats["forwards"], b
    assert outs["fast"].stats["forwards"] == outs["reference"].stats["forwards"]
    if want + 2 <= len(ids) - KW["block_size"]:  # the stop is final before the last block: rounds are saved
        assert outs["fast"].stats["forwards"] < full.stats["forwards"]
    assert outs["fast"].stats.get("stopped") == outs["reference"].stats.get("stopped")


STEP_CASES = [  # (strategy, knobs): each ends a few forwards early at a stop inside its answer (measured)
    ("vanilla", dict(steps=12, alg="origin", seed=3)),
    ("vanilla", dict(steps=24, alg="maskgit_plus")),
    ("threshold", dict(threshold=0.5, block_length=8)),
    ("threshold", dict(threshold=0.5, block_length=8, cache="dual")),
    ("apd", dict(max_lookahead=6, tokens_per_step=2, eos_token_id=1, suppress_mask_token=True)),
]


@pytest.mark.parametrize("strategy, extra", STEP_CASES)
def test_stop_step_strategies(model, strategy, extra):
    """vanilla / threshold / apd: the output is the full decode cut before the stop, finish_reason "stop", and
    decoding ends after the step that completed the stop in the finalised prefix (never later)."""
    prompt = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=24, **extra)
    full = lopa_fast.generate(model, prompt, strategy, "reference", **kw)
    ids = full.generated_ids
    i = min(j for j in range(6, len(ids) - 1) if first_stop(ids, [ids[j : j + 2]]) == j)
    prefixes = []
    out = lopa_fast.generate(model, prompt, strategy, "reference", stop=[ids[i : i + 2]], **kw,
                             on_round=lambda prefix, info: prefixes.append(prefix))
    assert out.generated_ids == ids[:i]
    assert out.stats["finish_reason"] == "stop" and out.stats["stop_sequence_at"] == i and out.stats["stopped"]
    assert first_stop(prefixes[-1], [ids[i : i + 2]]) == i  # the last step completed the stop ...
    assert all(first_stop(p, [ids[i : i + 2]]) is None for p in prefixes[:-1])  # ... and no earlier one did
    assert out.stats["forwards"] == len(prefixes) <= full.stats["forwards"]
    if strategy != "vanilla" or extra["alg"] == "origin":  # maskgit_plus fills by confidence: final at the end
        assert out.stats["forwards"] < full.stats["forwards"]


def test_stop_that_never_appears_changes_nothing(model):
    prompt = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(5))
    base = lopa_fast.generate(model, prompt, "lopa", "fast", **KW)
    absent = next(t for t in range(60) if t not in base.generated_ids)
    out = lopa_fast.generate(model, prompt, "lopa", "fast", stop=[[absent]], **KW)
    assert out.generated_ids == base.generated_ids and out.stats["forwards"] == base.stats["forwards"]
    assert "stop_sequence_at" not in out.stats


@pytest.mark.parametrize("stop, exc, pattern", [
    ([], TypeError, "non-empty list"),
    ("13", TypeError, "a text stop needs a tokenizer"),  # text stops take the model's (or tokenizer=) tokenizer
    ([13], TypeError, "token-id sequences"),
    ([[]], ValueError, "stop sequence"),
    ([[1, "a"]], ValueError, "stop sequence"),
    ([[-1]], ValueError, "stop sequence"),
    ([[1]] * 17, ValueError, "at most 16"),
])
def test_bad_stop_values(model, stop, exc, pattern):
    with pytest.raises(exc, match=pattern):
        lopa_fast.generate(model, [1, 2, 3], "lopa", "fast", stop=stop, **KW)


def test_stop_ids_and_strategies_checked(model):
    with pytest.raises(ValueError, match="vocab_size=64"):
        lopa_fast.generate(model, [1, 2, 3], "d2f", "reference", stop=[[64]], **KW)
    assert lopa_fast.GenerateConfig(stop=[[1, 2], (3,)]).stop == ((1, 2), (3,))  # lists stored as tuples


@pytest.mark.slow
def test_stop_compiled(model):
    prompt = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(4))
    full = lopa_fast.generate(model, prompt, "lopa", "reference", branching_factor=2, **KW)
    stop = [full.generated_ids[10:12]]
    ref = lopa_fast.generate(model, prompt, "lopa", "reference", branching_factor=2, stop=stop, **KW)
    comp = lopa_fast.generate(model, prompt, "lopa", "fast", branching_factor=2, stop=stop, compile=True, **KW)
    assert comp.generated_ids == ref.generated_ids and comp.stats["forwards"] == ref.stats["forwards"]
