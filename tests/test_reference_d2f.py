"""Hand-worked cases for the reference D2F state machine (grow, activation, stale last_logit, to_cache,
fallback, EOS) on a stub model whose predictions are a table, and the fill rule per confidence strategy."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_reference_common import StubModel

import lopa_fast
from lopa_fast.strategies.lopa.reference_d2f import anchor_fill, new_block

KW = dict(block_add_threshold=0.5, decoded_token_threshold=0.75, skip_threshold=0.9, sampling_strategy="default")


def table_rule(table, default=0.2):
    """(call, pos) -> (token, prob); token defaults to pos % 6 (never EOS=6 or MASK=7)."""

    def rule(c):
        v = table.get((c.call, c.pos))
        if v is None:
            return (c.pos % 6, default)
        return v if isinstance(v, tuple) else (c.pos % 6, v)

    return rule


def test_d2f_state_machine_hand_worked():
    # P=2, block 4, two blocks. Round by round (see comments); probabilities per (forward, position).
    table = {
        # forward 0: window [0, 6) commits the prompt (u=2); pos 2 is NOT accepted (0.5)
        (0, 2): 0.5, (0, 3): 0.95, (0, 4): 0.95, (0, 5): 0.3,
        # forward 1: window [2, 10); pos 2 would be 0.99 here, but its prediction is the STALE row saved by
        # forward 0 (0.5, token 2): no threshold accept -> fallback picks pos 5 (0.6); block 2 is not yet
        # fully activated (block 1 at 50% < 75%) so only its threshold accept (pos 7) lands
        (1, 2): (5, 0.99), (1, 5): 0.6, (1, 7): (1, 0.95),
        # forward 2: block 1 at 75% activates block 2; fallback fills pos 2 (stale 0.5); pos 6 and the EOS
        # at pos 9 pass the threshold
        (2, 6): (0, 0.97), (2, 8): (3, 0.3), (2, 9): (6, 0.92),
        # forward 3: block 1 is to_cache -> committed (u=4); block 2's last mask by fallback
        (3, 8): (3, 0.4),
    }
    model = StubModel(table_rule(table))
    out = lopa_fast.generate(model, [0, 1], "d2f", max_new_tokens=8, block_size=4, return_trace=True, **KW)
    assert out.generated_ids == [2, 3, 4, 5, 0, 1, 3, 6]
    assert [(c.start, c.n, c.cache_len) for c in model.calls] == [(0, 6, 0), (2, 8, 2), (2, 8, 2), (2, 8, 2)]
    s = out.stats
    assert s["forwards"] == 4 and s["upstream_steps"] == 5 and s["model_calls"] == 4
    assert s["fallback_fills"] == 3 and s["accepted_by_threshold"] == 5
    assert s["eos_detected"] and s["tokens_until_eos"] == 8 and s["tpf"] == 2.0
    assert s["cache_length"] == 6 and s["cached_blocks"] == 1  # prompt + block 1; block 2 never cached
    assert [r["cached"] for r in out.trace] == [2, 0, 0, 4]
    assert [r["accepted"] for r in out.trace] == [[[1, 3], [2, 4]], [[3, 5], [5, 1]], [[0, 2], [4, 0], [7, 6]],
                                                  [[6, 3]]]


def test_d2f_eos_stops_growth():
    # EOS in the first block: no further block is appended, the first block finishes by fallback
    model = StubModel(table_rule({(0, 2): (6, 0.95), (1, 3): 0.3, (2, 4): 0.3, (3, 5): 0.3}))
    out = lopa_fast.generate(model, [0, 1], "d2f", max_new_tokens=12, block_size=4, **KW)
    assert out.generated_ids == [6, 3, 4, 5]
    assert out.stats["forwards"] == 4 and out.stats["tokens_until_eos"] == 1 and out.stats["eos_detected"]


def test_d2f_grow_waits_for_block_add_threshold():
    # tau_add=0.5: block 2 is appended only in the round after block 1 reached 2/4 decoded
    table = {(0, 2): 0.95, (1, 3): 0.95}
    model = StubModel(table_rule(table, default=0.1))
    lopa_fast.generate(model, [0, 1], "d2f", max_new_tokens=8, block_size=4, **KW)
    lens = [c.n + c.start for c in model.calls]  # window end = sequence length at that round
    assert lens[:3] == [6, 6, 10]


def test_d2f_block_causal_passes_block_ids():
    model = StubModel(table_rule({}, default=0.95))
    out = lopa_fast.generate(model, [0, 1], "d2f", max_new_tokens=4, block_size=4, use_full_attention=False, **KW)
    assert out.generated_ids == [2, 3, 4, 5] and model.calls[0].mask == "block_causal"


def _fill_cfg(strategy, **kw):
    base = dict(mask_token_id=7, eos_token_id=6, skip_threshold=0.9, sampling_strategy=strategy, temperature=0.0,
                top_p=None, top_k=None, suppress_mask_token=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _row(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


# position A: p = [.5, .45, .05 spread] (high p_max, tiny margin, low entropy)
# position B: p = [.4, .6/7 each]        (lower p_max, big margin, high entropy)
ROW_A = [0.5, 0.45] + [0.05 / 6] * 6
ROW_B = [0.4] + [0.6 / 7] * 7


@pytest.mark.parametrize("strategy,want", [("default", 2), ("margin", 3), ("neg_entropy", 2)])
def test_fill_rule_fallback_per_confidence(strategy, want):
    x = torch.tensor([0, 1, 7, 7])
    blocks = [new_block(0, 2, prompt=True), new_block(2, 2)]
    blocks[1]["is_complete"] = True
    logits = torch.stack([_row([1 / 8] * 8), _row([1 / 8] * 8), _row(ROW_A), _row(ROW_B)])
    counters = {"accepted_by_threshold": 0, "fallback_fills": 0, "eos_fills": 0}
    fills, eos = anchor_fill(x, blocks, logits, 0, 0, _fill_cfg(strategy), counters)
    assert list(fills) == [want] and counters["fallback_fills"] == 1 and not eos
    # sanity of the hand computation: entropies
    ha = -sum(p * math.log(p) for p in ROW_A)
    hb = -sum(p * math.log(p) for p in ROW_B)
    assert ha < hb


def test_fill_rule_threshold_is_strict_and_incomplete_block_has_no_fallback():
    x = torch.tensor([0, 7, 7, 7])
    blocks = [new_block(0, 1, prompt=True), new_block(1, 3)]  # not fully activated
    p9 = [0.9] + [0.1 / 7] * 7
    logits = torch.stack([_row([1 / 8] * 8), _row(p9), _row(p9), _row([0.2] + [0.8 / 7] * 7)])
    counters = {"accepted_by_threshold": 0, "fallback_fills": 0, "eos_fills": 0}
    cfg = _fill_cfg("default", skip_threshold=float(torch.softmax(_row(p9), -1).max()))
    fills, _ = anchor_fill(x, blocks, logits, 0, 0, cfg, counters)
    assert fills == {} and counters["fallback_fills"] == 0  # p == tau is not accepted (strict >)
    fills, _ = anchor_fill(x, blocks, logits, 0, 0, _fill_cfg("default", skip_threshold=0.85), counters)
    assert fills == {1: 0, 2: 0} and x.tolist() == [0, 0, 0, 7]


def test_round_cap_warns_or_raises_and_mask_suppression_finishes():
    # the model predicts the MASK id with p=0.95 everywhere: upstream would loop forever
    model = StubModel(lambda c: (7, 0.95))
    with pytest.warns(RuntimeWarning, match="round cap"):
        out = lopa_fast.generate(model, [0, 1], "d2f", max_new_tokens=4, block_size=4, max_rounds=5, **KW)
    assert out.stats["hit_round_cap"] and out.stats["forwards"] == 5 and out.stats["masks_left"] == 4
    with pytest.raises(lopa_fast.RoundCapError):
        lopa_fast.generate(model, [0, 1], "d2f", max_new_tokens=4, block_size=4, max_rounds=3, on_round_cap="error",
                           **KW)
    out = lopa_fast.generate(model, [0, 1], "d2f", max_new_tokens=4, block_size=4, suppress_mask_token=True, **KW)
    assert not out.stats["hit_round_cap"] and 7 not in out.generated_ids
