"""The CPU thread policy of a decoding call (lopa_fast.request.threads): small models decode with one thread for the call
only (the process's count is restored, also across concurrent calls), large ones keep torch's; LOPA_FAST_THREADS
overrides it, and a bad value names the variable."""
import threading

import pytest
import torch

import lopa_fast
from lopa_fast.request import threads
from lopa_fast.errors import KnobError
from lopa_fast.testing import random_model, tiny_hf_config


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_model_decodes_with_one_thread_and_the_count_is_restored(two_threads, monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    model = random_model(tiny_hf_config("dream"), seed=0)
    seen = []
    out = lopa_fast.generate(model, [1, 2, 3], "d2f", block_size=4, max_new_tokens=8,
                             on_round=lambda p, i: seen.append(torch.get_num_threads()))
    assert seen and set(seen) == {1} and out.stats["forwards"] >= 1
    assert torch.get_num_threads() == 2  # the process's setting is what it was


def test_policy_choices(monkeypatch):
    small = random_model(tiny_hf_config("dream"), seed=0)
    big = type("Big", (), {"device": torch.device("cpu"), "config": type("C", (), dict(
        hidden_size=2048, head_dim=128, num_heads=16, num_kv_heads=8, intermediate_size=8192, num_layers=24))()})()
    monkeypatch.delenv(threads.ENV, raising=False)
    assert threads.threads_for(small) == 1 and threads.threads_for(big) is None
    monkeypatch.setenv(threads.ENV, "keep")
    assert threads.threads_for(small) is None
    monkeypatch.setenv(threads.ENV, "3")
    assert threads.threads_for(small) == threads.threads_for(big) == 3
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv(threads.ENV, bad)
        with pytest.raises(KnobError, match=f"LOPA_FAST_THREADS='{bad}'; allowed: 'auto', 'keep' or an int >= 1"):
            threads.threads_for(small)


def test_concurrent_calls_scope_their_own_thread(two_threads, monkeypatch):
    """Overlapping scoped calls on several threads: each runs with one thread and gets its own count back; the
    main thread's count is not touched."""
    monkeypatch.delenv(threads.ENV, raising=False)
    model = random_model(tiny_hf_config("dream"), seed=0)
    inside, go = threading.Barrier(3, timeout=30), threading.Event()
    seen, after = [], []

    def call():
        torch.set_num_threads(2)
        with threads.scoped(model):
            inside.wait()
            seen.append(torch.get_num_threads())
            go.wait(30)
        after.append(torch.get_num_threads())

    ts = [threading.Thread(target=call, daemon=True) for _ in range(2)]
    for t in ts:
        t.start()
    inside.wait()
    main_during = torch.get_num_threads()
    go.set()
    for t in ts:
        t.join(30)
    assert seen == [1, 1] and after == [2, 2] and main_during == torch.get_num_threads() == 2
