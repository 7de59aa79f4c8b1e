"""Vanilla decoding: LLaDA transfer schedule / low-confidence remasking / CFG / EOS flags and Dream's
samplers (timestep schedule, orderings), hand-worked on the stub model plus runs on tiny random models."""
from __future__ import annotations

import pytest
import torch
from test_reference_common import StubModel

import lopa_fast
from lopa_fast.strategies.vanilla.reference import transfer_schedule
from lopa_fast.testing import random_model, tiny_hf_config

MASK, EOS = 7, 6


def masks_per_call(model):
    return [int((c.tokens[0] == MASK).sum()) for c in model.calls]


def test_transfer_schedule():
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert transfer_schedule(3, 5) == [1, 1, 1, 0, 0]
    assert transfer_schedule(8, 8) == [1] * 8


def test_llada_low_confidence_order_within_blocks():
    # gen 4 in two blocks of 2, 2 steps per block (1 token each). Confidence by position: pos 3 > pos 2,
    # pos 4 > pos 5; block 2 positions are never chosen while block 1 runs even though they are higher
    probs = {2: 0.5, 3: 0.8, 4: 0.99, 5: 0.6}
    model = StubModel(lambda c: (c.pos % 6, probs.get(c.pos, 0.3)), shift=False)
    out = lopa_fast.generate(model, [0, 1], "vanilla", max_new_tokens=4, steps=4, block_length=2)
    assert out.generated_ids == [2, 3, 4, 5] and out.stats["forwards"] == 4
    rows = [c.tokens[0].tolist() for c in model.calls]
    assert rows == [[0, 1, 7, 7, 7, 7], [0, 1, 7, 3, 7, 7], [0, 1, 2, 3, 7, 7], [0, 1, 2, 3, 4, 7]]
    assert out.stats["upstream_steps"] == 4


def test_llada_cfg_batches_an_unconditional_copy():
    model = StubModel(lambda c: (c.pos % 6, 0.9), shift=False)
    lopa_fast.generate(model, [0, 1], "vanilla", max_new_tokens=2, steps=2, cfg_scale=1.5)
    t = model.calls[0].tokens
    assert t.shape == (2, 4) and t[0].tolist() == [0, 1, 7, 7] and t[1].tolist() == [7, 7, 7, 7]


def test_llada_eos_flags():
    # EOS is the argmax at pos 2 and 3 (p 0.9); without flags EOS is emitted there first
    rule = lambda c: (EOS, 0.9) if c.pos in (2, 3) else (c.pos % 6, 0.5)  # noqa: E731
    out = lopa_fast.generate(StubModel(rule, shift=False), [0, 1], "vanilla", max_new_tokens=4, steps=4)
    assert out.generated_ids[:2] == [EOS, EOS]
    out = lopa_fast.generate(StubModel(rule, shift=False), [0, 1], "vanilla", max_new_tokens=4, steps=4,
                             logits_eos_inf=True)
    assert EOS not in out.generated_ids
    # confidence_eos_eot_inf: EOS positions are chosen last (their confidence is -inf), still emitted
    model = StubModel(rule, shift=False)
    out = lopa_fast.generate(model, [0, 1], "vanilla", max_new_tokens=4, steps=4, confidence_eos_eot_inf=True)
    assert [c.tokens[0].tolist()[2:4] for c in model.calls][:3] == [[7, 7]] * 3
    assert out.generated_ids[:2] == [EOS, EOS]


def test_llada_random_remasking_is_seeded():
    model = StubModel(lambda c: (c.pos % 6, 0.5), shift=False)
    a = lopa_fast.generate(model, [0, 1], "vanilla", max_new_tokens=8, steps=8, remasking="random", seed=3)
    order_a = [c.tokens[0].tolist() for c in model.calls]
    model.calls.clear()
    lopa_fast.generate(model, [0, 1], "vanilla", max_new_tokens=8, steps=8, remasking="random", seed=3)
    assert [c.tokens[0].tolist() for c in model.calls] == order_a and MASK not in a.generated_ids


def test_dream_timestep_schedule_steps_equal_length():
    # steps = max_new_tokens = 4: float32 int(4 * (1 - s/t)) transfers 0, 1, 1, 2 (spec section 6 item 6)
    model = StubModel(lambda c: (c.pos % 6, 0.5 + 0.01 * c.pos))
    out = lopa_fast.generate(model, [0, 1], "vanilla", max_new_tokens=4, steps=4, alg="maskgit_plus")
    assert masks_per_call(model) == [4, 4, 3, 2]
    assert out.generated_ids == [2, 3, 4, 5] and out.stats["transferred"] == 4
    # the highest-confidence position first (pos 5: 0.55): it is filled at step 1
    assert model.calls[2].tokens[0].tolist()[-1] == 5


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_dream_algs_on_tiny_model(alg):
    m = random_model(tiny_hf_config("dream"), seed=2, sharpen=4.0)
    kw = dict(max_new_tokens=16, steps=8, alg=alg, seed=1)
    a = lopa_fast.generate(m, [3, 4, 5], "vanilla", **kw)
    b = lopa_fast.generate(m, [3, 4, 5], "vanilla", **kw)
    assert a.generated_ids == b.generated_ids and len(a.generated_ids) == 16
    assert m.mask_token_id not in a.generated_ids and a.stats["forwards"] == 8
    c = lopa_fast.generate(m, [3, 4, 5], "vanilla", max_new_tokens=16, steps=8, alg=alg, alg_temp=0.5, seed=1)
    assert m.mask_token_id not in c.generated_ids


def test_llada_tiny_model_semi_ar():
    m = random_model(tiny_hf_config("llada"), seed=2, sharpen=4.0)
    out = lopa_fast.generate(m, [3, 4, 5], "vanilla", max_new_tokens=16, steps=8, block_length=8)
    assert len(out.generated_ids) == 16 and m.mask_token_id not in out.generated_ids
    assert out.stats["forwards"] == 8 and out.stats["tpf"] == 2.0
    t = lopa_fast.generate(m, [3, 4, 5], "vanilla", max_new_tokens=16, steps=8, block_length=8, temperature=0.7,
                           seed=0)
    assert len(t.generated_ids) == 16 and torch.is_tensor(torch.tensor(t.generated_ids))
