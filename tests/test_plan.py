"""Resolve once (issue 34): `generate` turns its arguments into one validated plan before the first forward.

The walk is traced with sys.setprofile on a tiny random model, from the call up to the first model forward
(`forward_window` / `forward_static` / `forward` of a lopa_fast.models module), and two things are counted:

* entries into lopa_fast/api.py and lopa_fast/config.py. An ENTRY into module M is a call of a function defined
  in M while no frame of M is on the stack: the walk coming into M from outside. Calls M makes and the callbacks
  into M they lead to (a strategy's resolve hook calling `cfg.replace` from inside `bind_prompt`) belong to that
  visit. Beside it, api.py must not be called back at all from the modules it calls (a CALLBACK: a call of an
  api.py function from a frame of another file, the test's own call aside).
* lookups of a strategy's spec by name: calls of `lopa_fast.strategies.registry.get`.

Expected (the smallest honest numbers): api.py entered once; config.py entered once from generate_with_config
(`bind_prompt`: the knobs validated, then lengths, model defaults and notes for the prepared prompt) and twice from
generate (which first builds the GenerateConfig from its keyword knobs). A list of prompts validates the knobs once
before any prompt is touched, then binds each prompt. One lookup of the spec by the plan, plus the one the
memory estimate (`request_bytes`) makes for itself (it takes no spec: its own module, issue 36).
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest

import lopa_fast
from lopa_fast import api, strategies
from lopa_fast.request import plan
from lopa_fast.config import GenerateConfig
from lopa_fast.strategies import registry
from lopa_fast.testing import random_model, tiny_hf_config

PKG = os.path.dirname(lopa_fast.__file__)
WATCHED = {os.path.join(PKG, "api.py"): "api", os.path.join(PKG, "config.py"): "config"}
FORWARDS = {"forward_window", "forward_static", "forward_requests", "forward"}
# the memory estimate's functions (lopa_fast.memory; re-exported by api.py): their calls are not callbacks
MEMORY = {"request_bytes", "check_request_memory", "_first_param"}
# the spec lookups by name before the first forward, per backend (callers of registry.get)
# the plan's one lookup: the memory estimate and the one loop (Scheduler) are handed the plan's spec (issue 44)
LOOKUPS = {"reference": ["_spec"], "fast": ["_spec"]}
KNOBS = {"lopa": dict(branching_factor=2), "d2f": {}, "threshold": dict(threshold=0.9), "vanilla": dict(steps=8),
         "apd": dict(kv_window=2, max_lookahead=4)}


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream", vocab_size=64), seed=0, sharpen=3)


def _walk(call):
    """Run `call()` under a profiler up to the first model forward: (entries per module, callbacks into api.py as
    "caller -> function", the callers of registry.get, whether a forward was reached)."""
    entries = {"api": 0, "config": 0}
    callbacks, lookups, reached = [], [], [False]
    me = sys._getframe()

    def profile(frame, event, arg):
        if reached[0] or event != "call":
            return
        code = frame.f_code
        if code.co_name in FORWARDS and f"{os.sep}models{os.sep}" in code.co_filename:
            reached[0] = True
            return
        if code is registry.get.__code__:
            lookups.append(frame.f_back.f_code.co_name)
        module = WATCHED.get(code.co_filename)
        if module is None:
            return
        below = frame.f_back
        if not any(WATCHED.get(f.f_code.co_filename) == module for f in _stack(below, me)):
            entries[module] += 1
        if module == "api" and code.co_name not in MEMORY:
            caller = _caller(below)
            if caller is not None and caller.f_code.co_filename not in (code.co_filename, __file__):
                callbacks.append(f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_code.co_name} -> "
                                 f"{code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries, callbacks, lookups, reached[0]


def _stack(frame, stop):
    while frame is not None and frame is not stop:
        yield frame
        frame = frame.f_back


def _caller(frame):
    """The nearest frame that is not generated dataclass code ("<string>") or the standard library."""
    std = os.path.dirname(os.__file__)
    while frame is not None and (frame.f_code.co_filename == "<string>" or frame.f_code.co_filename.startswith(std)):
        frame = frame.f_back
    return frame


@pytest.mark.parametrize("strategy", ["lopa", "d2f", "threshold", "vanilla", "apd"])
@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_the_walk_of_cfg_enters_api_and_config_once_each(model, strategy, backend):
    kw = dict(max_new_tokens=8, block_size=4, **KNOBS[strategy])
    if strategy == "apd":
        kw["sampler"] = "keyed"
    prompt = [1, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lopa_fast.generate(model, prompt, strategy, backend, **kw)  # the lazy imports happen outside the walk
        cfg = GenerateConfig(strategy=strategy, backend=backend, **kw)
        entries, callbacks, lookups, reached = _walk(lambda: api.generate_with_config(model, prompt, cfg))
        assert reached, "the walk reached no model forward: it lost its subject"
        assert entries == {"api": 1, "config": 1}, entries  # bind_prompt (validate inside it)
        assert callbacks == [], callbacks
        # the plan's one lookup (the memory estimate and the one loop take the plan's spec)
        assert lookups == LOOKUPS[backend], lookups

        entries, callbacks, lookups, reached = _walk(lambda: lopa_fast.generate(model, prompt, strategy, backend, **kw))
    assert reached
    assert entries == {"api": 1, "config": 2}, entries  # GenerateConfig(**knobs), bind_prompt
    assert callbacks == [], callbacks
    assert lookups == LOOKUPS[backend], lookups


def test_a_batch_is_planned_once_per_prompt(model):
    """generate_batch: the knobs checked once, one Plan per prompt (each bound to its own length), and whether they
    share forwards; a prompt's error names the prompt."""
    cfg = GenerateConfig(strategy="lopa", backend="fast", max_new_tokens=6, block_size=4, branching_factor=2)
    batch = plan.make_batch(model, [[1, 2, 3], [4, 5]], cfg)
    assert batch.batched and [p.ids.tolist() for p in batch.plans] == [[1, 2, 3], [4, 5]]
    assert all(p.cfg.max_new_tokens == 8 and p.length["requested"] == 6 for p in batch.plans)
    assert all(p.spec is strategies.get("lopa") and p.backend == "fast" for p in batch.plans)
    with pytest.raises(ValueError, match=r"^prompt 1 of 2: input_ids contains the mask token id 63"):
        plan.make_batch(model, [[1, 2], [3, 63]], cfg)
    ref = plan.make_batch(model, [[1, 2]], cfg.replace(backend="reference"))
    assert not ref.batched and ref.plans[0].backend == "reference"


def test_the_plan_is_frozen_and_holds_the_run(model):
    cfg = GenerateConfig(strategy="d2f", max_new_tokens=4, block_size=4)
    p = plan.make(model, [1, 2], cfg)
    assert p.cfg.mask_token_id == 63 and p.cfg.max_rounds == 2 * 4 + 64 and p.ids.tolist() == [1, 2]
    assert p.extra() == {} and p.extra(print) == {"on_round": print}
    with pytest.raises(AttributeError):
        p.backend = "reference"  # frozen: everything after reads it
    assert api.run_plan(p).generated_ids == lopa_fast.generate(model, [1, 2], "d2f", max_new_tokens=4,
                                                                block_size=4).generated_ids
