"""compile=True in a batch (lopa_fast.decode.compiled_batch): the live requests whose next step has one key run it as
ONE compiled / captured batched step (a shared forward + every request's bookkeeping), one graph per (step key,
batch-size bucket), each request token-, forward- and counter-exact with running it alone eagerly (and so with the
reference), for vanilla, threshold, d2f, lopa and apd.

The grid runs the CUDA-graph path with the capture emulated on CPU (tests/utils.py `emulated_capture`: the workspace
lanes, the copies in and out, the inert padding lanes, graph-owned outputs) and asserts graph reuse through the
model's CompiledRounds counters; one tiny real Inductor compile (torch.compile on CPU) checks the compiled path."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import lopa_fast
from lopa_fast.decode import batch
from lopa_fast.decode.compiled import CompiledRounds
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import emulated_capture, step_models
from tests.utils import spec_of

G16 = dict(max_new_tokens=16, seed=11)
LOPA = dict(block_size=4, max_new_tokens=24, eos_token_id=5, skip_threshold=0.9)
# (model, strategy, knobs, prompt lengths): the step strategies' geometry is the exact length P + max_new_tokens,
# so their requests share a graph at one prompt length; d2f / lopa buffers are rounded up (any lengths share)
CASES = [
    ("llada", "vanilla", dict(G16, block_length=8, steps=8, cfg_scale=1.5), (4, 4, 4)),
    ("dream", "vanilla", dict(G16, steps=8, alg="entropy", temperature=0.7, return_trace=True), (4, 4, 4)),
    ("llada", "threshold", dict(G16, block_length=8, threshold=0.5, return_trace=True), (5, 5, 5)),
    ("llada", "threshold", dict(G16, block_length=8, cache="prefix", entropy_threshold=0.3, temperature=0.7),
     (4, 4, 4)),
    ("dream_mask", "threshold", dict(G16, block_length=8, cache="prefix", threshold=0.9, eos_token_id=7), (4, 4, 4)),
    ("llada_mask", "threshold", dict(G16, block_length=4, cache="dual", threshold=0.9, count_noop_forward=True),
     (4, 4, 4)),
    ("dream", "threshold", dict(G16, block_length=4, cache="dual", entropy_threshold=1.5, temperature=0.7), (4, 4, 4)),
    ("dream", "d2f", dict(LOPA, use_full_attention=False), (3, 17, 9)),
    ("dream", "lopa", dict(LOPA, branching_factor=2, use_full_attention=True, return_trace=True), (3, 17, 9)),
    ("dream", "lopa", dict(LOPA, branching_factor=4, use_full_attention=False, sampling_strategy="margin"), (6, 11, 9)),
]


@pytest.fixture(scope="module")
def models() -> dict:
    return step_models()


@pytest.fixture
def captured(monkeypatch):
    """The CUDA-graph path on CPU (the capture emulated) for the models the test passes to `rounds`; every grouped
    copy it makes (the write-back in the graph, a lane's loads) is checked for aliasing (`_unaliased_copy`)."""
    from lopa_fast.decode import compiled_batch

    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    calls = []
    monkeypatch.setattr(compiled_batch, "_copy", _unaliased_copy(compiled_batch._copy, calls))
    yield
    assert calls, "no grouped copy was checked"


def _unaliased_copy(real, calls: list):
    """compiled_batch._copy, asserting first that no source shares storage with a destination (its own included):
    on a GPU one multi-tensor copy kernel moves every pair at once, so a source that is another field's destination
    would be read while written (the CPU's sequential copies would hide it)."""
    def copy(dst: list, src: list) -> None:
        written = {d.untyped_storage().data_ptr(): i for i, d in enumerate(dst) if d.numel()}
        for j, v in enumerate(src):
            i = written.get(v.untyped_storage().data_ptr()) if v.numel() else None  # (empty: no storage)
            assert i is None, f"copy source {j} {tuple(v.shape)} {v.dtype} shares storage with destination {i}"
        calls.append(len(dst))
        real(dst, src)
    return copy


def rounds(model) -> CompiledRounds:
    """The model's CompiledRounds, taking the CUDA-graph path (with `captured`)."""
    cr = CompiledRounds.for_model(model)
    cr.emulate_graphs = True
    return cr


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 60, (n,), generator=g) for n in lengths]


def gen(model, p, strategy, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masks-left warnings of the mask-predicting models (every backend)
        return lopa_fast.generate(model, p, strategy, "fast", **kw)


COUNTERS = ("forwards", "transferred", "multi_token_steps", "noop_forwards", "refresh_forwards",
            "accepted_by_threshold", "fallback_fills", "multi_token_rounds", "eos_fills", "lookahead_wins")


def same(got, solo):
    assert got.generated_ids == solo.generated_ids
    for k in COUNTERS:
        assert got.stats.get(k) == solo.stats.get(k), k


def batch_keys(cr) -> set:
    return {k for k in cr.fns if k[0] == "batch"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{c[0]}-{c[2].get('cache')}")
def test_batched_compiled_equals_solo_eager(models, captured, case):
    name, strategy, kw, lengths = case
    model = models[name]
    ps = prompts(lengths, seed=len(name))
    solo = [gen(model, p, strategy, **kw) for p in ps]
    cr = rounds(model)
    calls = []
    fr = model.forward_requests
    model.forward_requests = lambda parts, *a, **k: calls.append(len(parts)) or fr(parts, *a, **k)
    try:
        outs = gen(model, ps, strategy, compile=True, **kw)
    finally:
        del model.forward_requests
    for o, s in zip(outs, solo):
        same(o, s)
        assert o.stats["batched"] == len(ps)
        if kw.get("return_trace"):
            assert [r["accepted"] for r in o.trace] == [r["accepted"] for r in s.trace]
    # the three requests ran padded to a batch bucket of 4 (one inert lane) in one shared forward per key and round
    assert any(b[-1] == "x4" for b in outs[0].stats["compiled_buckets"]), outs[0].stats["compiled_buckets"]
    assert 4 in calls, calls
    keys, graphs = batch_keys(cr), cr.graphs
    assert graphs >= len(keys) > 0  # one capture per (key, batch bucket) (the eager prefills are no graph)
    again = gen(model, ps, strategy, compile=True, **kw)  # the same shapes: every step a replay
    assert cr.graphs == graphs and batch_keys(cr) == keys
    for o, s in zip(again, solo):
        same(o, s)
        assert o.stats["compiled_graphs"] == 0 and o.stats["compile_seconds"] == {}


APD_CASES = [  # (drafter, verifier, knobs): a drafter cache and a verifier (two forwards per step); leftright (one)
    ("d64", "q64", dict(apd_mixture_weight=0.7, kv_window=4, max_lookahead=8, eos_token_id=62)),
    ("d66", None, dict(apd_mixture_weight=None, tokens_per_step=3, kv_window=0, max_lookahead=4, eos_token_id=62)),
]


@pytest.mark.parametrize("case", APD_CASES, ids=lambda c: c[1] or "leftright")
def test_batched_compiled_apd_equals_solo_eager(captured, case):
    """APD's step of two forwards as one batched graph (the drafter's forward for the group, its drafts, the
    verifier's forward for the group, acceptance and commit): tokens, forwards, acceptance counts and trace equal
    the solo eager runs; replays on the second batch."""
    from tests.utils import apd_models

    apd = apd_models()
    d, q = apd[case[0]], apd[case[1]] if case[1] else None
    kw = dict(case[2], strategy="apd", max_new_tokens=20, verifier=q, return_trace=True)
    ps = ([5, 9, 2], [7], [4, 8, 15, 16, 23, 42, 1, 3, 11])
    solo = [lopa_fast.generate(d, p, backend="fast", **kw) for p in ps]
    cr = rounds(d)
    calls = []
    if q is not None:
        fr = q.forward_requests
        q.forward_requests = lambda parts, *a, **k: calls.append(len(parts)) or fr(parts, *a, **k)
    try:
        outs = lopa_fast.generate(d, list(ps), backend="fast", compile=True, **kw)
    finally:
        if q is not None:
            del q.forward_requests
    graphs = cr.graphs
    again = lopa_fast.generate(d, list(ps), backend="fast", compile=True, **kw)
    assert cr.graphs == graphs > 0
    for o, a, s in zip(outs, again, solo):
        for got in (o, a):
            assert got.generated_ids == s.generated_ids and got.trace == s.trace
            for k in ("forwards", "dllm_forwards", "verifier_forwards", "acceptance_counts", "eos_detected"):
                assert got.stats[k] == s.stats[k], k
    assert any(b[-1] == "x4" for o in outs for b in o.stats["compiled_buckets"])
    assert q is None or 4 in calls  # the verifier's forward shared by the group (padded to 4)


def test_scheduler_admits_compiled_requests_mid_flight(models, captured):
    """Requests admitted at later rounds join running compiled groups (their eager prefill beside the compiled
    steps of the others); caps on rows hold; every request equals its solo run."""
    model = models["dream"]
    kw = dict(LOPA, branching_factor=2, use_full_attention=True)
    ps = prompts((6, 19, 11, 25, 8), seed=11)
    solo = [gen(model, p, "lopa", **kw) for p in ps]
    rounds(model)
    cfg = lopa_fast.GenerateConfig(strategy="lopa", backend="fast", compile=True, **kw).bind(model)
    sched = batch.Scheduler(model, cfg, max_rows=9, spec=spec_of(cfg))  # three LoPA k=2 requests (3 slots each) at once
    ids = [sched.submit(p) for p in ps[:2]]
    for _ in range(2):
        sched.step()
    ids += [sched.submit(p) for p in ps[2:]]
    groups = []
    while sched.queue or sched.live:
        sched.step()
        groups.append(sched.last_groups)
    assert max(groups) >= 2  # some round ran an eager prefill beside a compiled group (or two keys)
    for i, s in zip(ids, solo):
        same(sched.done[i], s)


def test_inert_lanes_never_touch_a_request(models, captured):
    """A workspace of 4 lanes serves later groups of 3 and 2 (padding lanes hold older requests' states, lanes hold
    other requests than before): the results stay the solo ones, and the workspace is one per shapes (reused)."""
    model = models["llada"]
    kw = dict(G16, block_length=8, threshold=0.5)
    ps = prompts((6, 6, 6, 6), seed=3)  # a length no other test uses: a geometry of its own
    solo = [gen(model, p, "threshold", **kw) for p in ps]
    cr = rounds(model)
    n_ws = len([k for k in cr.workspaces if k[0] == "batch"])
    for group in ((0, 1, 2, 3), (1, 2, 3), (3, 1)):  # batch buckets 4, 4 (one inert lane), 2
        for o, i in zip(gen(model, [ps[i] for i in group], "threshold", compile=True, **kw), group):
            same(o, solo[i])
    assert len([k for k in cr.workspaces if k[0] == "batch"]) == n_ws + 1  # one workspace of 4 lanes for all three


def test_a_request_stays_in_its_lane_between_steps(models, monkeypatch):
    """A request's state lives in its lane between compiled steps (compiled_batch._call: it is the lane's resident):
    after its first compiled step nothing is copied in or out around a replay (before: ~2 x 29 state copies a step,
    its KV cache among them), the lane's writes are its state; when it leaves the batch its state goes home
    (`release`: its own tensors hold the final state). Tokens equal the eager solo run; then a second request in
    the same lane evicts nobody it should not (results equal too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lopa_fast.decode import compiled_batch

    model = models["dream"]
    kw = dict(LOPA, branching_factor=3, use_full_attention=True)  # keys no other test captures (its replays counted)
    p1, p2 = prompts((7, 12), seed=21)
    solo = [gen(model, p, "lopa", **kw) for p in (p1, p2)]
    inside = [False]

    def capture(warmup, body):  # (a capture's warm-up runs the step once: not a lane copy either)
        inside[0] = True
        try:
            replay, outputs = emulated_capture(warmup, body)
        finally:
            inside[0] = False

        def counted():
            inside[0] = True
            try:
                replay()
            finally:
                inside[0] = False

        return counted, outputs

    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(capture))
    rounds(model)
    copies = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and func.__name__.startswith(("copy_", "_foreach_copy_")):
                copies.append(func.__name__)
            return func(*args, **(kwargs or {}))

    steps = []
    real_call = compiled_batch._call
    monkeypatch.setattr(compiled_batch, "_call", lambda entry, batch_steps: steps.append(len(copies)) or
                        real_call(entry, batch_steps))
    with Copies():
        out = gen(model, p1, "lopa", compile=True, **kw)
    same(out, solo[0])
    assert len(steps) >= 3
    per_step = [b - a for a, b in zip(steps[1:], steps[2:])]  # the copies between two later steps' calls
    assert per_step and all(n == 0 for n in per_step), per_step
    assert not compiled_batch._RESIDENCE  # it left: nothing lives in a lane any more
    same(gen(model, p2, "lopa", compile=True, **kw), solo[1])  # the same lane, another request
    assert not compiled_batch._RESIDENCE


def test_a_failed_step_sends_its_requests_home(models, monkeypatch):
    """A compiled step that raises (here the third replay) ends the run with that error, and the requests it held
    leave their lanes (Scheduler.run aborts them: no state left resident, the pool slot freed); the next request in
    the same lane decodes as alone."""
    from lopa_fast.decode import compiled_batch

    model = models["dream"]
    kw = dict(LOPA, branching_factor=3, use_full_attention=True)
    (p1,) = prompts((9,), seed=23)
    solo = gen(model, p1, "lopa", **kw)
    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    rounds(model)
    calls = []
    real_call = compiled_batch._call

    def failing(entry, batch_steps):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the replay failed")
        return real_call(entry, batch_steps)

    monkeypatch.setattr(compiled_batch, "_call", failing)
    with pytest.raises(RuntimeError, match="the replay failed"):
        gen(model, p1, "lopa", compile=True, **kw)
    assert len(calls) == 3 and not compiled_batch._RESIDENCE
    monkeypatch.setattr(compiled_batch, "_call", real_call)
    same(gen(model, p1, "lopa", compile=True, **kw), solo)
    assert not compiled_batch._RESIDENCE


def test_lru_cap_holds_for_batched_graphs(models, captured):
    """The least recently used batched graphs (and workspaces) leave at the model's cap; evicted keys capture again
    when asked, with the same tokens."""
    model = models["dream"]
    kw = dict(G16, steps=8, alg="entropy")
    ps = prompts((4, 4), seed=5)
    solo = [gen(model, p, "vanilla", **kw) for p in ps]
    cr = rounds(model)
    cr.fns.cap = cr.workspaces.cap = cr.compile_seconds.cap = 2
    ev = cr.fns.evicted
    for _ in range(2):
        for o, s in zip(gen(model, ps, "vanilla", compile=True, **kw), solo):
            same(o, s)
        assert len(cr.fns) <= 2 and len(cr.workspaces) <= 2
    assert cr.fns.evicted > ev


def test_batchable_and_engine_cover_compiled_requests(models, captured):
    """compile=True requests of the five strategies batch (the server's BatchEngine takes them: `covers`); distributed
    requests still run alone; a strategy without compiled batched steps is not claimed."""
    import dataclasses

    from lopa_fast import strategies

    cfg = lopa_fast.GenerateConfig
    for strategy, kw in (("vanilla", {}), ("threshold", dict(cache="prefix")), ("threshold", dict(cache="dual")),
                         ("d2f", {}), ("lopa", {}), ("apd", {})):
        assert batch.batchable(cfg(strategy=strategy, compile=True, **kw), spec_of(cfg(strategy=strategy, compile=True, **kw)))
        assert batch.BatchEngine.covers(cfg(strategy=strategy, compile=True, **kw), spec_of(cfg(strategy=strategy, compile=True, **kw)))
    assert not batch.batchable(cfg(strategy="lopa", distributed=True, compile=True), spec_of(cfg(strategy="lopa", distributed=True, compile=True)))
    spec = strategies.get("d2f")
    strategies.register(dataclasses.replace(spec, compile_batches=False), replace=True)
    try:
        assert batch.batchable(cfg(strategy="d2f"), spec_of(cfg(strategy="d2f"))) and not batch.batchable(cfg(strategy="d2f", compile=True), spec_of(cfg(strategy="d2f", compile=True)))
    finally:
        strategies.register(spec, replace=True)

    # the server's path: callers on threads, one engine thread running compiled batched steps
    model = models["dream"]
    kw = dict(LOPA, use_full_attention=False)
    ps = prompts((5, 12, 8), seed=9)
    solo = [gen(model, p, "d2f", **kw) for p in ps]
    rounds(model)
    c = cfg(strategy="d2f", backend="fast", compile=True, **kw).bind(model)
    engine = batch.BatchEngine(model, start=False)
    results = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(ps[i], c, spec=spec_of(c)))) for i in range(3)]
    for t in threads:
        t.start()
    while True:  # line all three up before the engine's first step
        with engine._cv:
            if len(engine._incoming) == 3:
                break
    engine.start()
    for t in threads:
        t.join(timeout=120)
    engine.close()
    assert engine.max_live == 3
    for o, s in zip(results, solo):
        same(o, s)
        assert any(b[-1] == "x4" for b in o.stats["compiled_buckets"])


def test_inductor_batched_step():
    """torch.compile (Inductor, CPU) of one batched step: two vanilla LLaDA requests in one graph (bucket x2) equal to
    solo eager; the second batch compiles nothing. CI's one batched Inductor compile (tens of seconds), and CI's one
    real-Inductor vanilla step: at T > 0, so the keyed sampler's draws run compiled in the default run too (the solo
    vanilla compile of tests/test_compiled_steps.py, its T > 0 twin at bucket 1, is `-m slow`)."""
    model = random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=6)
    kw = dict(G16, block_length=16, steps=8, temperature=0.5)  # one block, two tokens per step: one graph
    ps = [[3, 4, 5, 6], [9, 4, 5, 1]]
    solo = [gen(model, p, "vanilla", **kw) for p in ps]
    cr = CompiledRounds.for_model(model)
    outs = gen(model, ps, "vanilla", compile=True, **kw)
    graphs = cr.graphs
    again = gen(model, ps, "vanilla", compile=True, **kw)
    assert graphs == 1 and cr.graphs == graphs
    for o, a, s in zip(outs, again, solo):
        same(o, s)
        same(a, s)
        assert o.stats["compiled_buckets"] == [("block_topk", 16, 2, "x2")]
        assert a.stats["compiled_graphs"] == 0
    # its workspace freed (the batch engine frees the lanes no live request uses: issue 36), the compiled callable
    # keeps its code and runs on new lanes of the same shapes: no new graph, the same tokens
    from lopa_fast.decode import compiled_batch

    assert compiled_batch.lane_bytes(cr) > 0
    compiled_batch.free_workspaces(cr, set())
    assert compiled_batch.lane_bytes(cr) == 0
    third = gen(model, ps, "vanilla", compile=True, **kw)
    assert cr.graphs == graphs and compiled_batch.lane_bytes(cr) > 0
    for t, s in zip(third, solo):
        same(t, s)
        assert t.stats["compiled_graphs"] == 0


def test_compile_layer_imports_no_strategy():
    """compiled.py and compiled_batch.py know no strategy: they import neither lopa_fast.strategies nor a strategy's
    decoder (the drivers hand them step functions)."""
    import ast
    import pathlib

    decode = pathlib.Path(lopa_fast.__file__).parent / "decode"
    # every strategy's spec, reference, driver and step lives under lopa_fast.strategies (one folder each)
    strategy_modules = {"lopa_fast.strategies", "lopa_fast.reference", "lopa_fast.strategies.steps",
                        "lopa_fast.decode.batch"}
    for name in ("compiled.py", "compiled_batch.py"):
        tree = ast.parse((decode / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        bad = {m for m in imported if any(m == s or m.startswith(s + ".") for s in strategy_modules)}
        assert not bad, (name, bad)
        assert len(imported) >= 3, imported  # the walk saw its imports


def test_server_compile_batches_through_the_engine(captured):
    """`serve --compile` (the operator's compile in the server's defaults): a request is decoded by the batch engine
    as compiled batched steps (captured, emulated here), with the answer of `generate` alone."""
    from fastapi.testclient import TestClient

    from lopa_fast.assets import model_dir
    from lopa_fast.server.app import create_app
    from lopa_fast.server.worker import Worker

    model = lopa_fast.load_model(model_dir(), dtype=torch.float32)
    tok = lopa_fast.load_tokenizer(model_dir())
    rounds(model)
    worker = Worker(model, tok, concurrency=2)
    prompt = "Lily has 3 apples ."
    try:
        with TestClient(create_app(worker, model_id="m", defaults={"max_new_tokens": 8, "compile": True})) as http:
            # vanilla (4 steps): every step compiled (a d2f / lopa answer here ends in its eager prefill round)
            body = {"model": "m", "prompt": prompt, "strategy": "vanilla", "steps": 4, "alg": "entropy"}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            st = r.json()["stats"]
        assert st["batched"] is True and any(b[-1] == "x1" for b in st["compiled_buckets"]), st
        assert worker.engine.rounds > 0
        want = lopa_fast.generate(model, tok(prompt)["input_ids"], "vanilla", max_new_tokens=8, steps=4, alg="entropy")
        assert r.json()["usage"]["forwards"] == want.stats["forwards"]
        assert r.json()["choices"][0]["text"] == tok.decode(want.generated_ids, skip_special_tokens=True)
    finally:
        worker.close()
