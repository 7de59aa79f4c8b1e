"""The server resolves a request once (issue 44): protocol.parse checks it and builds its Plan
(lopa_fast.request.plan.Plan: the bound config with its stops and seed), the worker runs that plan as it is (no
second validation, no second plan), and hands a batched request to the engine ONCE: its pieces and its end reach the
event loop from the engine thread that runs its rounds (no job thread queues it or waits on it, no stream thread
relays it). Answers equal generate's."""
from __future__ import annotations

import json
import threading

import pytest
import torch

import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.config import GenerateConfig
from lopa_fast.request import plan as plan_mod
from lopa_fast.request.text import answer_text, encode_prompt, text_decoder

DEFAULTS = dict(strategy="lopa", block_size=8, branching_factor=2, max_new_tokens=16, temperature=0.0)
PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . How many pens does Tom have now ? Answer :"


@pytest.fixture(scope="module")
def embedded():
    return lopa_fast.load_model(model_dir(), dtype=torch.float32), lopa_fast.load_tokenizer(model_dir())


@pytest.mark.parametrize("stream", [False, True])
def test_one_validation_one_plan_and_no_relay_thread(embedded, monkeypatch, stream):
    from fastapi.testclient import TestClient

    from lopa_fast.server import create_app
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    counts = {"validate": 0, "make": 0}
    threads_of = {"piece": set(), "end": set()}  # the threads that hand the request's events to the event loop
    real_validate, real_make = GenerateConfig.validate, plan_mod.make

    def validate(self, *a, **kw):
        counts["validate"] += 1
        return real_validate(self, *a, **kw)

    def make(*a, **kw):
        counts["make"] += 1
        return real_make(*a, **kw)

    worker = Worker(model, tok)
    from lopa_fast.server import worker as worker_mod

    emit = worker_mod.Handle.emit

    def traced_emit(self, kind, value=None):
        threads_of["piece" if kind == "piece" else "end"].add(threading.current_thread().name)
        return emit(self, kind, value)

    monkeypatch.setattr(worker_mod.Handle, "emit", traced_emit)
    queued = []  # what reaches the job threads' queue (requests the engine does not cover)
    put = worker._queue.put
    monkeypatch.setattr(worker._queue, "put", lambda item, *a, **k: (queued.append(item), put(item, *a, **k)))
    try:
        with TestClient(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS)) as c:
            monkeypatch.setattr(GenerateConfig, "validate", validate)
            monkeypatch.setattr(plan_mod, "make", make)
            body = {"prompt": PROMPT, "max_tokens": 16, "stop": ["\n\n", [7, 7]], "stream": stream}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            monkeypatch.setattr(GenerateConfig, "validate", real_validate)
            monkeypatch.setattr(plan_mod, "make", real_make)
            if stream:
                pieces = [ln for ln in r.text.splitlines() if ln.startswith("data: {")]
                text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in pieces)
            else:
                text = r.json()["choices"][0]["text"]
    finally:
        worker.close()
    # stage 1 validates the knobs, stage 3 the token-id stops; the worker validates nothing again, plans nothing
    assert counts == {"validate": 2, "make": 0}, counts
    # the answer is generate's (the same knobs, stops and prompt)
    ids = encode_prompt(tok, PROMPT)
    out = lopa_fast.generate(model, ids, **{**DEFAULTS, "max_new_tokens": 16}, stop=[[7, 7]])
    assert text == answer_text(out, text_decoder(tok), model.eos_token_id, ["\n\n"])
    # one hand-off: the batched request's pieces and its end are emitted by the engine thread that runs its rounds;
    # it never reached a job thread (before: a job thread waited on the engine and emitted the end)
    assert threads_of == {"piece": {"lopa_fast.batch_engine"}, "end": {"lopa_fast.batch_engine"}}, threads_of
    assert [item for item in queued if item is not None] == []  # None: close()'s stop markers


def test_requests_waiting_for_a_seat_go_in_order_when_one_ends(embedded, monkeypatch):
    """--max-num-seqs 1: of three concurrent requests on the engine, one decodes and two wait on the event loop
    (`_pump`); each takes the seat when the one before it ends: `_end` wakes the pump (the engine thread sets its
    event), first come first served, and each answer equals generate's."""
    import asyncio

    from lopa_fast.server.limits import Limits
    from lopa_fast.server.worker import Job, Worker

    model, tok = embedded
    worker = Worker(model, tok, limits=Limits(max_num_seqs=1))
    ids = encode_prompt(tok, PROMPT, chat=False)
    wakes = []

    class CountedEvent(asyncio.Event):  # the pump's event, counted from its creation (no race with request 1's end)
        def set(self):
            wakes.append(1)
            super().set()

    monkeypatch.setattr(asyncio, "Event", CountedEvent)
    # request 1's end waits until all three are submitted: on a busy machine its 8 tokens could otherwise be decoded
    # between two submits, and request 2 would take the free seat without waiting (seen in a fresh-clone CI run)
    submitted = threading.Event()
    end = worker._end

    def gated_end(*a):
        submitted.wait(60)
        return end(*a)

    monkeypatch.setattr(worker, "_end", gated_end)

    async def run():
        handles = [worker.submit(Job(ids, dict(DEFAULTS, max_new_tokens=8 * (1 + i)))) for i in range(3)]
        assert worker.counts["running"] == 1 and len(worker._waiting) == 2
        submitted.set()
        ends = []
        for h in handles:
            async for kind, value in h.events():
                if kind != "piece":
                    ends.append((kind, value))
        return handles, ends

    try:
        handles, ends = asyncio.run(run())
    finally:
        worker.close()
    assert [k for k, _ in ends] == ["done"] * 3
    assert handles[0].started < handles[1].started < handles[2].started  # first come, first served
    assert len(wakes) >= 2  # the two waiting requests were handed off on a wake-up, not on a poll
    for i, (_, fin) in enumerate(ends):
        want = lopa_fast.generate(model, ids, **dict(DEFAULTS, max_new_tokens=8 * (1 + i)))
        assert list(fin.result.generated_ids) == list(want.generated_ids)
