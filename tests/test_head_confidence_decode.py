"""The fused LM head in the D2F / LoPA rounds, the vanilla / threshold steps and APD (`ops.head_confidence`,
decode/fused_head.fused_head_wanted): on CPU it is opt-in ($LOPA_FAST_FUSED_HEAD=1); with it on, the fast decoder
stays token- and forward-equal to the reference decoders on the tiny-model parity grids (solo, batched,
graph-workspace emulation), the numerics guard still names the round and position of a non-finite row, and the knobs
that need whole rows (T > 0, top-p / top-k, distributed) keep the unfused path."""
from __future__ import annotations

import warnings

import pytest
import torch

import lopa_fast
from lopa_fast import ops
from lopa_fast.decode.fused_head import FUSED_HEAD_ENV
from lopa_fast.testing import random_model, tiny_hf_config
from tests import test_fast_parity as parity

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
                         ("model", parity.MODELS)):
        assert {c[axis] for c in cases} == set(values), axis
    cov = parity.check_cases(cases)
    assert fused, "the fused head never ran"
    for key in ("accepted_by_threshold", "fallback_fills", "multi_token_rounds", "lookahead_wins"):
        assert cov[key] > 0, (key, cov)


# The fused head's exactness policy. `ops.head_confidence` computes the statistics in one online pass over
# vocabulary chunks: token = the first arg-max of the logits, p_max = exp(max - lse), lse merged chunk by chunk; the
# unfused path (and the reference decoders) take torch.softmax's exp(x - max) / sum and the arg-max of those
# probabilities. The two round differently by about one float32 ulp (two logits closer than that give equal
# probabilities: a tie the unfused path breaks by index, the fused one by the logits), and the fused round
# recomputes the next last_logit row alone (a [1, H] x [H, V] GEMV, whose sums are not the batched GEMM's). This
# holds on every backend (torch chunks, Triton, CUDA): no fused head is bitwise the unfused statistics, and none can
# be without materialising the [R, V] probabilities it exists to avoid. Hence: on CPU the fused head is off unless
# asked for ($LOPA_FAST_FUSED_HEAD=1), and the unfused CPU path is the one that is bitwise the reference
# (tests/test_fast_parity.py, every case). With the fused head, the full grid allows near-tie flips on at most
# 1 % of the cases (measured: 2 of 852, both LoPA k = 1 on gqa64, where the reference's top two confidences sit
# within a float32 ulp); the CI subset above has none.
NEAR_TIE_SHARE = 0.01


def assert_near_ties_only(fused, cases: list, run_pair, counter: str) -> None:
    """The policy's bound over `cases`: run_pair(case) -> (reference output, fast output); a case differs when its
    tokens or its stats[counter] differ; at most NEAR_TIE_SHARE of them may; the fused head must have run."""
    differ = []
    for case in cases:
        ref, fast = run_pair(case)
        if ref.generated_ids != fast.generated_ids or ref.stats[counter] != fast.stats[counter]:
            differ.append(case)
    assert fused, "the fused head never ran"
    assert len(differ) <= NEAR_TIE_SHARE * len(cases), f"{len(differ)}/{len(cases)} cases differ; first: {differ[0]}"


@pytest.mark.slow
def test_fused_head_parity_grid_full(fused):
    """Every fusable case of the full product: tokens and forwards equal to the reference, but for near-tie flips
    (the policy above) on at most NEAR_TIE_SHARE of the cases; the coverage counters as the parity grid's."""
    cases = [c for c in parity.full_product() if _fusable(c)]
    models = parity.build_models()
    eos_ids = {id(m): parity.frequent_token(m) for m in models.values()}
    assert_near_ties_only(fused, cases, lambda case: parity.run_case(models, eos_ids, case)[:2], "forwards")


# ---- the fused head in the vanilla and threshold steps (decode/steps.step_fused_head) -----------------------------
def _fusable_step(case) -> bool:
    kw = case["kw"]
    if not case["model"].startswith("dream") or kw.get("temperature", 0) > 0 or kw.get("top_p") is not None \
            or kw.get("top_k") is not None:
        return False
    if case["strategy"] == "vanilla":
        return not kw.get("alg_temp")
    return "threshold" in kw or "factor" in kw


def _step_cases(full: bool) -> list:
    from tests import test_fast_steps as fs

    cases = [c for c in fs.ALL_CASES if _fusable_step(c)]
    return cases if full else cases[::4]


def test_fused_head_vanilla_and_threshold_steps(fused):
    """Dream vanilla (every alg but the alg_temp race) and Dream threshold (threshold / factor rule, every cache mode:
    none, prefix, dual) at T = 0 with the fused head: token-, forward- and counter-equal to the reference on every 4th
    fusable case of the step grid (all of them under -m slow)."""
    from tests import test_fast_steps as fs

    cases = _step_cases(full=False)
    assert {c["strategy"] for c in cases} == {"vanilla", "threshold"}
    assert {c["kw"].get("alg") for c in cases if c["strategy"] == "vanilla"} >= {"origin", "maskgit_plus",
                                                                                  "topk_margin", "entropy"}
    assert {c["kw"].get("cache") for c in cases if c["strategy"] == "threshold"} == {None, "prefix", "dual"}
    models = fs.step_models()
    for case in cases:
        fs.check(*fs.run_pair(models, case), case)
    assert fused, "the fused head never ran"


@pytest.mark.slow
def test_fused_head_vanilla_and_threshold_steps_full(fused):
    """Every fusable case of the step grid: equal to the reference but for near-tie flips (the policy above) on at
    most NEAR_TIE_SHARE of the cases."""
    from tests import test_fast_steps as fs

    cases = _step_cases(full=True)
    models = fs.step_models()
    assert_near_ties_only(fused, cases, lambda case: fs.run_pair(models, case), "forwards")


@pytest.mark.parametrize("kind,kw,want", [
    ("dream", dict(strategy="threshold", threshold=0.9, block_length=4), True),
    ("dream", dict(strategy="threshold", factor=1.0, block_length=4, cache="prefix"), True),
    ("dream", dict(strategy="vanilla", steps=8, alg="entropy"), True),
    ("dream", dict(strategy="threshold", entropy_threshold=0.3, block_length=4), False),  # reads float64 entropy
    ("dream", dict(strategy="threshold", threshold=0.9, block_length=4, cache="dual"), True),  # forward_dual too
    ("dream", dict(strategy="vanilla", steps=8, alg="maskgit_plus", alg_temp=0.5), False),  # the race's keyed draw
    ("dream", dict(strategy="threshold", threshold=0.9, block_length=4, temperature=0.7), False),  # T > 0
    ("llada", dict(strategy="threshold", threshold=0.9, block_length=4), False),  # LLaDA's float64 statistics
    ("llada", dict(strategy="vanilla", steps=8, block_length=8), False),
])
def test_which_steps_take_the_fused_head(fused, kind, kw, want):
    """The steps whose statistics are what ops.head_confidence gives take it (with $LOPA_FAST_FUSED_HEAD=1); the
    others keep the logits (and run: the unfused path), with the reference's tokens either way."""
    model = random_model(tiny_hf_config(kind, vocab_size=64), seed=2, sharpen=4.0)
    strategy = kw.pop("strategy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = lopa_fast.generate(model, [3, 4, 5], strategy, "fast", max_new_tokens=8, seed=0, **kw)
        ref = lopa_fast.generate(model, [3, 4, 5], strategy, "reference", max_new_tokens=8, seed=0, **kw)
    assert bool(fused) is want
    assert fast.generated_ids == ref.generated_ids


@pytest.mark.parametrize("strategy,kw", [("threshold", dict(threshold=0.9, block_length=4)),
                                         ("vanilla", dict(steps=8, alg="maskgit_plus"))])
def test_the_fused_step_still_names_a_nonfinite_row(fused, strategy, kw):
    """NaN hidden rows under the fused head: the step's guard refuses them, naming the strategy, the step and the
    position, with the row's value (recomputed from the hidden row and the head)."""
    from lopa_fast.errors import NonFiniteLogitsError

    model = random_model(tiny_hf_config("dream", vocab_size=64), seed=1, sharpen=4.0)
    with torch.no_grad():
        model.final_norm_weight().fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError, match=strategy) as ei:
        lopa_fast.generate(model, [3, 4, 5], strategy, "fast", max_new_tokens=8, **kw)
    assert ei.value.round == 1 and ei.value.position >= 3 and ei.value.value != ei.value.value  # NaN
    assert fused, "the fused head never ran"


# ---- the fused head in APD (strategies/apd/step.py: both forwards end in ops.head_confidence at T = 0) --------------
def _fusable_apd(c) -> bool:
    return c.get("top_p") is None and c.get("top_k") is None


@pytest.fixture(scope="module")
def apd_models():
    from tests.utils import apd_models as build

    return build()


def test_fused_head_apd_ci_cases(fused, apd_models):
    """APD (verifier and leftright) with the fused head: the draft is the head's arg-max (the mask suppressed), the
    mixture reads the raw logits the head kept, the guard its finite flags; token-, step- and counter-equal to the
    reference on every fusable CI case of tests/test_fast_apd.py, the head run twice a step with a verifier (the
    drafter's rows, then the verifier's) and once without."""
    from tests import test_fast_apd as ta

    cases = [c for c in ta.CI_CASES if _fusable_apd(c)]
    assert any(c["R"] is None for c in cases) and any(c.get("suppress_mask_token") for c in cases)
    for c in cases:
        before = len(fused)
        ref, fast = ta.run_both(apd_models, c)
        ta.assert_parity(ref, fast, c)
        steps = fast.stats["forwards"]
        assert len(fused) - before == steps * (2 if c["R"] is not None else 1), c


@pytest.mark.slow
def test_fused_head_apd_full_grid(fused, apd_models):
    """Every case of the APD grid (tests/test_fast_apd.slow_grid) with the fused head: equal to the reference but
    for near-tie flips (the policy above) on at most NEAR_TIE_SHARE of the cases."""
    from tests import test_fast_apd as ta

    assert_near_ties_only(fused, ta.slow_grid(), lambda c: ta.run_both(apd_models, c), "acceptance_counts")


@pytest.mark.parametrize("kw,want", [
    (dict(), True),
    (dict(top_k=5), False),  # the draft's filters read whole rows
    (dict(temperature=0.7, sampler="keyed"), False),  # the keyed draw reads whole rows
])
def test_which_apd_steps_take_the_fused_head(fused, apd_models, kw, want):
    """APD takes the fused head at T = 0 without filters; the knobs that need whole rows keep the logits; the
    reference's tokens either way."""
    from tests import test_fast_apd as ta

    c = ta.case(R=0.7, W=2, M=4, P=3, eos="never", n=12, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, fast = ta.run_both(apd_models, c)
    ta.assert_parity(ref, fast, c)
    assert bool(fused) is want


def test_fused_apd_still_names_a_nonfinite_row(fused, apd_models):
    """NaN / inf in the drafter's or the verifier's head under the fused head: refused at the reference's step and
    position, naming the model (tests/test_fast_apd.py's guard test, with the fused head on)."""
    from tests import test_fast_apd as ta

    ta.test_nonfinite_logits_are_refused(apd_models)
    assert fused, "the fused head never ran"


def test_fused_apd_captured_step_on_cpu(fused, apd_models, monkeypatch):
    """The CUDA-graph path of the APD step with the capture emulated on CPU (tests/test_fast_apd.py's workspace test)
    with the fused head: token-exact, traces included; the fused head ran inside the step."""
    from tests import test_fast_apd as ta

    ta.test_captured_step_workspace_logic_on_cpu(apd_models, monkeypatch)
    assert fused, "the fused head never ran"
