"""`ops.select_step` (a threshold step's selection and bookkeeping as one op): the C++ kernel returns the reference's
(reference.ops.select_step, the torch backend) outputs bit for bit on steps recorded from the threshold parity grid
(every rule, every cache, Dream and LLaDA, T = 0 and T > 0) and on random and adversarial rows (ties, NaN, -inf,
a confidence equal to tau, no candidate, padding past L, float64 confidences); bad arguments are named; the
threshold parity grid stays token-exact on the torch backend too (the C++ kernel is the CPU default:
tests/test_fast_steps.py runs the grid on it)."""
from __future__ import annotations

import random

import pytest
import torch

import lopa_fast
from lopa_fast import ops
from lopa_fast.ops import _backend
from lopa_fast.reference.ops import STEP_RULES
from tests import test_fast_steps as fs
from tests.utils import differing_fields

N_CASES = 24  # threshold cases recorded
MAX_CALLS = 8  # steps kept per case


_same = differing_fields  # the fields that differ bitwise (tests/utils.py)


@pytest.fixture(scope="module")
def recorded():
    torch.set_num_threads(1)
    models = fs.step_models()
    by_rule: dict = {}
    for c in fs.threshold_cases():
        by_rule.setdefault(next(r for r in STEP_RULES if r in c["kw"]), []).append(c)
    rng = random.Random(0)  # every rule, models, caches and temperatures mixed
    cases = [c for group in by_rule.values() for c in rng.sample(group, N_CASES // len(by_rule))]
    calls, real = [], ops.select_step

    def spy(*args, **kw):
        if spy.n < MAX_CALLS:
            calls.append((tuple(a.clone() for a in args), {k: kw[k] for k in ("rule", "mask_id", "B")}))
            spy.n += 1
        return real(*args, **kw)

    lopa_fast.ops.select_step = spy
    try:
        for case in cases:
            spy.n = 0
            fs.run_pair(models, case)
    finally:
        lopa_fast.ops.select_step = real
    rules = {kw["rule"] for _, kw in calls}
    assert rules == set(STEP_RULES), rules  # every rule, Dream's refresh_first included
    assert {a[4].dtype for a, _ in calls} == {torch.float32, torch.float64}  # Dream's and LLaDA's statistics
    return calls


def test_the_cpu_default_is_the_kernel():
    assert _backend.resolve("select_step", None, torch.device("cpu")) == "cpp"
    assert _backend.cpp_module() is not None and hasattr(_backend.cpp_module(), "select_step_cpu")


def _recorded(calls, backend):
    multi = 0
    for args, kw in calls:
        want = ops.select_step(*args, **kw, backend="torch")
        got = ops.select_step(*args, **kw, backend=backend)
        assert not _same(want, got), (_same(want, got), kw)
        multi += int(want.multi - args[7])
    assert multi > 0  # some recorded step committed several tokens


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_recorded_steps_are_bitwise_the_reference(recorded, backend):
    """Every recorded step on C++; every 3rd on the Triton interpreter (-m slow: all)."""
    _recorded(recorded if backend == "cpp" else recorded[::3], backend)


def _random_step(rng: random.Random, rule: str, conf_dtype: torch.dtype):
    """Adversarial rows: few distinct confidence / entropy values (ties), NaN and -inf sprinkled, the knob often
    equal to a confidence, padding positions past L, some steps without any candidate."""
    L = rng.randint(1, 24)
    n = rng.randint(1, 12)
    mask_id = 5
    x = torch.tensor([rng.choice([mask_id, mask_id, 1, 2, 3]) for _ in range(L)])
    pos = torch.tensor([rng.randint(0, L + 3) for _ in range(n)])
    valid = torch.tensor([rng.random() < 0.8 for _ in range(n)]) & (pos < L)
    vals = [0.0, 0.25, 0.5, 0.5, 0.9, 1.0, float("nan"), float("-inf")]
    conf = torch.tensor([rng.choice(vals) if rng.random() < 0.5 else rng.random() for _ in range(n)],
                        dtype=conf_dtype)
    ent = torch.tensor([rng.choice([0.0, 0.3, 0.3, 1.5, float("nan")]) if rng.random() < 0.5 else rng.random() * 3
                        for _ in range(n)], dtype=torch.float64)
    finite = torch.tensor([rng.random() < 0.9 for _ in range(n)])
    knob = {"threshold": rng.choice([0.5, 0.9, float(conf[0]) if n else 0.5, rng.random()]),
            "entropy_threshold": rng.choice([0.3, 1.5, rng.random()]), "factor": rng.choice([1.0, 2.5, 0.1, 5.0]),
            "first": 0.0}[rule]
    args = (x, pos, valid, torch.tensor([rng.randint(0, 9) for _ in range(n)]), conf, ent, finite,
            torch.tensor(rng.randint(0, 3)), torch.tensor(rng.randint(0, 3)), torch.tensor(rng.randint(0, L)),
            torch.tensor(knob, dtype=torch.float64))
    return args, dict(rule=rule, mask_id=mask_id, B=rng.choice([0, 1, 4, 8]))


def _adversarial(rule: str, backend: str, n: int) -> None:
    rng = random.Random(STEP_RULES.index(rule))
    committed = 0
    for i in range(n):
        args, kw = _random_step(rng, rule, torch.float64 if i % 3 == 0 else torch.float32)
        want = ops.select_step(*args, **kw, backend="torch")
        got = ops.select_step(*args, **kw, backend=backend)
        assert not _same(want, got), (i, _same(want, got), args, kw)
        committed += int((want.x != args[0]).sum())
    assert committed > n // 4  # the rows commit tokens, not only no-ops


@pytest.mark.parametrize("rule", STEP_RULES)
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_random_and_adversarial_steps_are_bitwise_the_reference(rule, backend):
    """400 adversarial steps a rule on C++, 40 on the Triton interpreter (-m slow: 400)."""
    _adversarial(rule, backend, 400 if backend == "cpp" else 40)


@pytest.mark.slow
def test_every_recorded_and_400_adversarial_steps_a_rule_on_the_triton_interpreter(recorded):
    _recorded(recorded, "triton")
    for rule in STEP_RULES:
        _adversarial(rule, "triton", 400)


def test_bad_arguments_are_named(recorded):
    args, kw = recorded[0]
    with pytest.raises(ValueError, match="rule='top'; allowed: threshold"):
        ops.select_step(*args, **dict(kw, rule="top"))
    bad = list(args)
    bad[4] = args[4].half()
    with pytest.raises(ValueError, match="conf is torch.float16"):
        ops.select_step(*bad, **kw)
    bad = list(args)
    bad[2] = args[2][:0]
    with pytest.raises(ValueError, match="valid is torch.bool"):
        ops.select_step(*bad, **kw)
    with pytest.raises(ValueError, match="11 tensor arguments|expected 11"):
        ops.select_step(*args[:-1], **kw)
    with pytest.raises(ValueError, match="unavailable: no CUDA kernel for select_step"):
        ops.select_step(*args, **kw, backend="cuda")


def test_threshold_grid_on_the_torch_backend(monkeypatch):
    """The CI subset's threshold cases with select_step on its torch backend (the CPU default is the kernel)."""
    monkeypatch.setenv(_backend.ENV, "torch")
    models = fs.step_models()
    cases = [c for c in fs.CI_CASES if c["strategy"] == "threshold"][:12]
    for case in cases:
        ref, fast = fs.run_pair(models, case)
        fs.check(ref, fast, case)


def test_threshold_grid_on_the_triton_kernel(monkeypatch):
    """Threshold cases of every rule token-exact with select_step on its Triton kernel (the interpreter on CPU) inside
    real decodes; every other op on its auto backend (LOPA_FAST_BACKEND=triton would move them all into the
    interpreter)."""
    real, calls = ops.select_step, []

    def on_triton(*a, **kw):
        calls.append(kw["rule"])
        return real(*a, **dict(kw, backend="triton"))

    monkeypatch.setattr(lopa_fast.ops, "select_step", on_triton)
    models = fs.step_models()
    first: dict = {}  # the first case of each (rule, cache)
    for c in fs.threshold_cases():
        first.setdefault((next(r for r in STEP_RULES if r in c["kw"]), c["kw"]["cache"], c["model"][:5]), c)
    for case in first.values():
        ref, fast = fs.run_pair(models, case)
        fs.check(ref, fast, case)
    assert set(calls) == set(STEP_RULES), set(calls)
