"""Issue 36 finding 7: memory the budget did not see. The compiled-batch lane workspaces (a clone of every lane's
state, KV included, padded to a power of two) outlived their requests in the model's CompiledRounds LRU, unseen;
the batch engine's KV pool grew by doubling with no length cap and was not counted; APD's verifier had no term in
the request's estimate. Now what the engine holds beyond the estimates (pools, lanes: idle ones stay for their
graphs) counts against the server's budget (`MemoryBudget.held`), a request that would wait for memory first
frees the idle lanes (and the captured graphs over them; a compiled graph keeps its code and takes new lanes), the
pool's doubling stays within the requests' reservations and its slots within --max-model-len, and
`request_bytes` counts the verifier.

Every case measures the tensors held (the lanes' and the pool's bytes), not wall-clock; the end-to-end one runs
the server in a subprocess under an address-space cap. Full forms (many shapes, a capped subprocess) under -m slow."""
from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

from test_server_limits import DEFAULTS, PROMPT, _call, _Server, embedded  # noqa: F401 - the fixture
import lopa_fast
from lopa_fast import memory, strategies
from lopa_fast.decode import batch, compiled_batch
from lopa_fast.decode.compiled import CompiledRounds
from lopa_fast.decode.shapes import quantized_length
from lopa_fast.server import create_app
from lopa_fast.server.limits import Limits, MemoryBudget
from lopa_fast.server.worker import Worker
from lopa_fast.testing import random_model, tiny_hf_config
from test_server_recovery import _subprocess
from tests.utils import emulated_capture
from tests.utils import spec_of

LOPA = dict(block_size=4, max_new_tokens=24, eos_token_id=5, skip_threshold=0.9)


@pytest.fixture
def captured(monkeypatch):
    """The CUDA-graph path on CPU (the capture emulated, as tests/test_compiled_batch.py runs it)."""
    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))


def _model(seed: int = 5):
    return random_model(tiny_hf_config("dream", vocab_size=64), seed=seed, sharpen=6)


def held_lanes(model) -> int:
    """Bytes of every lane tensor the model's CompiledRounds holds (its batch workspaces and the batched callables'
    lanes), each storage once: measured here, independently of compiled_batch.lane_bytes."""
    cr = CompiledRounds.for_model(model)
    seen, n = set(), 0
    lanes = [ws["lanes"] for k, ws in cr.workspaces.items() if k[0] == "batch"]
    lanes += [getattr(e, "lanes", None) or [] for k, e in cr.fns.items() if k[0] == "batch"]
    for group in lanes:
        for S, T in group:
            for t in [*S.values(), *T.values()]:
                st = t.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    n += st.nbytes()
    return n


def _engine_run(engine, prompts, cfg, hook=None) -> list:
    """Every prompt through `engine` on its own caller thread, lined up before the engine's first step."""
    results = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(prompts[i], cfg, hook, spec=spec_of(cfg))))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    while True:
        with engine._cv:
            if len(engine._incoming) == len(prompts):
                break
        time.sleep(0.001)
    engine.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_idle_lanes_are_counted_and_go_when_memory_is_wanted(captured):
    """The engine's compiled batched requests (captured, emulated): while they run their lanes hold about a KV
    cache each (padded to the bucket of 4 for 3 requests), all of it inside what the requests' estimates reserve;
    after the last one the lanes stay for their graphs, every byte of them reported as held (before: they stayed
    in the model's LRU, 4.3x the requests' KV caches, unseen, with the budget back to 0), and `reclaim` frees them
    all. A second batch of the same shapes captures again and equals the first."""
    model = _model()
    CompiledRounds.for_model(model).emulate_graphs = True
    ps = [torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 12, 8)]
    cfg = lopa_fast.GenerateConfig(strategy="d2f", backend="fast", compile=True, **LOPA).bind(model)
    seen, reports = [], []

    def hook(prefix, info):  # the lanes while the requests run (the engine thread calls it)
        seen.append(held_lanes(model))

    engine = batch.BatchEngine(model, start=False)
    engine._on_held = reports.append  # what the server's budget hears (Worker passes on_held=budget.hold)
    first = _engine_run(engine, ps, cfg, hook)
    assert max(seen) > 0 and engine.max_live == 3
    share = sum(memory.resident_bytes(model, p.numel() + cfg.max_new_tokens, cfg) for p in ps)
    assert max(seen) <= share  # while they ran: within what the estimates reserve
    assert not engine._schedulers  # the scheduler (and its KV pool) went with its last request
    kept = held_lanes(model)
    assert kept > 0 and reports and reports[-1] == engine.held_bytes == kept  # the idle lanes: all counted
    engine.reclaim()  # what the server's budget asks when a request would wait
    deadline = time.monotonic() + 30
    while held_lanes(model) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held_lanes(model) == 0
    while reports[-1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reports[-1] == engine.held_bytes == 0
    again = _engine_run(batch.BatchEngine(model, start=False), ps, cfg)
    engine.close()
    for a, b in zip(first, again):
        assert a.generated_ids == b.generated_ids and a.stats["forwards"] == b.stats["forwards"]


def test_the_pool_grows_within_the_reservations_and_goes_when_idle():
    """Two requests, then a third admitted mid-flight: the pool grows to three slots (before: doubled to four, one
    slot no request reserved), and its bytes stay within the three requests' cache terms; the engine drops the
    scheduler, and with it the pool, when its last request ends."""
    model = _model()
    cfg = lopa_fast.GenerateConfig(strategy="lopa", backend="fast", branching_factor=2, **LOPA).bind(model)
    ps = [torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 9, 11)]
    sched = batch.Scheduler(model, cfg, spec=spec_of(cfg))
    for p in ps[:2]:
        sched.submit(p)
    sched.step()
    sched.submit(ps[2])
    sched.step()
    assert sched.pool.slots == 3, sched.pool.slots
    assert sched.pool.nbytes() <= sum(memory.cache_bytes(model, p.numel() + cfg.max_new_tokens) for p in ps)
    sched.run()
    engine = batch.BatchEngine(model, start=False)
    _engine_run(engine, ps, cfg)
    assert not engine._schedulers and engine.held_bytes == 0
    engine.close()


def test_the_pool_slots_are_capped_by_the_servers_length_limit(embedded):  # noqa: F811 - the fixture
    """The server's engine caps a pool slot at --max-model-len (before: no length cap)."""
    model, tok = embedded
    worker = Worker(model, tok, limits=Limits(max_model_len=100))
    try:
        assert worker.engine.slot_len == quantized_length(100) + 1
    finally:
        worker.close()


def test_the_budget_waits_for_what_the_engine_holds():
    """`held` (the engine's pools and lanes beyond the estimates) counts as used: a request that fits beside the
    running ones waits while held bytes fill the budget, asking the engine to free its idle lanes (`reclaim`), and
    goes once they are freed; with nothing running and nothing held it never waits."""
    asked = []
    budget = MemoryBudget(100, reclaim=lambda: asked.append(1))
    assert budget.reserve(40)
    budget.hold(50)
    got = []
    t = threading.Thread(target=lambda: got.append(budget.reserve(20)))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not got and asked  # 40 + 50 + 20 > 100: the engine was asked for its idle lanes
    budget.hold(0)
    t.join(5)
    assert got == [True] and budget.used == 60
    budget.release(60)
    assert budget.reserve(100)  # nothing running, nothing held: a request that fits alone goes
    budget.release(100)
    budget.hold(95)  # nothing running, idle lanes held: the request waits for the engine to free them
    budget.reclaim = lambda: budget.hold(0)
    assert budget.reserve(20) and budget.held == 0


def test_the_server_reports_held_bytes_and_frees_them(embedded, captured):  # noqa: F811 - the fixture
    """Through the server (serve --compile, captured, emulated): concurrent compiled requests, then nothing running:
    the reservation is 0 and the idle lanes are held bytes the budget counts (/metrics: lopa_fast_memory_held_bytes;
    before: 3 workspaces held 5.4 MiB, unseen, while the reservation was 0); a request that needs the whole budget
    frees them before it starts."""
    model, tok = embedded
    CompiledRounds.for_model(model).emulate_graphs = True
    worker = Worker(model, tok)
    srv = _Server(create_app(worker, model_id="m", defaults={**DEFAULTS, "compile": True}), worker.limits)
    try:
        bodies = [{"prompt": PROMPT, "strategy": "vanilla", "steps": 4, "max_tokens": 8 * (1 + i % 2)}
                  for i in range(4)]
        out = [None] * len(bodies)
        ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, _call(srv.url + "/v1/completions", bodies[i])))
              for i in range(len(bodies))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert all(s == 200 for s, _ in out), out
        kept = held_lanes(model)
        assert kept > 0 and worker.memory.used == 0 and worker.memory.held == worker.engine.held_bytes == kept
        status, text = _call(srv.url + "/metrics")
        assert status == 200 and f"lopa_fast_memory_held_bytes {float(kept)}" in text, text[-2000:]
        assert worker.memory.reserve(worker.memory.budget)  # the whole budget: the idle lanes go first
        assert held_lanes(model) == 0 and worker.memory.held == 0
        worker.memory.release(worker.memory.budget)
    finally:
        srv.close()
        worker.close()


def test_apd_estimate_counts_the_verifier():
    """APD with a verifier: the estimate holds the verifier's own cache (measured on the request's state: vk / vv)
    and its forward (before: no verifier term; `request_bytes` did not take one)."""
    from tests.utils import apd_models

    apd = apd_models()
    d, q = apd["d64"], apd["q64"]
    knobs = dict(strategy="apd", apd_mixture_weight=0.7, kv_window=4, max_lookahead=8, eos_token_id=62,
                 max_new_tokens=20)
    cfg = lopa_fast.GenerateConfig(backend="fast", **knobs).bind(d)
    prompt = torch.tensor([5, 9, 2])
    total = prompt.numel() + cfg.max_new_tokens
    dec = strategies.get("apd").load("driver")(d, prompt, cfg, verifier=q)
    vcache = sum(dec.st[k].numel() * dec.st[k].element_size() for k in ("vk", "vv"))
    logits = q.config.vocab_size * 4 * 4  # one position's float32 logits and their temporaries, at least
    alone = memory.request_bytes(d, total, cfg, prompt.numel())
    with_verifier = memory.request_bytes(d, total, cfg, prompt.numel(), q)
    assert with_verifier - alone >= vcache + logits, (with_verifier, alone, vcache)
    limits = Limits().bind(d)
    assert limits.check(d, cfg, prompt.numel(), q) == with_verifier


CAPPED = """
import json, resource, threading
import psutil, torch
torch.set_num_threads(1)
import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.decode.compiled import CompiledRounds
from lopa_fast.server import create_app
from lopa_fast.server.worker import Worker
from test_server_limits import DEFAULTS, PROMPT, _call, _Server
from test_server_memory import held_lanes
from utils import emulated_capture

CompiledRounds.capture = staticmethod(emulated_capture)  # the CUDA-graph path (lanes, captures) on the CPU
model = lopa_fast.load_model(model_dir(), dtype=torch.float32)
tok = lopa_fast.load_tokenizer(model_dir())
CompiledRounds.for_model(model).emulate_graphs = True
worker = Worker(model, tok)
srv = _Server(create_app(worker, model_id="m", defaults={**DEFAULTS, "compile": True}), worker.limits)
url = srv.url + "/v1/completions"
words = PROMPT.split()
def body(i):  # a prompt length per i: vanilla's step geometry is the exact length, so a workspace key per length
    return {"prompt": " ".join(words[: 4 + i % len(words)]), "strategy": "vanilla", "steps": 4,
            "max_tokens": __TOKENS__}
assert _call(url, body(0))[0] == 200  # every path warm before the cap
resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + (1 << 30), resource.RLIM_INFINITY))
rss0, peak_lanes, statuses = psutil.Process().memory_info().rss, [0], []
for wave in range(__WAVES__):  # pairs of concurrent requests of new shapes: batched lanes, padded to 2
    out = [None, None]
    ts = [threading.Thread(target=lambda j=j: out.__setitem__(j, _call(url, body(2 * wave + j)))) for j in (0, 1)]
    for t in ts: t.start()
    for t in ts: t.join(120)
    statuses += [o[0] for o in out]
    peak_lanes[0] = max(peak_lanes[0], held_lanes(model))
kept, held, used = held_lanes(model), getattr(worker.memory, "held", None), worker.memory.used
assert worker.memory.reserve(worker.memory.budget)  # a request that needs the whole budget: idle lanes go first
keys = len([k for k in CompiledRounds.for_model(model).workspaces if k[0] == "batch"])
res = {"statuses": statuses, "kept": kept, "held_kept": held, "lanes": held_lanes(model), "keys": keys,
       "used": used, "held": getattr(worker.memory, "held", 0),
       "rss_growth_mib": (psutil.Process().memory_info().rss - rss0) / 2**20}
worker.memory.release(worker.memory.budget)
srv.close(); worker.close()
print(json.dumps(res))
"""


def capped_compiled_server(waves: int, tokens: int) -> dict:
    """A compiling server (captured, emulated) in a subprocess under an address-space cap, serving `waves` pairs of
    concurrent requests, each pair of new shapes; what it holds afterwards."""
    return _subprocess(CAPPED.replace("__WAVES__", str(waves)).replace("__TOKENS__", str(tokens)), timeout=600)


@pytest.mark.parametrize("waves,tokens", [(3, 8), pytest.param(24, 64, marks=pytest.mark.slow)],
                         ids=["short", "full"])
def test_a_compiling_server_frees_its_lanes_under_a_cap(waves, tokens):
    """End to end, in a capped subprocess: after pairs of compiled requests of new shapes the idle lanes are all
    counted as held, and a request that needs the whole budget frees every one (before: a workspace per shape
    stayed, up to the LRU's 64 keys, unseen, while the reservation was back to 0)."""
    res = capped_compiled_server(waves, tokens)
    print("\ncapped compiling server:", res)
    assert res["statuses"] == [200] * (2 * waves), res
    assert res["kept"] > 0 and res["held_kept"] == res["kept"], res
    assert res["lanes"] == 0 and res["keys"] == 0 and res["held"] == 0, res
    assert res["used"] == 0, res
