"""CPU, one thread: the round's ops on their C++ kernels vs their torch backends, per call (pytest-benchmark).

Calls recorded from real fast-path rounds at two geometries (the op's cost depends on the round's shapes, not on
the model's width: its input is the statistics table):
  tiny   the first N_CASES cases of the parity grid's CI subset (every k, both attention modes, every model: the
         calls tests/test_select_round.py checks bit for bit)
  k4b32  LoPA k = 4 at a Dream-7B-like round (NB 5 slots, block 32, a 256-token prompt, 8 blocks generated) on
         the tiny gqa64 model
Ops: `select_round`, `plan_round` (round 1's plan), `window_inputs`, and `select_apply` (the LoPA round's glue
around select_round: the op's call on the round's dicts, the state update and the head), each `torch` vs `cpp`,
the same calls in the same order.

    python -m pytest bench/bench_select_round.py -m bench -q --benchmark-group-by=param:geometry,param:op
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lopa_fast  # noqa: E402
from lopa_fast import ops  # noqa: E402
from lopa_fast.ops.select_round import _NAMES, _PLAN_NAMES  # noqa: E402
from lopa_fast.strategies.lopa import round as lopa_round  # noqa: E402
from tests import test_fast_parity as parity  # noqa: E402

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA
pytestmark = pytest.mark.bench
N_CASES = 16
# the Dream-7B-like LoPA k = 4 round: NB = 1 + 4 slots, block 32, prompt 256, 8 blocks (~one call per round)
K4B32 = dict(strategy="lopa", branching_factor=4, block_size=32, max_new_tokens=256)
K4B32_PROMPT, K4B32_SEEDS = 256, (0, 1)
GEOMETRIES = ("tiny", "k4b32")


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return type(v)(*map(_clone, v)) if hasattr(v, "_fields") else tuple(map(_clone, v))
    return v


def _record(run) -> dict:
    """{op: [(args, kwargs)]} of every call `run()` makes (select_apply: its (st, T, geo, w, stats) as called)."""
    calls: dict = {"select_round": [], "window_inputs": [], "select_apply": []}
    real = {name: getattr(ops, name) for name in ("select_round", "window_inputs")}
    real_apply = lopa_round.select_apply

    def spy(name):
        def f(*args, **kw):
            calls[name].append((tuple(a.clone() for a in args), {k: v for k, v in kw.items()
                                                                 if k not in ("check", "backend")}))
            return real[name](*args, **kw)
        return f

    def apply_spy(*args):
        calls["select_apply"].append((_clone(args), {}))
        return real_apply(*args)

    for name in real:
        setattr(lopa_fast.ops, name, spy(name))
    lopa_round.select_apply = apply_spy  # round.py calls it through its module global
    try:
        run()
    finally:
        for name, fn in real.items():
            setattr(lopa_fast.ops, name, fn)
        lopa_round.select_apply = real_apply
    named = [dict(zip(_NAMES, a)) for a, _ in calls["select_round"]]
    calls["plan_round"] = [(tuple(n[k] for k in _PLAN_NAMES), dict(bs=kw["bs"], mask_id=kw["mask_id"],
                                                                  shift=kw["shift"]))
                           for n, (_, kw) in zip(named, calls["select_round"])]
    return calls


def _run_tiny():
    models = parity.build_models()
    eos_ids = {id(m): parity.frequent_token(m) for m in models.values()}
    for case in parity.ci_subset()[:N_CASES]:
        parity.run_case(models, eos_ids, case)


def _run_k4b32():
    m = parity.build_models()["gqa64"]
    V = m.config.vocab_size
    for seed in K4B32_SEEDS:
        prompt = torch.randint(0, V - 3, (K4B32_PROMPT,), generator=torch.Generator().manual_seed(seed))
        lopa_fast.generate(m, prompt, backend="fast", **K4B32)


@pytest.fixture(scope="module")
def recorded():
    """{geometry: {op: [(args, kwargs)]}}."""
    torch.set_num_threads(1)
    return {"tiny": _record(_run_tiny), "k4b32": _record(_run_k4b32)}


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("op", ["select_round", "plan_round", "window_inputs", "select_apply"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_round_op_per_call(benchmark, recorded, geometry, op, backend, monkeypatch):
    calls = recorded[geometry][op]
    assert calls, f"{geometry}: the decodes never reached {op}"
    if op == "select_apply":  # the glue picks select_round's backend itself (auto): forced through the env
        monkeypatch.setenv("LOPA_FAST_BACKEND", backend)

        def all_calls():
            for (st, T, geo, w, stats), _ in calls:
                lopa_round.select_apply(dict(st), T, geo, w, stats)  # st: a fresh dict (select_apply updates it)
    else:
        fn = getattr(ops, op)

        def all_calls():
            for args, kw in calls:
                fn(*args, **kw, check=False, backend=backend)

    args0 = calls[0][0] if op != "select_apply" else None
    if op == "select_round":
        benchmark.extra_info["NB, Lb1, G1, Nb"] = [args0[3].shape[0], args0[3].shape[1], args0[5].shape[0],
                                                   args0[21].shape[0]]
    benchmark.extra_info["calls"] = len(calls)
    benchmark(all_calls)
