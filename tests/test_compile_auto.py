"""compile=None (the default, "auto"): captured on CUDA, eager on CPU, never instead of batching; a capture that
fails falls back to the eager step with a warning (compile=True makes it an error)."""
import pytest
import torch

import lopa_fast
from lopa_fast.decode import compiled
from lopa_fast.decode.compiled import CompiledRounds, compile_wanted
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import spec_of

KW = dict(strategy="lopa", branching_factor=2, block_size=4, max_new_tokens=12)


def test_who_compiles():
    cfg = lopa_fast.GenerateConfig
    assert cfg().compile is None  # the default is auto
    assert compile_wanted(cfg(), "cuda") and not compile_wanted(cfg(), "cpu")
    assert not compile_wanted(cfg(distributed=True), "cuda")  # distributed rounds: eager unless asked
    assert compile_wanted(cfg(compile=True), "cpu") and not compile_wanted(cfg(compile=False), "cuda")
    from lopa_fast.decode.batch import batchable

    assert batchable(cfg(), spec_of(cfg())) and batchable(cfg(compile=True), spec_of(cfg(compile=True)))  # compiled requests batch too (compiled_batch)


def test_failed_capture_falls_back_to_eager_with_a_warning(monkeypatch):
    model = random_model(tiny_hf_config("dream"), seed=1, sharpen=6)
    ids = [3, 4, 5, 6]
    eager = lopa_fast.generate(model, ids, compile=False, **KW)
    # the CUDA path on CPU: every request "captures", and every capture fails
    monkeypatch.setattr(compiled, "compile_wanted", lambda cfg, device: cfg.compile is not False)
    cr = CompiledRounds.for_model(model)
    monkeypatch.setattr(cr, "emulate_graphs", True)

    def broken(warmup, body):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(broken))
    with pytest.warns(RuntimeWarning, match="compile \\(auto\\): capturing the step .* failed .*runs eagerly"):
        auto = lopa_fast.generate(model, ids, **KW)
    assert auto.generated_ids == eager.generated_ids and auto.stats["forwards"] == eager.stats["forwards"]
    assert auto.stats["compiled_graphs"] == 0
    cr.fns.clear()
    with pytest.raises(RuntimeError, match="stream is capturing"):
        lopa_fast.generate(model, ids, compile=True, **KW)
    cr.fns.clear()
    cr.workspaces.clear()


def test_compiled_buckets_are_bounded():
    """At most `cap` buckets per model, the least recently used out (a client cycling float knobs cannot grow
    graph memory without bound); a bucket asked again after its eviction compiles again."""
    from lopa_fast.decode.compiled import LRU

    lru = LRU(2)
    lru["a"], lru["b"] = 1, 2
    assert lru.get("a") == 1  # "a" is now the most recent
    lru["c"] = 3
    assert list(lru) == ["a", "c"] and lru.evicted == 1 and lru.get("b") is None
    cr = CompiledRounds(cap=2)  # a fresh one (not the model's shared one), so this test stands alone
    made = []

    def make(tag):
        def step(st, T):
            return st, {}

        made.append(tag)
        return step

    st = {"x": torch.zeros(3, dtype=torch.long)}
    import unittest.mock as mock

    with mock.patch.object(torch, "compile", lambda fn, **kw: fn):
        for temp in (0.1, 0.2, 0.3, 0.1):
            cr.call(("steps", temp), (temp,), f"t{temp}", lambda t=temp: make(t), st, {})
    assert made == [0.1, 0.2, 0.3, 0.1] and len(cr.fns) == 2 and cr.fns.evicted == 2


def test_request_stats_are_per_thread():
    """Two requests compiling on two threads at once: each one's compiled_graphs / buckets / seconds are its own
    (they used to share one counter on the model's CompiledRounds)."""
    import threading
    import unittest.mock as mock

    cr = CompiledRounds(cap=8)
    st = {"x": torch.zeros(3, dtype=torch.long)}
    barrier, seen = threading.Barrier(2, timeout=30), {}

    def request(tag, buckets):
        cr.view()  # this thread's view
        cr._local.graphs, cr._local.buckets, cr._local.seconds = 0, set(), {}
        barrier.wait()
        for b in buckets:
            cr.call(("t", b), (b,), f"b{b}", lambda: (lambda s, T: (s, {})), st, {})
        seen[tag] = cr.stats()

    with mock.patch.object(torch, "compile", lambda fn, **kw: fn), mock.patch.object(compiled, "_dynamo_graphs",
                                                                                        lambda: 0):
        ts = [threading.Thread(target=request, args=("a", (1, 2))), threading.Thread(target=request, args=("b", (3,)))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
    assert seen["a"]["compiled_buckets"] == [(1,), (2,)] and set(seen["a"]["compile_seconds"]) == {"b1", "b2"}
    assert seen["b"]["compiled_buckets"] == [(3,)] and set(seen["b"]["compile_seconds"]) == {"b3"}
