"""The fused LM head in the D2F / LoPA rounds (`ops.head_confidence`, strategies/lopa/driver.fused_head_wanted): on CPU it is
opt-in ($LOPA_FAST_FUSED_HEAD=1); with it on, the fast decoder stays token- and forward-equal to the reference
decoders on the tiny-model parity grid (solo, batched, graph-workspace emulation), the numerics guard still
names the round and position of a non-finite row, and the knobs that need whole rows (T > 0, top-p / top-k,
distributed) keep the unfused path."""
from __future__ import annotations

import warnings

import pytest
import torch

import lopa_fast
from lopa_fast import ops
from lopa_fast.config import GenerateConfig
from lopa_fast.strategies.lopa.driver import FUSED_HEAD_ENV, fused_head_wanted
from lopa_fast.testing import random_model, tiny_hf_config
from tests import test_fast_parity as parity
from tests.utils import emulated_capture

N_GRID = 30  # fusable cases of the parity grid's CI subset run here (all of the full product under -m slow)



@pytest.fixture
def fused(monkeypatch):
    """$LOPA_FAST_FUSED_HEAD=1 and a count of the fused head's calls (a test that never ran it fails)."""
    monkeypatch.setenv(FUSED_HEAD_ENV, "1")
    calls = []
    real = ops.head_confidence
    monkeypatch.setattr(ops, "head_confidence", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    return calls


def _fusable(case):
    return case["top_p"] is None and case["top_k"] is None


def test_fused_head_parity_grid(fused):
    """Token-, forward- and counter-equal to the reference on the first N_GRID fusable cases (no top-p / top-k) of
    the parity grid's CI subset (every k, sampling strategy and model), with its coverage counters."""
    cases = [c for c in parity.ci_subset() if _fusable(c)][:N_GRID]
    for axis, values in (("branching_factor", parity.KS), ("sampling_strategy", parity.SAMPLING),
                         ("model", parity.MODELS)):  # fmt: skip
        assert {c[axis] for c in cases} == set(values), axis
    cov = parity.check_cases(cases)
    assert fused, "the fused head never ran"
    for key in ("accepted_by_threshold", "fallback_fills", "multi_token_rounds", "lookahead_wins"):
        assert cov[key] > 0, (key, cov)


@pytest.mark.slow
def test_fused_head_parity_grid_full(fused):
    cov = parity.check_cases([c for c in parity.full_product() if _fusable(c)])
    parity.assert_coverage({k: v for k, v in cov.items() if k != "round_caps"})


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 60, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("k,full", [(1, False), (4, True)])
def test_fused_head_batched_equals_reference(model, fused, k, full):
    """One forward for several requests (`forward_requests` with output="hidden" parts), each request equal to
    the reference decoder run alone."""
    ps = _prompts((3, 17, 9), seed=k)
    kw = dict(branching_factor=k, use_full_attention=full, block_size=4, max_new_tokens=16, eos_token_id=5,
              skip_threshold=0.9, sampling_strategy="margin")  # fmt: skip
    outs = lopa_fast.generate(model, ps, "lopa", "fast", **kw)
    for o, p in zip(outs, ps):
        ref = lopa_fast.generate(model, p, "lopa", "reference", **kw)
        assert o.generated_ids == ref.generated_ids and o.stats["forwards"] == ref.stats["forwards"]
    assert fused


def test_forward_requests_mixes_hidden_and_logits_parts(model):
    """A batch whose parts ask for different outputs: logits rows equal the all-logits call's, hidden rows the
    rows the head would read (head(hidden) == those logits)."""
    from lopa_fast.strategies.lopa.driver import FastDecoder

    cfg = GenerateConfig(strategy="lopa", branching_factor=2, block_size=4, max_new_tokens=8).bind(model)
    parts = []
    for p in _prompts((5, 9), seed=3):
        dec = FastDecoder(model, p, cfg, 2, "lopa")
        dec.begin()
        parts.append(dec.forward_args(dec.prepare(*dec.next_bucket())))
    both = model.forward_requests(parts, dec.mode)
    mixed = model.forward_requests([dict(parts[0], output="hidden"), parts[1]], dec.mode)
    assert mixed[0][0].shape[1] == model.config.hidden_size
    assert torch.equal(mixed[1][0], both[1][0])
    torch.testing.assert_close(torch.nn.functional.linear(mixed[0][0], model.head_weight()), both[0][0])


def test_fused_head_graph_workspace_emulated(monkeypatch, fused):
    """The captured-round path (workspace, replays) with the fused head, capture emulated on CPU."""
    from lopa_fast.decode.compiled import CompiledRounds

    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=1, sharpen=6)
    cr = CompiledRounds.for_model(model)
    cr.emulate_graphs = True
    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    kw = dict(block_size=8, max_new_tokens=16, skip_threshold=0.8, branching_factor=2, sampling_strategy="neg_entropy")
    for p in _prompts((9, 9), seed=9):
        ref = lopa_fast.generate(model, p, "lopa", "reference", **kw)
        got = lopa_fast.generate(model, p, "lopa", "fast", compile=True, **kw)
        assert got.generated_ids == ref.generated_ids and got.stats["forwards"] == ref.stats["forwards"]
    assert fused


@pytest.mark.parametrize("strategy,kw", [("d2f", {}), ("lopa", dict(branching_factor=2))])
def test_fused_head_guard_names_the_row(fused, strategy, kw):
    """A NaN hidden state (every row) and one inf head row: NonFiniteLogitsError from the fused round, as unfused."""
    m = random_model(tiny_hf_config("dream"), seed=1, sharpen=4.0)
    with torch.no_grad():
        m.final_norm_weight().fill_(float("nan"))
    with pytest.raises(lopa_fast.NonFiniteLogitsError) as ei:
        lopa_fast.generate(m, [3, 4, 5], strategy, "fast", max_new_tokens=8, block_size=4, **kw)
    assert ei.value.strategy == strategy and ei.value.round == 1 and ei.value.position >= 3
    m = random_model(tiny_hf_config("dream"), seed=1, sharpen=4.0)
    with torch.no_grad():
        m.head_weight()[7].fill_(float("inf"))
    with pytest.raises(lopa_fast.NonFiniteLogitsError):
        lopa_fast.generate(m, [3, 4, 5], strategy, "fast", max_new_tokens=8, block_size=4, **kw)
    assert fused


def test_fused_head_wanted_rules(monkeypatch):
    cfg = GenerateConfig(strategy="lopa", branching_factor=2)
    monkeypatch.delenv(FUSED_HEAD_ENV, raising=False)
    assert not fused_head_wanted(cfg, "cpu") and fused_head_wanted(cfg, "cuda")  # auto: CUDA only
    monkeypatch.setenv(FUSED_HEAD_ENV, "1")
    assert fused_head_wanted(cfg, "cpu")
    for other in (dict(temperature=0.5), dict(top_p=0.9, temperature=0.5), dict(top_k=5, temperature=0.5),
                  dict(distributed=True)):  # fmt: skip
        assert not fused_head_wanted(cfg.replace(**other), "cuda"), other
    monkeypatch.setenv(FUSED_HEAD_ENV, "0")
    assert not fused_head_wanted(cfg, "cuda")
    monkeypatch.setenv(FUSED_HEAD_ENV, "yes")
    with pytest.raises(ValueError, match=FUSED_HEAD_ENV):
        fused_head_wanted(cfg, "cpu")


def test_default_cpu_path_is_unfused(model, monkeypatch):
    """Unset on CPU: the round never calls the fused op (the CPU fast path stays bitwise the reference's)."""
    monkeypatch.delenv(FUSED_HEAD_ENV, raising=False)
    monkeypatch.setattr(ops, "head_confidence", lambda *a, **k: pytest.fail("fused head on the default CPU path"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lopa_fast.generate(model, [3, 4, 5], "lopa", "fast", branching_factor=2, block_size=4, max_new_tokens=8)
