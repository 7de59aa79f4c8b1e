"""`ops.window_inputs` (a D2F / LoPA round's forward inputs on its bucket, as one op): the C++ kernel and the Triton
kernel (the interpreter) return the reference's (reference.ops.window_inputs, the torch backend) values exactly on
calls recorded from parity-grid rounds (every k, both attention modes, both models) and on those calls with random
need / alive / running rows, starts, buckets and layout slots; bad arguments are named; and the decodes stay
token-exact with the Triton kernel in the loop."""
from __future__ import annotations

import random

import pytest
import torch

import lopa_fast
from lopa_fast import ops
from lopa_fast.ops import _backend
from tests import test_fast_parity as parity
from tests.utils import differing_fields

N_CASES = 16


_same = differing_fields  # the fields that differ bitwise (tests/utils.py)


@pytest.fixture(scope="module")
def recorded():
    torch.set_num_threads(1)
    calls, real = [], ops.window_inputs

    def spy(*args, **kw):
        calls.append((tuple(a.clone() for a in args), {k: kw[k] for k in ("Nb", "Rb", "blocks")}))
        return real(*args, **kw)

    models = parity.build_models()
    eos_ids = {id(m): parity.frequent_token(m) for m in models.values()}
    cases = parity.ci_subset()[:N_CASES]
    lopa_fast.ops.window_inputs = spy
    try:
        for case in cases:
            parity.run_case(models, eos_ids, case)
    finally:
        lopa_fast.ops.window_inputs = real
    assert {a[0].shape[0] > 1 for a, _ in calls} == {True, False}  # D2F and LoPA slots
    assert {kw["blocks"] for _, kw in calls} == {True, False}  # both attention modes
    return calls


def _perturbed(args, kw, rng: random.Random):
    """The call with random need / alive / running rows, window lengths, start, layout slot and bucket."""
    args = list(args)
    NB, Lb1 = args[0].shape
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    args[1] = torch.rand(NB, Lb1, generator=g) < rng.random()
    args[2] = torch.rand(NB, generator=g) < 0.7
    args[3] = torch.randint(0, Lb1, (NB,), generator=g)
    args[4] = torch.rand(NB, generator=g) < 0.7
    args[5] = torch.randint(0, Lb1, (NB,), generator=g)
    args[6] = torch.tensor(rng.randrange(NB))
    args[7] = torch.randint(0, 5, (8,), generator=g)
    args[8] = torch.tensor(rng.randrange(Lb1))
    Nb = rng.randint(1, 40)
    return tuple(args), dict(kw, Nb=Nb, Rb=rng.randint(1, NB * Nb), blocks=rng.random() < 0.5)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_recorded_and_perturbed_calls_equal_the_reference(recorded, backend):
    """Every recorded call and 2 perturbed ones each on C++; every 4th recorded call + 1 perturbed each on the
    Triton interpreter."""
    rng = random.Random(0)
    calls = recorded if backend == "cpp" else recorded[::4]
    n = 0
    for args, kw in calls:
        for a, k in [(args, kw)] + [_perturbed(args, kw, rng) for _ in range(2 if backend == "cpp" else 1)]:
            want = ops.window_inputs(*a, **k, backend="torch")
            got = ops.window_inputs(*a, **k, backend=backend)
            assert not _same(want, got), (_same(want, got), k)
            n += 1
    assert n > 30


def test_the_cpu_default_is_the_kernel(recorded):
    assert _backend.resolve("window_inputs", None, torch.device("cpu")) == "cpp"


def test_bad_arguments_are_named(recorded):
    args, kw = recorded[0]
    with pytest.raises(ValueError, match="Rb=0"):
        ops.window_inputs(*args, **dict(kw, Rb=0))
    bad = list(args)
    bad[1] = args[1].long()
    with pytest.raises(ValueError, match="need_all is torch.int64"):
        ops.window_inputs(*bad, **kw)
    with pytest.raises(ValueError, match="expected 11 tensors"):
        ops.window_inputs(*args[:-1], **kw)


def test_decodes_with_the_triton_kernel_are_token_exact(monkeypatch):
    """The CI subset's first case of each k with window_inputs on its Triton kernel (the interpreter) inside real
    decodes, every other op on its auto backend."""
    real, calls = ops.window_inputs, []

    def on_triton(*a, **kw):
        calls.append(1)
        return real(*a, **dict(kw, backend="triton"))

    monkeypatch.setattr(lopa_fast.ops, "window_inputs", on_triton)
    first = {}
    for c in parity.ci_subset():
        first.setdefault(c["branching_factor"], c)
    parity.check_cases(list(first.values()))
    assert calls
