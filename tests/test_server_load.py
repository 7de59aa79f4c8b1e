"""Issue 28: the server under load and abuse (bounded, loopback only, in process on the embedded model).

N concurrent clients send a mix of strategies (lopa k = 4 / 8 / 16, d2f, vanilla, threshold) interleaved with
abusive bodies (bad JSON, a 5,000-digit integer, deep nesting, an over-size body, a branching factor of a
million, unknown fields, nulls, wrong types, token-id stops past the vocabulary), while a prober polls /health.
Asserted: every good answer equals the same request served alone, no 5xx at all, every abusive body a 4xx, /health
answered throughout (each call within a generous hang guard), the process' RSS growth bounded. The short form
(16 clients x 4 requests) runs by default; the full one (64 clients x 12) under -m slow. Each prints its figures:

    python -m pytest -q -s tests/test_server_load.py            # short
    python -m pytest -q -s -m slow tests/test_server_load.py    # full
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from test_server_limits import DEFAULTS, HANG_S, PROMPT, _call, _Server, embedded  # noqa: F401 - the fixture

from lopa_fast.server import create_app
from lopa_fast.server.limits import Limits
from lopa_fast.server.worker import Worker

PROMPTS = [PROMPT, "Ann has 9 apples . She eats 2 . How many apples ? Answer :",
           "Bob has 3 boxes with 5 cars in each . How many cars ? Answer :"]
GOOD = [
    {},
    {"branching_factor": 8},
    {"branching_factor": 16},
    {"strategy": "d2f", "branching_factor": 1},
    {"strategy": "vanilla", "steps": 32, "seed": 7},  # Dream's default alg draws its order: seeded
    {"strategy": "threshold", "threshold": 0.9},
    {"temperature": None, "stop": None, "max_tokens": 16},
]
ABUSE = [
    b"{not json",
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b"[" * 50_000 + b"]" * 50_000,
    json.dumps({"prompt": "pens " * 60_000}).encode(),  # ~300 KB > the 128 KiB cap below
    json.dumps({"prompt": PROMPT, "branching_factor": 1_000_000}).encode(),
    json.dumps({"prompt": PROMPT, "frobnicate": 1}).encode(),
    json.dumps({"prompt": PROMPT, "n": True}).encode(),
    json.dumps({"prompt": PROMPT, "stop": [[10_000]]}).encode(),
    json.dumps({"prompt": PROMPT, "max_tokens": -5}).encode(),
    json.dumps({"prompt": [1, 2, 10**30]}).encode(),
    json.dumps({"messages": "hi"}).encode(),
    json.dumps({"prompt": "Tom has \ud800 pens"}).encode(),  # a lone surrogate (issue 36)
    json.dumps({"prompt": [2, 5, 99_999]}).encode(),  # an id past the vocabulary: blamed on prompt
]


def _good(i: int) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], **GOOD[i % len(GOOD)]}


def _run_load(embedded, clients: int, per_client: int) -> dict:
    model, tok = embedded
    worker = Worker(model, tok, limits=Limits(max_body_bytes=128 << 10))
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS), worker.limits)
    url = srv.url + "/v1/completions"
    proc = psutil.Process()
    try:
        n_good = len(PROMPTS) * len(GOOD)
        solo = {}
        for i in range(n_good):  # every distinct good request alone first (also warms every path)
            status, body = _call(url, _good(i))
            assert status == 200, body
            solo[i] = body["choices"][0]["text"]
        rss0 = proc.memory_info().rss
        stop, health = threading.Event(), []

        def probe():
            while not stop.is_set():
                t0 = time.perf_counter()
                status, _ = _call(srv.url + "/health")
                health.append((status, time.perf_counter() - t0))
                time.sleep(0.05)

        def client(c: int) -> list:
            out = []
            for j in range(per_client):
                n = c * per_client + j
                if n % 3 == 2:  # a third of the traffic abusive
                    raw = ABUSE[n % len(ABUSE)]
                    try:
                        status, body = _call(url, raw=raw)
                    except OSError:  # a 413 sent while the client still uploads may reach it as a reset
                        status, body = 413, None
                    out.append(("abuse", n % len(ABUSE), status, body))
                else:
                    i = n % n_good
                    status, body = _call(url, _good(i))
                    out.append(("good", i, status, body))
            return out

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as ex:
            results = [r for rs in ex.map(client, range(clients)) for r in rs]
        wall = time.perf_counter() - t0
        stop.set()
        prober.join(HANG_S)
        rss_growth = proc.memory_info().rss - rss0
        for kind, i, status, body in results:
            assert status < 500, (kind, i, status, body)
            if kind == "good":
                assert status == 200 and body["choices"][0]["text"] == solo[i], (i, status, body)
            else:
                assert 400 <= status < 500, (i, status, body)
        assert health and all(s == 200 for s, _ in health)
        lat = sorted(s for _, s in health)
        figures = {"clients": clients, "requests": len(results), "good": sum(r[0] == "good" for r in results),
                   "wall_s": round(wall, 2), "health_calls": len(lat),
                   "health_p50_s": round(statistics.median(lat), 4), "health_max_s": round(lat[-1], 4),
                   "rss_growth_mib": round(rss_growth / 2**20, 1), "max_batch": worker.engine.max_live}
        print("\nload figures:", json.dumps(figures))
        assert rss_growth < 512 << 20, figures
        return figures
    finally:
        srv.close()
        worker.close()


def test_load_and_abuse_short(embedded):  # noqa: F811 - the fixture
    _run_load(embedded, clients=16, per_client=4)


@pytest.mark.slow
def test_load_and_abuse_full(embedded):  # noqa: F811
    _run_load(embedded, clients=64, per_client=12)
