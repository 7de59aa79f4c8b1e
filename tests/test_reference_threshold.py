"""Threshold decoding: the three commit rules hand-worked, the cache modes' window shapes and forward
counts on the stub model, and invariants on tiny random LLaDA / Dream models."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from test_reference_common import StubModel

import lopa_fast
from lopa_fast.strategies.threshold.reference import factor_count, select
from lopa_fast.testing import random_model, tiny_hf_config

MASK = 7


def test_factor_rule_edge_cases():
    # thresholds for ranks 1..n with f=1: -1, 1-1/3, 1-1/4, 1-1/5 ...
    assert factor_count([0.9, 0.5, 0.3, 0.2], 1.0) == 1  # breaks at rank 2
    assert factor_count([0.9, 0.8, 0.3, 0.2], 1.0) == 2  # breaks at rank 3
    assert factor_count([0.9, 0.8, 0.3], 1.0) == 3  # breaks at the LAST rank: upstream commits all
    assert factor_count([0.99, 0.99], 1.0) == 2  # no break
    assert factor_count([0.1], 1.0) == 1
    assert factor_count([0.9, 0.8, 0.78, 0.5, 0.1], 1.0) == 3  # 0.78 >= 3/4, 0.5 < 4/5: break at rank 4


def _cfg(**kw):
    base = dict(threshold=None, factor=None, entropy_threshold=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_threshold_and_entropy_rules_commit_rank1_and_ties_at_tau():
    cand = torch.tensor([True, True, True, False])
    conf = torch.tensor([0.5, 0.9, 0.3, 0.99], dtype=torch.float64)
    ent = torch.tensor([0.2, 0.1, 0.9, 0.0], dtype=torch.float64)
    assert sorted(select(conf, ent, cand, _cfg(threshold=0.9)).tolist()) == [1]  # equality commits
    assert sorted(select(conf, ent, cand, _cfg(threshold=0.5)).tolist()) == [0, 1]
    assert sorted(select(conf, ent, cand, _cfg(threshold=0.95)).tolist()) == [1]  # rank 1 always
    assert sorted(select(conf, ent, cand, _cfg(entropy_threshold=0.2)).tolist()) == [0, 1]  # H <= tau
    assert sorted(select(conf, ent, cand, _cfg(entropy_threshold=0.05)).tolist()) == [1]
    assert sorted(select(conf, ent, cand, _cfg(factor=1.0)).tolist()) == [1]
    assert select(conf, ent, torch.zeros(4, dtype=torch.bool), _cfg(threshold=0.9)).numel() == 0


def run_stub(probs, shift, **kw):
    model = StubModel(lambda c: (c.pos % 6, probs(c)), shift=shift)
    out = lopa_fast.generate(model, [0, 1], "threshold", max_new_tokens=8, block_size=4, **kw)
    return model, out


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
def test_llada_cache_window_shapes(cache):
    # probability grows with the forward index: two tokens per step after the first
    model, out = run_stub(lambda c: 0.95 if c.call % 2 else 0.5, False, threshold=0.9, cache=cache)
    assert out.generated_ids == [2, 3, 4, 5, 0, 1, 2, 3]
    shapes = [(c.start, c.n, c.cache_len) for c in model.calls]
    if cache is None:
        assert all(s == (0, 10, 0) for s in shapes)
    elif cache == "prefix":
        # block 1: refresh (whole sequence), then x[2:] over the prompt cache; block 2: refresh, x[6:]
        assert shapes == [(0, 10, 0), (2, 8, 2), (0, 10, 0), (6, 4, 6)]
    else:
        # dual: refresh caches all 10 positions; steps forward only the block, in place
        assert shapes == [(0, 10, 0), (2, 4, 10), (0, 10, 0), (6, 4, 10)]
    assert out.stats["forwards"] == len(model.calls)


def test_count_noop_forward_reproduces_the_old_loop():
    # the refresh already fills each block (p=0.95 everywhere): the new loop skips the cached forward,
    # the old one runs it and commits nothing
    _, new = run_stub(lambda c: 0.95, False, threshold=0.9, cache="prefix")
    _, old = run_stub(lambda c: 0.95, False, threshold=0.9, cache="prefix", count_noop_forward=True)
    assert new.generated_ids == old.generated_ids
    assert new.stats["forwards"] == 2 and old.stats["forwards"] == 4 and old.stats["noop_forwards"] == 2


def test_dream_refresh_commits_block_start_unconditionally():
    # Dream + prefix cache: the refresh step commits only x[s], even at p = 0.2
    model, out = run_stub(lambda c: 0.2, True, threshold=0.9, cache="prefix")
    first_step = model.calls[1].tokens[0].tolist()
    assert first_step[0] == 2 and first_step[1:4] == [MASK] * 3
    assert MASK not in out.generated_ids


def test_round_cap_in_threshold_loop():
    model = StubModel(lambda c: (MASK, 0.99), shift=False)
    with pytest.warns(RuntimeWarning, match="round cap"):
        out = lopa_fast.generate(model, [0, 1], "threshold", max_new_tokens=4, block_size=4, threshold=0.9,
                                 max_rounds=6)
    assert out.stats["hit_round_cap"] and out.stats["forwards"] == 6


@pytest.fixture(scope="module")
def tiny():
    return {
        "llada": random_model(tiny_hf_config("llada"), seed=4, sharpen=5.0),
        "dream": random_model(tiny_hf_config("dream"), seed=5, sharpen=5.0),
    }


def test_threshold_invariants_and_coverage(tiny):
    multi = 0
    rules = [dict(threshold=0.7), dict(factor=1.0), dict(entropy_threshold=0.6)]
    modes = itertools.product(["llada", "dream"], [None, "prefix", "dual"])
    for (kind, cache), rule in zip(modes, itertools.cycle(rules)):
        m = tiny[kind]
        out = lopa_fast.generate(m, [3, 9, 4, 1], "threshold", max_new_tokens=16, block_size=8, cache=cache, **rule)
        s = out.stats
        assert len(out.generated_ids) == 16 and m.mask_token_id not in out.generated_ids
        assert 2 <= s["forwards"] <= 16 + 2 and s["tpf"] == pytest.approx(16 / s["forwards"])
        if cache is not None:
            assert s["refresh_forwards"] == 2
        multi += s["multi_token_steps"] > 0
    assert multi > 0
