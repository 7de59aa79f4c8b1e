"""Issue 43: a server that long stop lists, slow clients and shutdown cannot take down. Here: the caps on `stop`
(count and bytes, a lone surrogate named), HEAD /health, and compile failures that fall back to eager.

Parse-level checks run on the embedded model without a server (milliseconds); the big stop list's full probe
(60,000 stops, as the issue's) is under `slow`."""
from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.config import MAX_STOP_SEQUENCES
from lopa_fast.server.protocol import MAX_STOP_BYTES, RequestError, parse
from lopa_fast.tasks.evaluate import GEN_LEN, ROWS

PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . How many pens ? Answer :"
DEFAULTS = dict(ROWS["lopa-k4"], max_new_tokens=GEN_LEN, temperature=0.0)


@pytest.fixture(scope="module")
def embedded():
    return lopa_fast.load_model(model_dir(), dtype=torch.float32), lopa_fast.load_tokenizer(model_dir())


def _parse(embedded, **body):
    model, tok = embedded
    return parse({"prompt": PROMPT, **body}, "completions", model, tok, DEFAULTS)


def test_stop_count_cap_is_a_400_naming_the_field_and_the_limit(embedded):
    stops = [f"w{i}" for i in range(MAX_STOP_SEQUENCES + 1)]
    with pytest.raises(RequestError) as e:
        _parse(embedded, stop=stops)
    assert e.value.status == 400 and e.value.param == "stop"
    assert f"at most {MAX_STOP_SEQUENCES}" in str(e.value) and str(MAX_STOP_SEQUENCES + 1) in str(e.value)
    assert _parse(embedded, stop=stops[:MAX_STOP_SEQUENCES]).stop == stops[:MAX_STOP_SEQUENCES]  # at the cap: fine


def test_stop_bytes_cap_is_a_400_naming_the_field_and_the_limit(embedded):
    big = ["x" * (MAX_STOP_BYTES // 2 + 1)] * 2
    with pytest.raises(RequestError) as e:
        _parse(embedded, stop=big)
    assert e.value.param == "stop" and f"at most {MAX_STOP_BYTES}" in str(e.value)


def test_a_lone_surrogate_in_stop_names_the_field(embedded):
    with pytest.raises(RequestError) as e:
        _parse(embedded, stop=["ok", "a\ud800b"])
    assert e.value.status == 400 and e.value.param == "stop"
    assert "stop[1]" in str(e.value) and "U+D800" in str(e.value)


@pytest.mark.parametrize("n", [6_000, pytest.param(60_000, marks=pytest.mark.slow)])
def test_a_huge_stop_list_is_refused_before_any_tokenisation(embedded, n, monkeypatch):
    """The issue's probe: 60,000 stops (720 KB) took 4.6 s to refuse (each one tokenised first, holding the GIL
    from a normal request beside it); the cap refuses before tokenising any."""
    model, tok = embedded
    calls = []
    real = type(tok).__call__

    def counting(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    stops = [f"stop {i} ." for i in range(n)]
    monkeypatch.setattr(type(tok), "__call__", counting)
    _parse(embedded)
    prompt_calls = len(calls)  # the prompt's own tokenisation
    calls.clear()
    t0 = time.perf_counter()
    with pytest.raises(RequestError) as e:
        _parse(embedded, stop=stops)
    seconds = time.perf_counter() - t0
    assert e.value.param == "stop" and f"{n} sequences" in str(e.value)
    assert len(calls) <= prompt_calls, f"{len(calls) - prompt_calls} stops tokenised before the refusal"
    print(f"{n} stops refused in {seconds * 1e3:.1f} ms")  # the bench figure; no wall-clock assertion


def test_head_health_is_200(embedded):
    from fastapi.testclient import TestClient

    from lopa_fast.server import create_app
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    worker = Worker(model, tok)
    try:
        with TestClient(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS)) as c:
            r = c.head("/health")
            assert r.status_code == 200, r.status_code
            assert c.get("/health").json()["status"] == "ok"
    finally:
        worker.close()


# -- finding 6: any compile failure runs the step eagerly, with one warning, and a clean cache next time -----------

def test_any_compile_failure_runs_eagerly_with_one_warning_and_a_clean_cache(embedded, monkeypatch):
    """Before: only dlopen's messages were handled; a C++ compile error (a cut-short cached ISA probe library)
    failed every compile=True request for good. Inductor's failure is stood in for (a real build takes 25-100 s
    per graph on CPU): the compiled callable raises what Inductor raises, wrapped as Dynamo wraps it."""
    import copy
    import os

    from lopa_fast.decode import compiled

    model, tok = embedded
    before = compiled.inductor_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)  # restored after the test
    calls = []

    def broken_compile(fn, **kw):
        def call(*a, **k):
            calls.append(fn.__name__)
            try:
                raise RuntimeError("C++ compile error\n/tmp/x.cpp:1: error: 'at' was not declared in this scope")
            except RuntimeError as e:
                raise RuntimeError("backend='inductor' raised:\nCppCompileError: C++ compile error") from e
        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    ids = tok(PROMPT)["input_ids"]
    knobs = dict(strategy="threshold", threshold=0.9, max_new_tokens=32)
    eager = lopa_fast.generate(model, ids, **knobs)
    fresh = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lopa_fast.generate(fresh, ids, compile=True, **knobs)
        again = lopa_fast.generate(fresh, ids, compile=True, **knobs)  # the same steps: eager now, no new warning
    assert calls, "the compiled path was not taken"
    assert out.generated_ids == again.generated_ids == eager.generated_ids
    failed = [str(w.message) for w in caught if "failed (RuntimeError" in str(w.message)]
    assert len(failed) == len(set(calls)) >= 1, [str(w.message) for w in caught]  # one per compiled step, once
    clean = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert clean != before and os.path.isdir(clean) and not os.listdir(clean) and clean in failed[0]


def test_an_out_of_memory_error_in_a_compiled_step_still_propagates(monkeypatch):
    """The server's out-of-memory recovery needs the error: the guard does not turn it into an eager rerun."""
    from lopa_fast.decode import compiled

    def oom_compile(fn, **kw):
        def call(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return call

    monkeypatch.setattr(torch, "compile", oom_compile)
    ran = []
    step = compiled.compile_guarded(lambda x: ran.append(x) or x, "a step")
    with pytest.raises(torch.OutOfMemoryError):
        step(1)
    assert not ran


# -- finding 1: trickled bodies must not keep every connection slot -------------------------------------------------

def _trickle(srv, n: int, key: str | None, stop: threading.Event):
    """n connections, each a full POST head then its body a byte every 0.2 s until `stop` (or the server closes)."""
    import socket

    socks = []
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                  f"Content-Length: 100000\r\n\r\n".encode())
        socks.append(s)

    def run():
        while not stop.is_set():
            for s in list(socks):
                try:
                    s.send(b" ")
                except OSError:
                    socks.remove(s)  # the server closed it: the slot is free
            stop.wait(0.2)
        for s in socks:
            s.close()


    threading.Thread(target=run, daemon=True).start()
    return socks


@pytest.mark.parametrize("n,with_key", [(70, True), (70, False),
                                        pytest.param(255, True, marks=pytest.mark.slow),
                                        pytest.param(255, False, marks=pytest.mark.slow)])
def test_trickled_bodies_free_their_slots(embedded, n, with_key):
    """Before: every trickled connection kept its slot after its 408 (or its 401, which never read the body):
    /health and completions 503 for as long as the trickle went on (80 s in the issue's probe). The slot is freed
    at the body deadline (1 s here) whether or not the request carries a key."""

    from test_server_limits import KEY, _call, _Server

    from lopa_fast.server import create_app
    from lopa_fast.server.limits import Limits
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    worker = Worker(model, tok, limits=Limits(read_timeout_s=1.0))
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS, api_key=KEY), worker.limits)
    stop = threading.Event()
    try:  # uvicorn_config's connection cap is max(64, 4 * max_pending) = 256: n >= 64 fills the short form's
        socks = _trickle(srv, n, KEY if with_key else None, stop)
        deadline = time.monotonic() + 10
        while socks and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not socks, f"{len(socks)} of {n} trickled connections still open 10 s after the 1 s body deadline"
        print(f"{n} trickled bodies (key: {with_key}): all closed {time.monotonic() - deadline + 10:.1f} s after "
              "their heads")  # the bench figure; no wall-clock assertion
        status, body = _call(srv.url + "/health")
        assert status == 200, body
        status, body = _call(srv.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8},
                             headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200, body
    finally:
        stop.set()
        srv.close()
        worker.close()


@pytest.mark.parametrize("n", [70, pytest.param(255, marks=pytest.mark.slow)])
def test_trickled_keyed_bodies_are_cut_at_the_minimum_rate_not_the_read_timeout(embedded, n):
    """Before: a request with a valid key trickling its body held its slot up to the read timeout (30 s by
    default), so 255 of them kept /health at 503 that long. With the minimum body rate (default 1,024 bytes/s after
    a 2 s grace, Apache mod_reqtimeout's MinRate) they are cut (408, closed) seconds after their heads, the read
    timeout left at its default."""
    from test_server_limits import KEY, _call, _Server

    from lopa_fast.server import create_app
    from lopa_fast.server.limits import BODY_GRACE_S, Limits
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    worker = Worker(model, tok, limits=Limits())
    assert worker.limits.read_timeout_s == 30.0 and worker.limits.min_body_rate == 1024
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS, api_key=KEY), worker.limits)
    stop = threading.Event()
    try:
        t0 = time.monotonic()
        socks = _trickle(srv, n, KEY, stop)
        while socks and time.monotonic() < t0 + 4 * BODY_GRACE_S + 5:
            time.sleep(0.2)
        assert not socks, f"{len(socks)} of {n} keyed trickled connections still open {time.monotonic() - t0:.0f} s " \
                          "after their heads (the read timeout is 30 s)"
        print(f"{n} keyed trickled bodies: all closed {time.monotonic() - t0:.1f} s after their heads")
        status, body = _call(srv.url + "/health")
        assert status == 200, body
    finally:
        stop.set()
        srv.close()
        worker.close()


def test_a_slow_but_steady_body_is_read(embedded):
    """The rate rule cuts trickles, not slow links: a 12 KB body sent in 3 s (4 KB/s, over the 1,024 bytes/s
    minimum; longer than the 2 s grace) is read and answered."""
    import json as json_
    import socket

    from test_server_limits import KEY, _Server

    from lopa_fast.server import create_app
    from lopa_fast.server.limits import Limits
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    worker = Worker(model, tok, limits=Limits())
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS, api_key=KEY), worker.limits)
    try:
        body = json_.dumps({"prompt": PROMPT, "max_tokens": 4, "user": "x" * 12_000}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), 400):  # 400 bytes every 0.1 s: ~4 KB/s
            s.sendall(body[i: i + 400])
            time.sleep(0.1)
        reply = s.recv(65536).decode(errors="replace")
        s.close()
        assert reply.startswith("HTTP/1.1 200"), reply[:300]
    finally:
        srv.close()
        worker.close()


# -- finding 3: past the drain deadline every request still gets an answer ---------------------------------------------

def _stream_events(url: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed completion, until the server ends or closes the stream."""
    import json as json_
    import urllib.request

    req = urllib.request.Request(url, data=json_.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    out.append(line[6:])
    except OSError as e:
        out.append(f"<closed: {type(e).__name__}>")
    return out


@pytest.mark.parametrize("n", [3, pytest.param(12, marks=pytest.mark.slow)])
def test_requests_outliving_the_drain_deadline_get_a_503_or_an_error_event_and_done(embedded, monkeypatch, n):
    """Before: with --drain-timeout 1, 12 non-streamed requests got no response and 12 streams were cut without
    an error event or [DONE]. Now the drain clock (started by serve's server at the first signal) ends them a
    margin before uvicorn's deadline: each non-streamed one gets a 503 naming the shutdown, each stream an error
    event and `data: [DONE]`; a request arriving during the drain is refused with the same 503."""
    import signal

    from test_server_limits import _call, _free_port

    from lopa_fast.server import _server_class, create_app, uvicorn_config
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    real = model.forward_requests
    monkeypatch.setattr(model, "forward_requests", lambda *a, **k: (time.sleep(0.2), real(*a, **k))[1])
    worker = Worker(model, tok)
    app = create_app(worker, model_id="d2f-arith", defaults=DEFAULTS)
    port = _free_port()
    server = _server_class(on_exit=lambda: app.state.drain.start(1.0))(uvicorn_config(
        app, host="127.0.0.1", port=port, limits=worker.limits, log_level="critical", drain_timeout_s=1.0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": PROMPT, "strategy": "d2f", "branching_factor": 1, "max_tokens": 96}  # ~30 s each, slowed
    plain, streams = [None] * n, [None] * n

    def run_plain(i):
        try:
            plain[i] = _call(url, body)
        except OSError as e:
            plain[i] = ("closed", type(e).__name__)

    def run_stream(i):
        streams[i] = _stream_events(url, body)

    threads = [threading.Thread(target=run_plain, args=(i,)) for i in range(n)] + \
        [threading.Thread(target=run_stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while worker.counts["running"] + worker.counts["pending"] < 2 * n:
            assert time.monotonic() < deadline, worker.counts
            time.sleep(0.05)
        time.sleep(0.5)
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        for t in threads:
            t.join(30)
    finally:
        server.should_exit = True
        thread.join(30)
        worker.close(timeout=30)
    for status, reply in plain:
        assert status == 503 and reply["error"]["code"] == "shutting_down", (status, reply)
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        assert "shutting_down" in events[-2], events[-3:]
    print(f"{n} requests and {n} streams past a 1 s drain deadline: all answered (503 / error event + [DONE])")


def test_a_request_during_the_drain_is_refused_at_once(embedded):
    from fastapi.testclient import TestClient

    from lopa_fast.server import create_app
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    worker = Worker(model, tok)
    try:
        app = create_app(worker, model_id="d2f-arith", defaults=DEFAULTS)
        with TestClient(app) as c:
            app.state.drain.start(30.0)
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    finally:
        worker.close()


# -- finding 5: a per-step watchdog ----------------------------------------------------------------------------------

def test_a_hung_step_fails_its_requests_and_health_says_so_until_it_returns(embedded, monkeypatch):
    """Before: a stalled engine read "ok" and its requests waited for ever. With --step-timeout (1 s here) a batched
    step that hangs fails the requests waiting on it (503 `step_timeout`), /health is 503 naming the stalled step,
    new requests are refused at once; when the step returns, /health is ok again and requests are served."""
    from fastapi.testclient import TestClient

    from lopa_fast.server import create_app
    from lopa_fast.server.limits import Limits
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    release, hung = threading.Event(), threading.Event()
    real = model.forward_requests

    def hanging(*a, **k):
        if not release.is_set():
            hung.set()
            release.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(model, "forward_requests", hanging)
    worker = Worker(model, tok, limits=Limits(step_timeout_s=1.0))
    try:
        with TestClient(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS)) as c:
            body = {"prompt": PROMPT, "max_tokens": 8}
            t0 = time.monotonic()
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "step_timeout", r.text
            assert hung.is_set() and time.monotonic() - t0 < 30
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["stalled_step_s"] >= 1.0, h.text
            r = c.post("/v1/completions", json=body)  # refused at once while the step hangs
            assert r.status_code == 503 and "--step-timeout" in r.json()["error"]["message"], r.text
            release.set()
            deadline = time.monotonic() + 30
            while c.get("/health").status_code != 200:
                assert time.monotonic() < deadline, c.get("/health").text
                time.sleep(0.1)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    finally:
        release.set()
        worker.close()


# -- finding 4: the memory estimate at a large vocabulary ---------------------------------------------------------------

VOCAB_PEAK = r"""
import json, sys, warnings, torch, lopa_fast
from lopa_fast import memory
from lopa_fast.config import GenerateConfig
from lopa_fast.testing import peak_tensor_bytes, random_model, tiny_hf_config
warnings.simplefilter("ignore")
torch.set_num_threads(1)
V, k, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = random_model(tiny_hf_config("dream", vocab_size=V), seed=0, sharpen=1.0)
ids = list(range(3, 23))
knobs = dict(strategy="lopa", max_new_tokens=N, block_size=32)
lopa_fast.generate(model, ids, **{**knobs, "branching_factor": 2, "max_new_tokens": 32})  # warm: the allocator
peak, out = peak_tensor_bytes(lopa_fast.generate, model, ids, **{**knobs, "branching_factor": k})
cfg, _ = GenerateConfig(**{**knobs, "branching_factor": k}).validate().plan_length(model, len(ids))
cfg = cfg.resolve(model)
print(json.dumps([peak, memory.request_bytes(model, len(ids) + N, cfg, 20),
                  out.stats["max_branches"]]))
"""


@pytest.mark.parametrize("k,n", [(4, 32), pytest.param(16, 64, marks=pytest.mark.slow)])
def test_the_memory_estimate_at_a_131k_vocabulary_is_an_upper_bound_within_3x(k, n):
    """Before: LoPA k = 16, 64 tokens at a 131,072-id vocabulary was estimated at ~4.3 GiB (every window row's
    logits with four float32 temporaries) and really peaked at +2.4 GiB (the statistics held ~5 [R, V] tensors);
    the issue's probe measured ~19x between them. Now the round's statistics run in row chunks and read the stale
    last_logit row as its own block (no [R + 1, V] copy), so the real peak is +0.55 GiB, and the estimate counts the
    LM-head rows a fast round can have (new tokens + 1 per branch row) plus one chunk: ~1.05 GiB, an upper bound
    within ~2x. In a subprocess, the peak of live tensor bytes (the profiler's allocator records, replayed) is within
    [estimate / 3, estimate]; k = 4 in CI, the issue's k = 16 and 64 tokens under slow."""
    import json as json_
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", VOCAB_PEAK, "131072", str(k), str(n)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    real, est, branches = json_.loads(r.stdout.strip().splitlines()[-1])
    assert branches == k + 1  # every lookahead branch alive at once: the LM head's worst case ran
    msg = f"131k vocabulary, k = {k}, {n} tokens: live tensors +{real / 2**20:.0f} MiB, estimate {est / 2**20:.0f} MiB"
    print(msg)
    assert real <= est <= 3 * real, msg  # measured: 170 / 365 MiB at k = 4, 590 / 1,080 MiB at k = 16
    if k == 16:
        assert real < 1 << 30, msg  # the chunked statistics (before: +2.4 GiB)


# -- finding 7: prompt text in logs is opt-in -------------------------------------------------------------------------

@pytest.mark.parametrize("log_prompts", [False, True])
def test_unknown_prompt_words_reach_the_log_only_when_opted_in(embedded, caplog, log_prompts):
    """Before: every unknown prompt word was logged at WARNING, quoted. Now only with serve --log-prompts; the
    response's `warnings` still names them (the client sent them)."""
    import logging

    from fastapi.testclient import TestClient

    from lopa_fast.server import create_app
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    worker = Worker(model, tok)
    secret = "zqxjkvw"  # not in the embedded model's vocabulary
    try:
        with TestClient(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS, log_prompts=log_prompts)) as c:
            with caplog.at_level(logging.INFO, logger="lopa_fast.server"):
                r = c.post("/v1/completions", json={"prompt": f"{PROMPT} {secret}", "max_tokens": 8})
    finally:
        worker.close()
    assert r.status_code == 200, r.text
    assert any(secret in w for w in r.json().get("warnings", [])), r.json()
    logged = [rec for rec in caplog.records if secret in rec.getMessage()]
    assert bool(logged) == log_prompts, [rec.getMessage() for rec in caplog.records]
    assert all(rec.levelno == logging.WARNING for rec in logged)


def test_an_unseeded_request_that_draws_gets_a_seed_and_is_told_it(embedded):
    """Before: vanilla (Dream's `origin` reveal) at temperature 0 without a seed differed between identical calls,
    with no word. Now the server draws a seed, runs with it, and the response's warnings name it; a greedy
    request that draws nothing is left alone."""
    import re

    req = _parse(embedded, strategy="vanilla", alg="origin", max_tokens=8)
    assert isinstance(req.knobs["seed"], int)
    note = next(w for w in req.warnings if w.startswith("seed:"))
    assert re.search(rf"seed={req.knobs['seed']}\b", note) and "alg=origin" in note
    assert _parse(embedded, strategy="vanilla", alg="origin", max_tokens=8, seed=5).knobs["seed"] == 5  # given: kept
    plain = _parse(embedded)
    assert plain.knobs.get("seed") is None and not any(w.startswith("seed:") for w in plain.warnings)


def test_health_is_unhealthy_when_a_serving_thread_has_died(embedded):
    """A job thread or the batch engine's thread that died (an exception escaped it) makes /health 503 naming it,
    whatever the last self-check said; a closed worker's ended threads are not a fault (finding 5, liveness)."""
    from fastapi.testclient import TestClient

    from lopa_fast.server import create_app
    from lopa_fast.server.worker import Worker

    model, tok = embedded
    worker = Worker(model, tok)
    try:
        with TestClient(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS)) as c:
            assert c.get("/health").status_code == 200
            dead = threading.Thread(target=lambda: None, name="lopa_fast.server.worker.dead")
            dead.start()
            dead.join()
            worker._threads.append(dead)  # as if one job thread had died
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["dead_threads"] == ["lopa_fast.server.worker.dead"], r.json()
            worker._threads.remove(dead)
            if worker.engine is not None:
                worker.engine.close()  # the engine thread ends: the same verdict
                r = c.get("/health")
                assert r.status_code == 503 and "lopa_fast.batch_engine" in r.json()["dead_threads"], r.json()
    finally:
        worker.close()
    assert "dead_threads" not in worker.health
