"""`ops.select_round` (a D2F / LoPA round's selection and bookkeeping as one op): every backend the CPU runs returns
the reference's (reference.ops.select_round, the torch backend) outputs bit for bit, on inputs recorded from real
rounds of the parity grid's tiny models and on those inputs perturbed (tied, NaN, infinite confidences; random
knobs); the public op names a bad argument; and the parity grid stays token-exact on the torch backend too (the C++
kernel is the CPU default: tests/test_fast_parity.py runs the grid on it)."""
from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.utils._python_dispatch

import lopa_fast
from lopa_fast import ops
from lopa_fast.reference.ops import SelectRound
from tests import test_fast_parity as parity
from tests.utils import cuda_kernels  # noqa: F401 - a fixture (the gpu capture test)
from tests.utils import differing_fields, record_calls

# the CPU backends compared with the reference (triton: the interpreter; cuda: the host emulation, where they exist)
BACKENDS = ["cpp", "triton", "cuda"]
N_CASES = 24  # parity-grid cases recorded (every k, both attention modes, every model)
MAX_CALLS = 6  # rounds kept per case
N_CUDA_GRID = 12  # parity-grid cases on the emulated CUDA kernel in the default run (~12 ms a round emulated)


def _record(cases) -> list[tuple[tuple, dict]]:
    """The first MAX_CALLS rounds' select_round calls of each case."""
    models = parity.build_models()
    eos_ids = {id(m): parity.frequent_token(m) for m in models.values()}
    in_case = []  # the calls of the case running now

    def run():
        for case in cases:
            in_case.clear()
            parity.run_case(models, eos_ids, dict(case, return_trace=random.Random(case["prompt_seed"]).random() < 0.3))

    return record_calls("select_round", run, lambda calls: in_case.append(1) or len(in_case) <= MAX_CALLS)


@pytest.fixture(scope="module")
def recorded():
    torch.set_num_threads(1)
    cases = parity.ci_subset()[:N_CASES]
    assert {c["branching_factor"] for c in cases} == set(parity.KS)
    assert {c["model"] for c in cases} == set(parity.MODELS)
    calls = _record(cases)
    kinds = {(kw["n_look"] > 0, kw["shift"], kw["blend"], kw["score_all"]) for _, kw in calls}
    assert len(calls) > 50 and {k[0] for k in kinds} == {True, False} and {k[1] for k in kinds} == {True, False}
    return calls


_same = differing_fields  # the fields that differ bitwise (tests/utils.py)


def _run(args, kw, backend) -> SelectRound:
    """`backend`'s outputs on CPU tensors (cuda: the exact .cu through the host emulation)."""
    if backend == "cuda":
        from lopa_fast.ops.cuda.emulation import emulator  # noqa: PLC0415 - builds with g++ at first use

        return SelectRound(*emulator(("select_round",)).select_round(*args, **kw))
    return ops.select_round(*args, **kw, backend=backend)


def _check(args, kw, backend):
    ref = ops.select_round(*args, **kw, backend="torch")
    got = _run(args, kw, backend)
    bad = _same(ref, got)
    assert not bad, f"{backend}: {bad} differ (statics {kw})"


# the Triton interpreter takes ~170 ms a call (the others ~0.2 / ~13 ms): in the default run it checks every
# INTERPRETER_STRIDE-th recorded round and one perturbation of each of those; `-m slow` checks all of them
INTERPRETER_STRIDE = 4


def _share(recorded, backend, full: bool):
    return recorded if full or backend != "triton" else recorded[::INTERPRETER_STRIDE]


@pytest.mark.parametrize("backend", BACKENDS)
def test_recorded_rounds_are_bitwise_the_reference(recorded, backend):
    for args, kw in _share(recorded, backend, False):
        _check(args, kw, backend)


def _perturb(args, kw, rng: random.Random):
    """The recorded round with a new statistics table (tied, NaN, infinite or random confidences and
    probabilities, random tokens) and new float knobs: any input the op can be given must agree."""
    args = list(args)
    S = args[0].numel()
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    mode = rng.choice(("ties", "random", "special"))
    if mode == "ties":  # few distinct values: ties in the scores, the fallback and the spawn order
        conf = torch.tensor([0.25, 0.5, 0.5, 0.75, 1.0])[torch.randint(0, 5, (S,), generator=g)]
    elif mode == "random":
        conf = torch.rand(S, generator=g) * rng.choice((1.0, -3.0))
    else:
        conf = torch.rand(S, generator=g)
        conf[torch.randint(0, S, (max(1, S // 4),), generator=g)] = rng.choice(
            (float("nan"), float("inf"), float("-inf")))
    args[0] = conf.float()
    args[1] = torch.randint(0, 64, (S,), generator=g)
    taus = (0.0, 0.3, 0.5, 0.9, 0.99)  # p drawn partly from the thresholds: p == tau (float32) must not accept
    p = torch.rand(S, generator=g)
    hit = torch.rand(S, generator=g) < 0.5
    args[2] = torch.where(hit, torch.tensor(taus)[torch.randint(0, len(taus), (S,), generator=g)], p).float()
    args[-2] = torch.tensor(rng.choice(taus), dtype=torch.float64)  # skip_threshold
    args[-1] = torch.tensor(rng.choice((0.0, 0.3, 1.0)), dtype=torch.float64)  # alpha
    kw = dict(kw, blend=rng.random() < 0.5, score_all=kw["score_all"] or rng.random() < 0.3)
    return tuple(args), kw


def _perturbed(recorded, backend, full: bool):
    rng = random.Random(0)
    for args, kw in _share(recorded, backend, full):
        for _ in range(3 if full or backend != "triton" else 1):
            _check(*_perturb(args, kw, rng), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_perturbed_rounds_are_bitwise_the_reference(recorded, backend):
    _perturbed(recorded, backend, False)


@pytest.mark.slow
def test_every_recorded_and_perturbed_round_on_the_triton_interpreter(recorded):
    for args, kw in recorded:
        _check(args, kw, "triton")
    _perturbed(recorded, "triton", True)


def test_bad_arguments_are_named(recorded):
    args, kw = recorded[0]
    bad = list(args)
    bad[0] = args[0].double()
    with pytest.raises(ValueError, match=r"select_round: conf is torch.float64"):
        ops.select_round(*bad, **kw)
    bad = list(args)
    bad[4] = args[4][:-1] if args[4].numel() > 1 else args[4].repeat(2)
    with pytest.raises(ValueError, match=r"select_round: n_blocks"):
        ops.select_round(*bad, **kw)
    with pytest.raises(ValueError, match=r"select_round: \d+ tensor arguments"):
        ops.select_round(*args[:-1], **kw)
    with pytest.raises(ValueError, match=r"n_look=7"):
        ops.select_round(*args, **dict(kw, n_look=7))
    with pytest.raises(ValueError, match=r"backend='nope'"):
        ops.select_round(*args, **kw, backend="nope")


def test_parity_grid_on_the_torch_backend(monkeypatch):
    """The CI subset's first cases with select_round on its torch backend (the path compile and capture trace where
    no kernel takes the op); the full grid under -m slow."""
    monkeypatch.setenv("LOPA_FAST_BACKEND", "torch")
    parity.check_cases(parity.ci_subset()[:30])


@pytest.mark.slow
def test_parity_grid_full_on_the_torch_backend(monkeypatch):
    monkeypatch.setenv("LOPA_FAST_BACKEND", "torch")
    parity.assert_coverage(parity.check_cases(parity.full_product()))


def _force_triton(monkeypatch):
    """select_round on its Triton kernel (the interpreter on CPU) inside real decodes; every other op on its auto
    backend (LOPA_FAST_BACKEND=triton would move every op with a Triton kernel into the slow interpreter)."""
    real = ops.select_round
    calls = []

    def on_triton(*a, **kw):
        calls.append(1)
        return real(*a, **dict(kw, backend="triton"))

    monkeypatch.setattr(lopa_fast.ops, "select_round", on_triton)
    return calls


def test_parity_grid_on_the_triton_backend(monkeypatch):
    """The CI subset's first cases (every k, both models) token-exact with select_round on the Triton kernel."""
    calls = _force_triton(monkeypatch)
    first = {}  # the subset's first case of each k (D2F k = 1, LoPA k = 2 / 4 / 8: NB = 1 / 3 / 5 / 9)
    for c in parity.ci_subset():
        first.setdefault(c["branching_factor"], c)
    cases = list(first.values())
    assert set(first) == set(parity.KS) and len({c["model"].startswith("llada") for c in cases}) == 2
    parity.check_cases(cases)
    assert calls, "the decodes never reached ops.select_round"


@pytest.mark.slow
def test_parity_grid_full_on_the_triton_backend(monkeypatch):
    """Every 17th case of the full product (91 cases, every k / mode / block size / model): the interpreter's
    ~170 ms a round would make the whole product (1,536 cases) a run of about 90 minutes."""
    calls = _force_triton(monkeypatch)
    parity.assert_coverage(parity.check_cases(parity.full_product()[::17]))
    assert calls, "the decodes never reached ops.select_round"


def _on_cuda_emulation(monkeypatch) -> list[int]:
    """Route the fast path's select_round through the CUDA kernel's host emulation; returns the call counter
    (a run that never reached the kernel has lost its subject and fails)."""
    from lopa_fast.ops.cuda.emulation import emulator  # noqa: PLC0415

    emu, n = emulator(("select_round",)), [0]
    public = importlib.import_module("lopa_fast.ops.select_round")  # the module (lopa_fast.ops re-exports the op)

    def via_kernel(*args, check=True, backend=None, out=None, **kw):  # (out: a CPU workspace; the kernel allocates)
        if check:
            public._check(args, kw["bs"], kw["mask_id"], kw["eos_id"], kw["n_look"])
        n[0] += 1
        return SelectRound(*emu.select_round(*args, **kw))

    monkeypatch.setattr(lopa_fast.ops, "select_round", via_kernel)
    return n


def test_parity_grid_on_the_cuda_kernel(monkeypatch):
    """The CI subset's first cases token-exact with select_round on the CUDA kernel (host emulation of the exact
    .cu); the full grid under -m slow."""
    n = _on_cuda_emulation(monkeypatch)
    parity.check_cases(parity.ci_subset()[:N_CUDA_GRID])
    assert n[0] > 5 * N_CUDA_GRID, f"the fast path called select_round {n[0]} times"


@pytest.mark.slow
def test_parity_grid_full_on_the_cuda_kernel(monkeypatch):
    n = _on_cuda_emulation(monkeypatch)
    parity.assert_coverage(parity.check_cases(parity.full_product()))
    assert n[0] > 0


def _plan_args(args):
    """plan_round's 12 tensors out of a recorded select_round call (the same state and tables)."""
    from lopa_fast.ops.select_round import _NAMES, _PLAN_NAMES

    named = dict(zip(_NAMES, args))
    return tuple(named[n] for n in _PLAN_NAMES)


def test_plan_round_on_cpp_is_bitwise_the_reference(recorded):
    """Round 1's plan (ops.plan_round; later plans are select_round's) on the C++ kernel: bit for bit the reference
    on every recorded round's state, and on that state with masks and block states shuffled."""
    from lopa_fast.reference.ops import RoundPlan

    assert _backend_of("plan_round") == "cpp"
    rng = random.Random(1)
    n = 0
    for args, kw in recorded:
        pk = dict(bs=kw["bs"], mask_id=kw["mask_id"], shift=kw["shift"])
        plan_args = _plan_args(args)
        variants = [plan_args]
        x = plan_args[0].clone()
        flip = torch.rand(x.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < 0.3
        variants.append((torch.where(flip, kw["mask_id"], x),) + plan_args[1:])
        for pa in variants:
            want = ops.plan_round(*pa, **pk, backend="torch")
            got = ops.plan_round(*pa, **pk, backend="cpp")
            bad = [f for f, a, b in zip(RoundPlan._fields, want, got) if a.dtype != b.dtype or not torch.equal(a, b)]
            assert not bad, (bad, pk)
            n += 1
    assert n > 100


def _backend_of(op):
    from lopa_fast.ops import _backend

    return _backend.resolve(op, None, torch.device("cpu"))


class _AtenLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a block of code dispatches (torch.tensor from a Python list shows as aten.lift_fresh, a copy
    to another device as aten._to_copy / aten.copy_, a host read as aten._local_scalar_dense)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_cuda_launch_copies_nothing_to_the_device(recorded, monkeypatch):
    """The CUDA kernel's launch plan (launch.run_select_round: the GPU's and the emulation's) builds no tensor from
    host data and copies nothing between devices per call (its pointer table goes by value, kind "t"): only the
    scratch is allocated, so a CUDA graph captures the launch. The emulation runs the launch, bit-exact."""
    from lopa_fast.ops.cuda.constants import SR_INPUTS, SR_OUTPUTS, SR_PTRS  # noqa: PLC0415
    from lopa_fast.ops.cuda.emulation import emulator  # noqa: PLC0415
    from lopa_fast.ops.cuda.launch import run_select_round  # noqa: PLC0415
    from lopa_fast.ops.select_round import _NAMES  # noqa: PLC0415
    from lopa_fast.ops.select_round_outputs import outputs  # noqa: PLC0415

    assert (SR_INPUTS, SR_OUTPUTS) == (len(_NAMES), len(SelectRound._fields))  # the .cu's kInputs / kOutputs
    emu_launch = emulator(("select_round",))._l["select_round"]
    seen = []

    def launch(name, grid, block, smem, args):
        seen.append(args)
        emu_launch(name, grid, block, smem, args)

    def no_host_tensor(*a, **k):
        raise AssertionError("a tensor built from host data during a launch")

    for args, kw in recorded[:: max(1, len(recorded) // 8)]:
        ins = [t.contiguous() for t in args]
        outs = outputs(args, split=False)
        log = _AtenLog()
        with monkeypatch.context() as m:
            for f in ("tensor", "as_tensor", "from_numpy", "frombuffer"):
                m.setattr(torch, f, no_host_tensor)
            with log:
                run_select_round(launch, ins, outs, **kw)
        assert {str(op) for op in log.ops} == {"aten.empty.memory_format"}, log.ops  # the scratch, nothing else
        table = [v for k, v in seen[-1] if k == "t"]
        assert len(table) == 1 and list(table[0]) == [t.data_ptr() for t in (*ins, *outs)]
        assert len(table[0]) == SR_PTRS and all(k in "tpqi" for k, _ in seen[-1]), seen[-1]
        bad = _same(ops.select_round(*args, **kw, backend="torch"), SelectRound(*outs))
        assert not bad, f"cuda (emulated, by-value table): {bad} differ"


@pytest.mark.gpu
def test_cuda_kernel_is_captured_in_a_cuda_graph(recorded, cuda_kernels):  # noqa: F811 - the fixture
    """One select_round call captured in torch.cuda.graph: a replay on new statistics is bit for bit the eager
    kernel and the reference (the pointer table is a by-value parameter: nothing copied per launch)."""
    args, kw = max(recorded, key=lambda c: c[0][0].numel())
    rng = random.Random(1)
    new = _perturb(args, kw, rng)[0]  # new tensors, the same statics (those are baked into the graph)
    static = [a.cuda() for a in args]
    eager = SelectRound(*cuda_kernels.select_round(*static, **kw))  # warm-up: the cubin loaded before capture
    assert not _same(ops.select_round(*args, **kw, backend="torch"), SelectRound(*[t.cpu() for t in eager]))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda_kernels.select_round(*static, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_kernels.select_round(*static, **kw)
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    got = SelectRound(*[t.cpu() for t in captured])
    want = SelectRound(*[t.cpu() for t in cuda_kernels.select_round(*[a.cuda() for a in new], **kw)])
    assert not _same(want, got), "replay differs from the eager kernel"
    assert not _same(ops.select_round(*new, **kw, backend="torch"), got), "replay differs from the reference"
