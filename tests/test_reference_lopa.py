"""Hand-worked LoPA rounds on the stub model (scoring, winner choice and its tie order, spawn ranking,
branch-specific growth, Commit-Winner-Cache) and properties over sharpened random tiny models with
coverage counters (threshold accepts, multi-token rounds, lookahead wins, branch growth, EOS stops)."""
from __future__ import annotations

import itertools

import pytest
import torch
from test_reference_common import StubModel

import lopa_fast
from lopa_fast.testing import random_model, tiny_hf_config

KW = dict(block_add_threshold=0.5, decoded_token_threshold=0.75, skip_threshold=0.9, sampling_strategy="default")
MASK = 7


def filled(c, pos):
    """Is absolute position `pos` non-mask in this branch's window?"""
    j = pos - c.start
    return 0 <= j < len(c.tokens) and c.tokens[j] != MASK


def test_lopa_round_scores_winner_and_spawn():
    # round 1 (anchor alone): pos 2 accepted; lookaheads ranked by confidence: pos 4 (0.7), pos 3 (0.6)
    # round 2: order L(pos4), L(pos3), anchor; L(pos3)'s context makes pos 4, 5 confident -> it wins with
    # score 0.95 against 0.5 and 0.4, and its logits fill pos 4 and 5: 3 tokens in one round
    def rule(c):
        if c.call == 0:
            return (c.pos % 6, {2: 0.95, 3: 0.6, 4: 0.7, 5: 0.5}.get(c.pos, 0.2))
        if filled(c, 3):
            return (c.pos % 6, 0.95)
        if filled(c, 4):
            return (c.pos % 6, 0.5)
        return (c.pos % 6, 0.4)

    model = StubModel(rule)
    out = lopa_fast.generate(model, [0, 1], "lopa", max_new_tokens=4, block_size=4, branching_factor=2,
                             return_trace=True, **KW)
    assert out.generated_ids == [2, 3, 4, 5]
    assert [c.tokens[0].tolist() for c in model.calls[1:]] == [[2, 7, 4, 7], [2, 3, 7, 7], [2, 7, 7, 7]]
    s = out.stats
    assert s["forwards"] == 2 and s["model_calls"] == 4 and s["lookahead_wins"] == 1 and s["tpf"] == 2.0
    r2 = out.trace[1]
    assert r2["winner"] == 1 and [b["lookahead"] for b in r2["branches"]] == [2, 1, None]
    assert [round(b["score"], 4) for b in r2["branches"]] == [0.5, 0.95, 0.4]
    assert r2["accepted"] == [[1, 3], [2, 4], [3, 5]]


def test_lopa_winner_tie_goes_to_lookahead_and_spawn_tie_to_earlier_position():
    # block of 2: round 1 fills pos 2 by fallback (0.6 > 0.5); the single remaining mask spawns one
    # lookahead (token 3). Round 2: the lookahead has no masks left (score 1.0) and the anchor predicts
    # token 5 at pos 3 with p = 1.0 (score 1.0): a tie, which upstream's stable sort gives to the
    # lookahead (it comes first) -> the output keeps token 3
    def rule(c):
        if c.call == 0:
            return (c.pos % 6, {2: 0.6, 3: 0.5}.get(c.pos, 0.2))
        return (5, 1.0)

    model = StubModel(rule)
    out = lopa_fast.generate(model, [0, 1], "lopa", max_new_tokens=2, block_size=2, branching_factor=2, **KW)
    assert out.generated_ids == [2, 3] and out.stats["lookahead_wins"] == 1 and out.stats["forwards"] == 2

    # equal confidences at pos 3 and 4 (identical logit rows): the earlier position ranks first
    def rule2(c):
        if c.call == 0:
            return {2: (2, 0.95), 3: (1, 0.6), 4: (1, 0.6), 5: (5, 0.1)}.get(c.pos, (0, 0.2))
        return (c.pos % 6, 0.3)

    model = StubModel(rule2)
    with pytest.warns(RuntimeWarning, match="round cap"):
            lopa_fast.generate(model, [0, 1], "lopa", max_new_tokens=4, block_size=4, branching_factor=2, max_rounds=2,
                           **KW)
    assert [c.tokens[0].tolist() for c in model.calls[1:4]] == [[2, 1, 7, 7], [2, 7, 1, 7], [2, 7, 7, 7]]


def test_lopa_branch_specific_growth_and_winner_carries_it():
    # tau_add=0.5: after round 1 the anchor's block 1 is 1/4 decoded (no growth), each lookahead 2/4 -> the
    # lookaheads append block 2 in their own grow step and forward 8 positions, the anchor 4
    def rule(c):
        if c.call == 0:
            return (c.pos % 6, {2: 0.95, 3: 0.6, 4: 0.5, 5: 0.4}.get(c.pos, 0.2))
        return (c.pos % 6, 0.95 if filled(c, 3) else 0.3)

    model = StubModel(rule)
    out = lopa_fast.generate(model, [0, 1], "lopa", max_new_tokens=8, block_size=4, branching_factor=2, **KW)
    assert [c.n for c in model.calls[1:4]] == [8, 8, 4]
    s = out.stats
    assert s["branch_growth"] == 1 and s["winner_grew"] == 1 and s["lookahead_wins"] == 1
    assert out.generated_ids == [2, 3, 4, 5, 0, 1, 2, 3] and s["forwards"] == 2


def test_lopa_commits_only_the_winners_span():
    # two blocks of 2, block 1 finished in round 1 -> round 2 commits it (u = 2) from the winner's window:
    # the cache grows by exactly the to-cache span once per round, never by k+1 spans
    model = StubModel(lambda c: (c.pos % 6, 0.95 if c.pos < 4 else 0.4))
    out = lopa_fast.generate(model, [0, 1], "lopa", max_new_tokens=4, block_size=2, branching_factor=2,
                             return_trace=True, **KW)
    assert out.stats["cache_length"] == 2 + sum(r["cached"] for r in out.trace[1:])
    assert out.stats["cache_length"] == 2 + 2 * out.stats["cached_blocks"]
    assert all(c.cache_len == c.start for c in model.calls)


# ---------------------------------------------------------------------------------------------------
# properties over sharpened random tiny models
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    return {
        "gqa": random_model(tiny_hf_config("dream", vocab_size=64), seed=1, sharpen=6.0),
        "mha": random_model(tiny_hf_config("dream", vocab_size=48, num_heads=2, num_kv_heads=2), seed=3,
                            sharpen=8.0, zero_mask_row=False),
    }


def check_invariants(out, P, block_size, max_new, mask_id):
    ids, s = out.generated_ids, out.stats
    assert len(ids) % block_size == 0 and 0 < len(ids) <= max_new
    assert s["generated_tokens"] == len(ids) and s["tpf"] == pytest.approx(len(ids) / s["forwards"])
    assert s["upstream_steps"] == s["forwards"] + 1 and s["model_calls"] >= s["forwards"]
    assert s["cache_length"] == P + block_size * s["cached_blocks"]
    if out.trace is not None:
        assert s["cache_length"] == P + sum(r["cached"] for r in out.trace[1:])
        seen = {}
        for r in out.trace:
            for q, t in r["accepted"]:
                assert q not in seen, f"position {q} filled twice"
                seen[q] = t
        for q, t in seen.items():
            if t != mask_id:
                assert ids[q] == t
        if not s["hit_round_cap"] and mask_id not in ids:
            assert sorted(seen) == list(range(len(ids)))


def test_lopa_properties_and_coverage(models):
    cov = dict(threshold=0, multi=0, wins=0, growth=0, eos_stop=0, runs=0)
    # a fixed subset of models x branching x strategy x attention x prompt (2 x 3 x 3 x 2 x 2), ~2 s of CPU
    strategies = itertools.cycle(["default", "margin", "neg_entropy"])
    prompts = itertools.cycle([[5, 9, 2], list(range(3, 20)), [7]])
    for i, (name, bf, full) in enumerate(itertools.product(["gqa", "mha"], [1, 2, 4], [True, False])):
        m, strat = models[name], next(strategies)
        for prompt in [next(prompts)]:
            out = lopa_fast.generate(
                m, prompt, "lopa", "reference", max_new_tokens=24, block_size=8, branching_factor=bf, sampling_strategy=strat,
                use_full_attention=full, block_add_threshold=0.25, decoded_token_threshold=0.9, skip_threshold=0.8,
                eos_token_id=5, return_trace=True,
            )
            check_invariants(out, len(prompt), 8, 24, m.mask_token_id)
            s = out.stats
            cov["runs"] += 1
            cov["threshold"] += s["accepted_by_threshold"] > 0
            cov["multi"] += s["multi_token_rounds"] > 0
            cov["wins"] += s["lookahead_wins"] > 0
            cov["growth"] += s["branch_growth"] > 0
            cov["eos_stop"] += s["eos_detected"] and len(out.generated_ids) < 24
            if bf == 1:
                assert s["lookahead_wins"] == 0 and s["model_calls"] == s["forwards"]
    assert all(v > 0 for v in cov.values()), cov


def test_lopa_branching_factor_1_is_d2f(models):
    m = models["gqa"]
    for full, strat in itertools.product([True, False], ["default", "neg_entropy"]):
        kw = dict(max_new_tokens=24, block_size=8, sampling_strategy=strat, use_full_attention=full,
                  block_add_threshold=0.25, skip_threshold=0.8, eos_token_id=5)
        a = lopa_fast.generate(m, [4, 8, 15, 16], "d2f", "reference", **kw)
        b = lopa_fast.generate(m, [4, 8, 15, 16], "lopa", "reference", branching_factor=1, **kw)
        assert a.generated_ids == b.generated_ids and a.stats["forwards"] == b.stats["forwards"]


def test_full_vs_block_causal_differ_and_prompt_kv_sees_block_one(models):
    # under full attention the cached prompt K/V was computed while attending to block 1's masks, so it
    # differs from an isolated prompt prefill; block-causal isolates the prompt
    m = models["gqa"]
    prompt = torch.tensor([[4, 8, 15, 16]])
    masks = torch.full((1, 8), m.mask_token_id)
    c_full, c_iso = m.new_cache(16), m.new_cache(16)
    m.forward_window(torch.cat([prompt, masks], 1), cache=c_full, mask="full", commit=4)
    m.forward_window(prompt, cache=c_iso, mask="full", commit=4)
    assert not torch.allclose(c_full.k[:, :4], c_iso.k[:, :4])
    c_bc = m.new_cache(16)
    bids = torch.tensor([[0] * 4 + [1] * 8])
    m.forward_window(torch.cat([prompt, masks], 1), cache=c_bc, mask="block_causal", block_ids=bids, commit=4)
    torch.testing.assert_close(c_bc.k[:, :4], c_iso.k[:, :4])


def test_sampling_is_seeded_and_other_families_and_dtypes_run():
    m = random_model(tiny_hf_config("dream"), seed=0, sharpen=3.0)
    kw = dict(max_new_tokens=16, block_size=8, temperature=0.8, top_p=0.9, top_k=10, branching_factor=2)
    a = lopa_fast.generate(m, [1, 2, 3], "lopa", "reference", seed=1, **kw)
    b = lopa_fast.generate(m, [1, 2, 3], "lopa", "reference", seed=1, **kw)
    assert a.generated_ids == b.generated_ids and m.mask_token_id not in a.generated_ids
    # LLaDA (unshifted logits) and bf16 Dream run the same loops
    llada = random_model(tiny_hf_config("llada"), seed=0, sharpen=4.0)
    bf16 = random_model(tiny_hf_config("dream"), seed=0, sharpen=6.0, dtype=torch.bfloat16)
    for model in (llada, bf16):
        for strategy in ("d2f", "lopa"):
            out = lopa_fast.generate(model, [1, 2, 3], strategy, max_new_tokens=16, block_size=8, eos_token_id=5)
            assert len(out.generated_ids) in (8, 16) and model.mask_token_id not in out.generated_ids
