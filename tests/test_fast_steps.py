"""Parity gate of the fast vanilla and threshold decoders (lopa_fast.decode.{vanilla,threshold}): token-for-token
and forward-for-forward equal to backend="reference", fp32 on CPU, over a grid of configs and sharpened random
tiny models (Dream and LLaDA families; one Dream model whose mask-token head row is NOT zeroed, so that it
predicts the mask id and leaves masks behind a block).

Threshold grid: rule (threshold / factor / entropy_threshold, two values each) x cache (None, prefix, dual) x
block length x count_noop_forward x EOS id x temperature (0 and the keyed sampler at 0.7); vanilla grid:
LLaDA (block length, steps per block, low_confidence / random remasking, cfg_scale, logits_eos_inf,
confidence_eos_eot_inf) and Dream (alg, steps, alg_temp, top-p / top-k) at T = 0 and T > 0. CI runs a seeded
subset; `-m slow` the whole product. Summed coverage counters make sure the subset cannot pass while a path
(multi-token steps, no-op forwards, T > 0, every cache) never runs.
"""
from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch

import lopa_fast
from lopa_fast.strategies import steps
from tests.utils import step_models

THRESHOLD_RULES = (("threshold", 0.5), ("threshold", 0.9), ("factor", 1.0), ("factor", 2.5),
                   ("entropy_threshold", 0.3), ("entropy_threshold", 1.5))
CACHES = (None, "prefix", "dual")
GRID_CI = 60


@pytest.fixture(scope="module")
def models() -> dict:
    return step_models()


def threshold_cases() -> list[dict]:
    out = []
    names = ("dream", "dream_mask", "llada", "llada_mask")
    grid_ = itertools.product(names, THRESHOLD_RULES, CACHES, (4, 8), (False, True), (0.0, 0.7))
    for i, (m, (rule, val), cache, bl, noop, T) in enumerate(grid_):
        rng = random.Random(i)
        P = rng.randint(1, 12)
        kw = dict(max_new_tokens=16, block_length=bl, cache=cache, count_noop_forward=noop, temperature=T,
                  seed=rng.randrange(1000), eos_token_id=rng.choice([None, 7]), **{rule: val})
        out.append(dict(model=m, prompt=[rng.randrange(0, 60) for _ in range(P)], strategy="threshold", kw=kw))
    return out


def vanilla_cases() -> list[dict]:
    out = []
    for i, (m, T) in enumerate(itertools.product(("dream", "dream_mask", "llada", "llada_mask"), (0.0, 0.0, 0.5, 1.0))):
        for j in range(12):
            rng = random.Random(1000 * i + j)
            P = rng.randint(1, 12)
            kw = dict(max_new_tokens=16, temperature=T, seed=rng.randrange(1000), eos_token_id=rng.choice([None, 7]))
            if m.startswith("llada"):
                bl = rng.choice([4, 8, 16])
                kw.update(block_length=bl, steps=(16 // bl) * rng.choice([1, 2, 4]),
                          remasking=rng.choice(["low_confidence", "random"]), cfg_scale=rng.choice([0.0, 0.0, 1.5]),
                          logits_eos_inf=rng.random() < 0.2, confidence_eos_eot_inf=rng.random() < 0.3)
            else:
                algs = ["origin", "maskgit_plus", "topk_margin", "entropy"]
                kw.update(steps=rng.choice([4, 8, 16]), alg=rng.choice(algs))
                if rng.random() < 0.3:
                    kw["alg_temp"] = 0.5
                if T > 0 and rng.random() < 0.5:
                    kw.update(top_p=0.9, top_k=20)
            out.append(dict(model=m, prompt=[rng.randrange(0, 60) for _ in range(P)], strategy="vanilla", kw=kw))
    return out


ALL_CASES = threshold_cases() + vanilla_cases()
CI_CASES = random.Random(18).sample(ALL_CASES, GRID_CI)


def run_pair(models, case):
    m = models[case["model"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masks-left warnings of the mask-predicting models (both backends)
        ref = lopa_fast.generate(m, case["prompt"], case["strategy"], "reference", **case["kw"])
        fast = lopa_fast.generate(m, case["prompt"], case["strategy"], "fast", **case["kw"])
    return ref, fast


def check(ref, fast, case) -> None:
    assert fast.stats["backend"] == "fast"
    assert fast.generated_ids == ref.generated_ids, case
    assert fast.stats["forwards"] == ref.stats["forwards"], case
    keys = ("transferred",)
    if case["strategy"] == "threshold":
        keys = ("multi_token_steps", "noop_forwards", "refresh_forwards")
    for k in keys:
        assert fast.stats[k] == ref.stats[k], (k, case)
    assert fast.stats["host_reads"] == fast.stats["forwards"]  # one host read per step


def grid(models, cases) -> dict:
    cover = {"multi_token_steps": 0, "noop_forwards": 0, "threshold_T>0": 0, "vanilla_T>0": 0}
    caches = set()
    for case in cases:
        ref, fast = run_pair(models, case)
        check(ref, fast, case)
        cover["multi_token_steps"] += fast.stats.get("multi_token_steps", 0)
        cover["noop_forwards"] += fast.stats.get("noop_forwards", 0)
        cover[f"{case['strategy']}_T>0"] += case["kw"]["temperature"] > 0
        caches.add(case["kw"].get("cache", "vanilla"))
    assert all(v > 0 for v in cover.values()), cover
    assert caches == {None, "prefix", "dual", "vanilla"}, caches
    return cover


def test_parity_grid_ci(models):
    grid(models, CI_CASES)


@pytest.mark.slow
def test_parity_grid_full(models):
    grid(models, ALL_CASES)


def test_trace_matches_the_reference(models):
    for case in (dict(model="llada", prompt=[3, 4, 5], strategy="threshold",
                      kw=dict(max_new_tokens=8, block_length=4, cache="prefix", threshold=0.7)),
                 dict(model="dream", prompt=[3, 4, 5], strategy="threshold",
                      kw=dict(max_new_tokens=8, block_length=4, cache="dual", factor=1.0)),
                 dict(model="dream", prompt=[3, 4, 5], strategy="vanilla",
                      kw=dict(max_new_tokens=8, steps=4, alg="entropy")),
                 dict(model="llada", prompt=[3, 4, 5], strategy="vanilla",
                      kw=dict(max_new_tokens=8, steps=4, block_length=4))):
        case["kw"]["return_trace"] = True
        ref, fast = run_pair(models, case)
        assert fast.trace == ref.trace, case


def test_round_cap_and_stop(models):
    kw = dict(max_new_tokens=16, block_length=4, threshold=0.99, max_rounds=3)
    ref, fast = run_pair(models, dict(model="llada", prompt=[3, 4, 5], strategy="threshold", kw=kw))
    assert fast.stats["forwards"] == ref.stats["forwards"] == 3
    assert fast.stats["hit_round_cap"] and ref.stats["hit_round_cap"]
    assert fast.generated_ids == ref.generated_ids
    with pytest.warns(RuntimeWarning, match="max_rounds"):
        lopa_fast.generate(models["llada"], [3, 4, 5], "threshold", "fast", **kw)
    ids = ref.generated_ids
    for strategy, kw in (("threshold", dict(max_new_tokens=16, block_length=4, threshold=0.9)),
                         ("vanilla", dict(max_new_tokens=16, steps=16, alg="maskgit_plus"))):
        base = lopa_fast.generate(models["dream"], [3, 4, 5], strategy, "reference", **kw).generated_ids
        stop = [base[5:7]]
        ref, fast = run_pair(models, dict(model="dream", prompt=[3, 4, 5], strategy=strategy, kw=dict(kw, stop=stop)))
        assert fast.generated_ids == ref.generated_ids and fast.stats["forwards"] == ref.stats["forwards"]
        assert fast.stats["finish_reason"] == "stop" and len(fast.generated_ids) <= 5
    assert ids  # the capped run decoded something


def test_progress_hook_sees_the_reference_prefixes(models):
    seen = {"reference": [], "fast": []}
    for backend in seen:
        lopa_fast.generate(models["dream"], [3, 4, 5], "threshold", backend, max_new_tokens=8, block_length=4,
                           cache="dual", threshold=0.8,
                           on_round=lambda prefix, info, b=backend: seen[b].append(prefix))
    assert seen["fast"] == seen["reference"] and seen["fast"]


def select(conf, ent, cand, cfg):
    """The fast step's commit rule on a threshold config's rule knobs."""
    from lopa_fast.reference.ops import select_by_rule

    return select_by_rule(conf, ent, cand, cfg.factor, cfg.entropy_threshold, cfg.threshold)


def test_select_rules_on_hand_worked_rows():

    cfg = lopa_fast.GenerateConfig(strategy="threshold", threshold=0.5)
    conf = torch.tensor([0.2, 0.7, 0.9, 0.5, 0.6], dtype=torch.float64)
    ent = torch.tensor([2.0, 0.1, 0.5, 3.0, 0.2], dtype=torch.float64)
    cand = torch.tensor([True, True, False, True, True])
    assert select(conf, ent, cand, cfg).tolist() == [False, True, False, True, True]  # 0.5 >= 0.5 commits
    cfg = cfg.replace(threshold=None, entropy_threshold=0.15)
    assert select(conf, ent, cand, cfg).tolist() == [False, True, False, False, False]
    # factor 1.0: thresholds -1, 1 - 1/3, 1 - 1/4, 1 - 1/5 over the sorted candidates 0.7, 0.6, 0.5, 0.2: the
    # first break is at 0-based rank 1 (0.6 < 0.667), neither rank 0 nor the last: ranks < 1 commit
    cfg = cfg.replace(entropy_threshold=None, factor=1.0)
    assert select(conf, ent, cand, cfg).tolist() == [False, True, False, False, False]
    # factor 3.0 (thresholds -1, 0, 0.25, 0.4): the break at the last rank (0.2 < 0.4) commits every candidate
    assert select(conf, ent, cand, cfg.replace(factor=3.0)).tolist() == [True, True, False, True, True]
    assert not select(conf, ent, torch.zeros(5, dtype=torch.bool), cfg).any()  # no candidate: nothing


def test_select_equals_the_reference_rule_on_random_rows():
    from lopa_fast.strategies.threshold.reference import select as reference_select

    g = torch.Generator().manual_seed(0)
    for rule, val in THRESHOLD_RULES + (("factor", 0.3), ("factor", 6.0)):
        cfg = lopa_fast.GenerateConfig(strategy="threshold", **{rule: val})
        for _ in range(50):
            n = int(torch.randint(1, 12, (), generator=g))
            conf = torch.rand(n, generator=g, dtype=torch.float64)
            ent = torch.rand(n, generator=g, dtype=torch.float64) * 3
            cand = torch.rand(n, generator=g) < 0.7
            want = torch.zeros(n, dtype=torch.bool)
            want[reference_select(conf, ent, cand, cfg)] = True
            assert torch.equal(select(conf, ent, cand, cfg), want), (rule, val, conf, cand)


def test_raw_rows_follow_the_dream_shift():
    def raw(lo, hi, win_start, shift):  # the raw rows of positions [lo, hi) of a window starting at win_start
        pos, valid, r = steps.rows(torch.tensor(lo), hi, hi - lo, 64, shift, win_start=win_start)
        assert pos.tolist() == list(range(lo, hi)) and bool(valid.all())
        return r.tolist()

    assert raw(5, 9, 5, True) == [0, 0, 1, 2]  # the window's first row keeps its own
    assert raw(5, 9, 0, True) == [4, 5, 6, 7]
    assert raw(5, 9, 5, False) == [0, 1, 2, 3]
