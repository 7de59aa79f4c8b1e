"""The server resolves a request once (issue 44): protocol.parse checks it and builds its Plan
(lopa_fast.request.plan.Plan: the bound config with its stops and seed), the worker runs that plan as it is (no
second validation, no second plan), and a batched request's pieces reach the event loop from the engine thread that
runs its rounds (no stream thread relaying them). Answers equal generate's."""
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
    threads_of_pieces = set()
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
        if kind == "piece":
            threads_of_pieces.add(threading.current_thread().name)
        return emit(self, kind, value)

    monkeypatch.setattr(worker_mod.Handle, "emit", traced_emit)
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
    # a batched request's pieces are emitted by the engine thread that runs its rounds
    assert threads_of_pieces <= {"lopa_fast.batch_engine", "lopa_fast.server.worker.0"} and threads_of_pieces, \
        threads_of_pieces
    assert "lopa_fast.stream" not in threads_of_pieces
