"""The one loop (issue 34): every fast request of every built-in strategy, solo or batched, eager or compile=True,
runs through `lopa_fast.decode.batch.Scheduler.step` (a solo request is a batch of one; a compiled step is the
compiled batch step of its batch bucket, lopa_fast.decode.compiled_batch), and no driver carries a loop of its own.
compile=True takes the CUDA-graph path with the capture emulated on the CPU (tests/utils.emulated_capture), so the
test compiles nothing; tests/test_compiled_*.py cover Inductor."""
from __future__ import annotations

import warnings

import pytest
import torch

import lopa_fast
from lopa_fast import strategies
from lopa_fast.decode import batch, compiled_batch
from lopa_fast.decode.compiled import CompiledRounds
from lopa_fast.decode.driver import CompiledDriver, Driver
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import apd_models, emulated_capture

BUILT_IN = ("vanilla", "threshold", "d2f", "lopa", "apd")
# drivers allowed a `run()` of their own: none (the one loop is Scheduler.step)
RUN_PENDING_DELETION = ()


@pytest.fixture(scope="module")
def models():
    dream = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    llada = random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=6)
    apd = apd_models()
    return {"dream": dream, "llada": llada, "d64": apd["d64"], "q64": apd["q64"]}


def cases(models) -> list:
    """(name, model, generate knobs) per strategy: one config each, the APD one with its verifier."""
    return [
        ("vanilla", models["llada"], dict(strategy="vanilla", max_new_tokens=8, steps=4, block_length=4)),
        ("threshold", models["llada"], dict(strategy="threshold", max_new_tokens=8, block_length=4, threshold=0.5,
                                            cache="prefix")),
        ("d2f", models["dream"], dict(strategy="d2f", block_size=4, max_new_tokens=12)),
        ("lopa", models["dream"], dict(strategy="lopa", branching_factor=2, block_size=4, max_new_tokens=12)),
        ("apd", models["d64"], dict(strategy="apd", apd_mixture_weight=0.7, kv_window=2, max_lookahead=4,
                                    max_new_tokens=12, eos_token_id=61, verifier=models["q64"])),
    ]


@pytest.fixture
def loop_counter(monkeypatch):
    """Counts Scheduler.step calls and compiled batch groups (by batch bucket); the pending drivers' `run` raises."""
    seen = {"steps": 0, "groups": []}
    step, run = batch.Scheduler.step, compiled_batch.run

    def counted_step(self):
        seen["steps"] += 1
        return step(self)

    def counted_run(steps, model):
        seen["groups"].append(compiled_batch.batch_bucket(len(steps)))
        return run(steps, model)

    monkeypatch.setattr(batch.Scheduler, "step", counted_step)
    monkeypatch.setattr(compiled_batch, "run", counted_run)
    for cls in _driver_classes():
        if hasattr(cls, "run"):
            assert cls.__name__ in RUN_PENDING_DELETION, f"{cls.__name__} has its own run() loop"

            def refuse(self, *a, _name=cls.__name__, **k):
                raise AssertionError(f"{_name}.run() called: a loop outside Scheduler.step")

            monkeypatch.setattr(cls, "run", refuse)
    return seen


def _driver_classes() -> list:
    from lopa_fast.strategies.apd.driver import FastApd
    from lopa_fast.strategies.lopa.driver import FastDecoder
    from lopa_fast.strategies.threshold.driver import ThresholdDriver
    from lopa_fast.strategies.vanilla.driver import VanillaDriver
    from lopa_fast.strategies.lopa.distributed import DistributedDecoder

    return [FastDecoder, FastApd, DistributedDecoder, VanillaDriver, ThresholdDriver]


def test_the_drivers_have_no_loop_and_conform():
    """No driver has a `run` loop of its own (but the two the lead deletes at merge), every built-in strategy's
    fast entry is the one generic `run_solo`, and the drivers conform to the protocol."""
    for cls in _driver_classes():
        assert not hasattr(cls, "run") or cls.__name__ in RUN_PENDING_DELETION, cls
        assert issubclass(cls, Driver) and issubclass(cls, CompiledDriver), cls  # every built-in compiles batched
    for name in BUILT_IN:
        spec = strategies.get(name)
        fast = spec.load("fast")  # run_solo with the spec bound: the one loop looks no strategy up
        assert spec.fast == strategies.SOLO and fast.func is batch.run_solo and fast.keywords == {"spec": spec}, name
    import lopa_fast.strategies.apd.driver as apd
    import lopa_fast.strategies.lopa.driver as engine

    assert not hasattr(apd, "generate") and not hasattr(engine.FastDecoder, "_step")


def _generate(model, prompt, kw, **extra):
    kw = dict(kw, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # masks left by the tiny models (every backend)
        return lopa_fast.generate(model, prompt, backend="fast", **kw)


@pytest.mark.parametrize("name", BUILT_IN)
def test_solo_batched_and_compiled_run_through_scheduler_step(models, loop_counter, monkeypatch, name):
    _, model, kw = next(c for c in cases(models) if c[0] == name)
    ps = [torch.tensor([5, 9, 2, 7]), torch.tensor([3, 4, 8, 1])]
    seen = loop_counter

    solo = _generate(model, ps[0], kw)  # eager, solo: a batch of one
    assert seen["steps"] == solo.stats["forwards"] + 1 and not seen["groups"], seen  # one step per round + the end
    assert solo.generated_ids == lopa_fast.generate(model, ps[0], backend="reference", **kw).generated_ids

    seen["steps"] = 0
    outs = _generate(model, ps, kw)  # eager, batched
    assert seen["steps"] >= max(o.stats["forwards"] for o in outs) + 1
    assert outs[0].generated_ids == solo.generated_ids

    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    cr = CompiledRounds.for_model(model)
    monkeypatch.setattr(cr, "emulate_graphs", True)
    try:
        seen["steps"], seen["groups"] = 0, []
        comp = _generate(model, ps[0], kw, compile=True)  # compiled, solo: compiled batch bucket 1
        assert comp.generated_ids == solo.generated_ids and comp.stats["forwards"] == solo.stats["forwards"]
        assert seen["steps"] == comp.stats["forwards"] + 1
        assert seen["groups"] and set(seen["groups"]) == {1}, seen
        assert comp.stats["compiled_buckets"] and all(b[-1] == "x1" for b in comp.stats["compiled_buckets"])

        seen["steps"], seen["groups"] = 0, []
        both = _generate(model, ps, kw, compile=True)  # compiled, batched
        assert [o.generated_ids for o in both] == [o.generated_ids for o in outs]
        # (whether two requests share a key depends on their shapes: tests/test_compiled_batch.py)
        assert seen["steps"] >= max(o.stats["forwards"] for o in both) + 1 and seen["groups"], seen
    finally:
        cr.fns.clear()  # the emulated graphs must not serve later tests
        cr.workspaces.clear()
