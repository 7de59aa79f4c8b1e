"""CPU, one thread: the round's ops on their C++ kernels vs their torch backends, per call (pytest-benchmark).

On rounds recorded from the parity grid's tiny models (every k, both attention modes, both models: the same
calls tests/test_select_round.py checks bit for bit): `select_round`, `plan_round` (round 1's plan) and
`window_inputs`, each `torch` vs `cpp`, the same calls in the same order.

    python -m pytest bench/bench_select_round.py -m bench -q --benchmark-group-by=param:op
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
from tests import test_fast_parity as parity  # noqa: E402

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA
pytestmark = pytest.mark.bench
N_CASES = 16


@pytest.fixture(scope="module")
def recorded():
    """{op: [(args, kwargs)]} of the first N_CASES cases of the parity grid's CI subset."""
    torch.set_num_threads(1)
    calls: dict = {"select_round": [], "window_inputs": []}
    real = {name: getattr(ops, name) for name in calls}

    def spy(name):
        def f(*args, **kw):
            calls[name].append((tuple(a.clone() for a in args), {k: v for k, v in kw.items()
                                                                 if k not in ("check", "backend")}))
            return real[name](*args, **kw)
        return f

    models = parity.build_models()
    eos_ids = {id(m): parity.frequent_token(m) for m in models.values()}
    for name in calls:
        setattr(lopa_fast.ops, name, spy(name))
    try:
        for case in parity.ci_subset()[:N_CASES]:
            parity.run_case(models, eos_ids, case)
    finally:
        for name, fn in real.items():
            setattr(lopa_fast.ops, name, fn)
    named = [dict(zip(_NAMES, a)) for a, _ in calls["select_round"]]
    calls["plan_round"] = [(tuple(n[k] for k in _PLAN_NAMES), dict(bs=kw["bs"], mask_id=kw["mask_id"],
                                                                  shift=kw["shift"]))
                           for n, (_, kw) in zip(named, calls["select_round"])]  # fmt: skip
    return calls


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("op", ["select_round", "plan_round", "window_inputs"])
def test_round_op_per_call(benchmark, recorded, op, backend):
    fn, calls = getattr(ops, op), recorded[op]

    def all_calls():
        for args, kw in calls:
            fn(*args, **kw, check=False, backend=backend)

    benchmark.extra_info["calls"] = len(calls)
    benchmark(all_calls)
