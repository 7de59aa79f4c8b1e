"""Issue 36: a server that recovers, tells the truth about its health, and frees what clients abandon.

Each test names the finding it covers. Servers run in process (uvicorn in a thread, loopback, a free port) on the
embedded model; the memory cases run in a subprocess under an address-space cap (RLIMIT_AS), never against the
machine's whole memory."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from test_server_limits import DEFAULTS, HANG_S, KEY, PROMPT, _call, _free_port, _Server, embedded  # noqa: F401

from lopa_fast.server import create_app
from lopa_fast.server.limits import Limits
from lopa_fast.server.worker import Worker

TESTS = Path(__file__).resolve().parent


def _subprocess(script: str, timeout: float = 240, **env) -> dict:
    """Run `script` in a fresh interpreter (tests/ on its path, `env` added to the environment); it prints one JSON
    line last: returned."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **env}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- finding 1: an out-of-memory batch is freed, a 503 with Retry-After, and the server keeps serving ----------------

OOM_SCRIPT = """
import json, resource, threading, time, urllib.request, urllib.error
import psutil, torch
torch.set_num_threads(1)
import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.models.loading import address_space_room
from lopa_fast.server import create_app
from lopa_fast.server.limits import Limits
from lopa_fast.server.worker import Worker
from test_server_limits import DEFAULTS, PROMPT, _call, _Server

model = lopa_fast.load_model(model_dir(), dtype=torch.float32)
tok = lopa_fast.load_tokenizer(model_dir())
# the cap: 1 GiB of address space beyond what the process maps now (uvicorn's threads and imports included)
worker = Worker(model, tok, limits=Limits(memory_budget=1 << 40, max_request_memory=1 << 40))
srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS), worker.limits)
url = srv.url + "/v1/completions"
assert _call(url, {"prompt": PROMPT})[0] == 200  # every path warm before the cap
vms = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (vms + (1 << 30), resource.RLIM_INFINITY))
room = address_space_room()
default_budget = Limits().bind(model).memory_budget
# a batched forward's activations as they are on a big model: 60% of the room each (virtual only, never touched),
# held in the forward's frame; a forward of several requests needs a second such block and fails in the allocator.
# Only the batch engine's forwards (its thread): the worker's one-token self-check decodes outside the engine (a
# solo request, also a forward_requests call since the one loop) and stays as small as the embedded model's
real = model.forward_requests
big = int(room * 0.6) // 4
def forward_requests(parts, *a, **k):
    if threading.current_thread().name != "lopa_fast.batch_engine":
        return real(parts, *a, **k)
    activations = torch.empty(big)
    if len(parts) > 1:
        more = torch.empty(big)
    return real(parts, *a, **k)
model.forward_requests = forward_requests
N_BURST, N_AFTER = __BURST__, __AFTER__
go = threading.Barrier(N_BURST)
def one(i):
    go.wait()
    req = urllib.request.Request(url, json.dumps({"prompt": PROMPT}).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, None, None
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), json.loads(e.read())["error"].get("code")
out = [None] * N_BURST
ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(i))) for i in range(N_BURST)]
for t in ts: t.start()
for t in ts: t.join(120)
after = [_call(url, {"prompt": PROMPT})[0] for _ in range(N_AFTER)]  # one at a time: each forward alone
hstatus, health = _call(srv.url + "/health")
srv.close(); worker.close()
print(json.dumps({"burst": out, "after": after, "health_status": hstatus, "health": health, "room": room,
                  "default_budget": default_budget}))
"""


@pytest.mark.parametrize("burst,after", [(8, 4), pytest.param(16, 48, marks=pytest.mark.slow)],
                         ids=["short", "full"])
def test_an_out_of_memory_batch_is_freed_and_the_server_keeps_serving(burst, after):
    """Finding 1. Before: every request of the failed batch a 500, and the batch's activations kept by the
    exception's frames (in the job threads' locals), so every later request failed for memory too while /health
    said ok; the default budget sized from RAM alone (11.8 GiB under an 8 GiB cap). Full form: the issue's 16
    co-batched requests, then 48 more. Since issue 43 (finding 7) a co-batched forward that runs out of memory is
    retried in halves (each request alone fits here), so the burst is served whole: 200s, or a 503 with Retry-After
    for a request that could not fit alone."""
    # MALLOC_ARENA_MAX: the script's own client threads, started under the cap, would each map a 64 MiB malloc arena
    # (glibc gives threads their own, up to 8 x cores) and use the room up (8 of them: 0.5 GiB of the 1 GiB). The
    # server once had 16 idle job threads whose arenas were mapped before the cap; since issue 44 it has one
    res = _subprocess(OOM_SCRIPT.replace("__BURST__", str(burst)).replace("__AFTER__", str(after)),
                      MALLOC_ARENA_MAX="2")
    burst = [tuple(r) for r in res["burst"]]
    assert all(s == 200 or (s == 503 and retry is not None and code == "out_of_memory") for s, retry, code in burst), burst
    assert res["health"]["oom_retried_forwards"] >= 1, res["health"]  # the co-batched forward did fail
    assert res["after"] == [200] * after, res  # the failed batch's memory came back
    assert res["health_status"] == 200 and res["health"]["status"] == "ok", res["health"]
    assert res["health"]["out_of_memory"] == sum(s == 503 for s, _, _ in burst)  # only requests too big alone fail
    assert res["default_budget"] <= res["room"] // 2 + (1 << 20), res  # the cap, not physical RAM, sizes the budget


# -- finding 2: metric labels from a closed set -----------------------------------------------------------------------

@pytest.mark.parametrize("paths,length", [(40, 4000), pytest.param(300, 8000, marks=pytest.mark.slow)],
                         ids=["short", "full"])
def test_metric_labels_are_a_closed_set(embedded, paths, length):
    """Finding 2. Before: every 401 was counted under its raw request path as a label (300 random 8,000-character
    paths: /metrics 24 KB -> 43.5 MB; the full form sends those)."""
    model, tok = embedded
    worker = Worker(model, tok, batch=False, concurrency=1)
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS, api_key=KEY))
    try:
        for i in range(paths):
            assert _call(srv.url + f"/{i}-" + "x" * length, method="GET")[0] == 401
        assert _call(srv.url + "/v1/completions", {"prompt": PROMPT})[0] == 401
        status, text = _call(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, method="GET")
        assert status == 200 and len(text) < 32 << 10, len(text)
        labels = set(re.findall(r'endpoint="([^"]*)"', text))
        assert labels <= {"completions", "chat", "models", "metrics", "health", "other"}, labels
        assert re.search(rf'^lopa_fast_requests_total\{{endpoint="other",status="401"\}} {paths}\.0$', text, re.M)
        assert re.search(r'^lopa_fast_requests_total\{endpoint="completions",status="401"\} 1\.0$', text, re.M)
    finally:
        srv.close()
        worker.close()


# -- finding 3: a client that leaves cancels its request, whatever its kind; shutdown has a deadline ------------------

def _slow_forwards(model, monkeypatch, seconds: float) -> None:
    """Every batched forward sleeps `seconds` first: a request lasts many seconds, so leaving it is observable."""
    real = model.forward_requests

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)

    monkeypatch.setattr(model, "forward_requests", slow)


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("key,clients", [(None, 1), (KEY, 1), pytest.param(None, 16, marks=pytest.mark.slow)],
                         ids=["open", "api-key", "storm-full"])
def test_a_non_streaming_client_that_leaves_is_cancelled(embedded, monkeypatch, key, clients):
    """Finding 3. Before: FastAPI's @app.middleware("http") (installed even without a key) kept
    request.is_disconnected() from ever reporting, so 16 abandoned requests ran to completion (the full form:
    those 16 leave at once)."""
    model, tok = embedded
    _slow_forwards(model, monkeypatch, 0.2)
    worker = Worker(model, tok)
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS, api_key=key))
    try:
        body = json.dumps({"prompt": PROMPT, "strategy": "d2f", "branching_factor": 1, "max_tokens": 96}).encode()
        auth = b"" if key is None else f"Authorization: Bearer {key}\r\n".encode()
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=HANG_S) for _ in range(clients)]
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait(lambda: worker.counts["running"] == clients, "the requests never started")
        for s in socks:
            s.close()
        # the clients are gone: the requests stop at a round boundary (polled every 0.25 s), long before their end
        _wait(lambda: worker.counts["cancelled"] == clients and worker.counts["running"] == 0,
              "the requests were not cancelled")
        assert worker.counts["served"] == 0, worker.counts
    finally:
        srv.close()
        worker.close()


SHUTDOWN_SCRIPT = """
import os, sys, threading, time, json, urllib.request, socket
import torch
torch.set_num_threads(1)
import lopa_fast
from lopa_fast import server
from lopa_fast.assets import model_dir
from test_server_limits import DEFAULTS, PROMPT, _free_port

model = lopa_fast.load_model(model_dir(), dtype=torch.float32)
tok = lopa_fast.load_tokenizer(model_dir())
real = model.forward_requests
def slow(*a, **k):  # a request of ~100 rounds lasts ~50 s
    time.sleep(0.5)
    return real(*a, **k)
model.forward_requests = slow
port = _free_port()
def client():
    body = json.dumps({"prompt": PROMPT, "strategy": "d2f", "branching_factor": 1, "max_tokens": 96}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=300).read()
    except Exception:
        pass
def health():
    try:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())
    except OSError:
        return {}
def signals():
    while not health():  # the server listens: the client's request, then, once it runs, the signals
        time.sleep(0.1)
    threading.Thread(target=client, daemon=True).start()
    while health().get("running") != 1:
        time.sleep(0.1)
    print("T0", time.monotonic(), flush=True)
    for _ in range(int(sys.argv[2])):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
import signal
threading.Thread(target=signals, daemon=True).start()
server.serve(model, tok, model_id="d2f-arith", defaults=DEFAULTS, port=port, log_level="warning",
             drain_timeout_s=float(sys.argv[1]))
"""


def test_shutdown_cancels_what_outlives_the_drain_deadline(embedded, monkeypatch):
    """Finding 3, in process: uvicorn given serve's config with a 1 s drain deadline stops with a request of
    ~20 s still running (before: no deadline, it waited for the request); the worker's close cancels it."""
    import uvicorn

    from lopa_fast.server import uvicorn_config

    model, tok = embedded
    # 1 s a forward: the embedded model answers this prompt in a few rounds (EOS fills the rest), so at 0.2 s the
    # request could end inside the 1 s drain on a loaded machine (it did: served 1, cancelled 0)
    _slow_forwards(model, monkeypatch, 1.0)
    worker = Worker(model, tok)
    app = create_app(worker, model_id="d2f-arith", defaults=DEFAULTS)
    srv = _Server.__new__(_Server)
    srv.port = _free_port()
    srv.server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=srv.port, limits=worker.limits,
                                               log_level="critical", drain_timeout_s=1.0))
    srv.thread = threading.Thread(target=srv.server.run, daemon=True)
    srv.thread.start()
    _wait(lambda: srv.server.started, "the server did not start")
    body = {"prompt": PROMPT, "strategy": "d2f", "branching_factor": 1, "max_tokens": 96}
    client = threading.Thread(target=lambda: _try_call(f"http://127.0.0.1:{srv.port}/v1/completions", body),
                              daemon=True)
    client.start()
    _wait(lambda: worker.counts["running"] == 1, "the request never started")
    srv.server.should_exit = True
    srv.thread.join(HANG_S)
    assert not srv.thread.is_alive(), "uvicorn did not stop at its drain deadline"
    worker.close(timeout=HANG_S)
    assert worker.counts["cancelled"] == 1 and worker.counts["served"] == 0, worker.counts


def test_a_second_sigterm_ends_the_drain():
    """Finding 3: uvicorn forces the exit on a second SIGINT only; serve's server on a second SIGTERM too."""
    from lopa_fast.server import _server_class, uvicorn_config

    srv = _server_class()(uvicorn_config(None, host="127.0.0.1", port=0, limits=Limits()))
    srv.handle_exit(signal.SIGTERM, None)
    assert srv.should_exit and not srv.force_exit
    srv.handle_exit(signal.SIGTERM, None)
    assert srv.force_exit


def _try_call(url, body):
    try:
        _call(url, body)
    except OSError:  # the server went away: what this client sees is not the point
        pass


@pytest.mark.slow
@pytest.mark.parametrize("drain_s,signals", [(2.0, 1), (600.0, 2)], ids=["drain-deadline", "second-sigterm"])
def test_shutdown_has_a_deadline(drain_s, signals):
    """Finding 3. Before: SIGTERM waited for every in-flight request (110 s on orphans) and a second SIGTERM was
    ignored. Now a drain deadline (`drain_timeout_s`, serve --drain-timeout) or a second signal ends the wait; the
    running request is cancelled at its next round. The request here would run ~50 s."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SHUTDOWN_SCRIPT), str(drain_s), str(signals)],
                       capture_output=True, text=True, timeout=240, env=env)
    t1 = time.monotonic()  # CLOCK_MONOTONIC: one clock for both processes
    # uvicorn re-raises the signal once it has shut down: the process ends by SIGTERM (143 from a shell)
    assert r.returncode in (0, -signal.SIGTERM), r.stderr[-4000:]
    t0 = float(re.search(r"^T0 (\S+)$", r.stdout, re.M).group(1))
    assert t1 - t0 < 30, (t1 - t0, r.stderr[-2000:])  # generous: the deadline (2 s) or the second signal (1 s)


# -- finding 8: the self-check, bad tokenizer files, a length check before tokenising, surrogates, id ranges ---------

def test_nan_weights_fail_the_self_check_and_health_says_so(embedded):
    """Before: the warm-up failure was a warning and /health said ok while every request was a 500."""
    import copy

    model, tok = embedded
    bad = copy.deepcopy(model)
    with torch.no_grad():
        next(bad.parameters()).view(-1)[3] = float("nan")
    worker = Worker(bad, tok, batch=False, concurrency=1)
    worker.warm_up(DEFAULTS)
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS))
    try:
        status, body = _call(srv.url + "/health")
        assert status == 503 and body["status"] == "unhealthy", body
        assert "NaN" in body["self_check"] and next(n for n, _ in bad.named_parameters()) in body["self_check"], body
    finally:
        srv.close()
        worker.close()
    healthy = Worker(model, tok, batch=False, concurrency=1)
    try:
        healthy.warm_up(DEFAULTS)
        assert healthy.health["status"] == "ok" and healthy.health["self_check"] == "passed"
    finally:
        healthy.close()


@pytest.mark.parametrize("content", [b"", b'{"version": "1.0", "model": {"type": "Word', b"\x00\xff garbage"],
                         ids=["empty", "truncated", "garbage"])
def test_a_bad_tokenizer_file_exits_2_naming_it(tmp_path, content, capsys):
    """Before: a raw traceback from the tokenizers library, exit 1 (weights and config: exit 2 with a message)."""
    import shutil

    from lopa_fast import cli
    from lopa_fast.assets import model_dir

    d = tmp_path / "m"
    shutil.copytree(model_dir(), d)
    (d / "tokenizer.json").write_bytes(content)
    assert cli.main(["generate", "--model", str(d), "--prompt", "1 + 2 =", "--max-new-tokens", "4"],
                    exit_on_error=True) == 2
    err = capsys.readouterr().err
    assert str(d / "tokenizer.json") in err and "Traceback" not in err, err


def test_a_huge_text_prompt_is_refused_before_tokenising(embedded, monkeypatch):
    """Before: a 1 MiB prompt was tokenised in full (9.9 s of a shared parse thread, +490 MiB) before the
    length check refused it."""
    model, tok = embedded
    seen = []
    real = type(tok).__call__

    def spy(self, text, *a, **k):
        seen.append(len(text) if isinstance(text, str) else -1)
        return real(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", spy)
    worker = Worker(model, tok, batch=False, concurrency=1, limits=Limits(max_body_bytes=4 << 20))
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS), worker.limits)
    try:
        huge = "pens " * 200_000  # 1 MB
        for url, body in ((srv.url + "/v1/completions", {"prompt": huge}),
                          (srv.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
            status, out = _call(url, body)
            assert status == 400 and out["error"]["param"] in ("prompt", "messages"), out
            assert "before tokenising" in out["error"]["message"] and "--max-model-len" in out["error"]["message"]
        assert all(n < 100_000 for n in seen), seen  # the tokenizer never saw the huge text
        assert _call(srv.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})[0] == 200
    finally:
        srv.close()
        worker.close()


def test_a_lone_surrogate_and_an_id_out_of_range_name_the_prompt(served_plain):
    url = served_plain.url
    status, body = _call(url + "/v1/completions", raw=b'{"prompt": "Tom has \\ud800 pens"}')
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "surrogate U+D800 at character 8" in body["error"]["message"], body
    status, body = _call(url + "/v1/chat/completions", raw=b'{"messages": [{"role": "user", "content": "a\\udfff"}]}')
    assert status == 400 and body["error"]["param"] == "messages" and "U+DFFF" in body["error"]["message"], body
    status, body = _call(url + "/v1/completions", {"prompt": [2, 5, 99_999]})
    assert status == 400 and body["error"]["param"] == "prompt" and "99999" in body["error"]["message"], body


@pytest.fixture(scope="module")
def served_plain(embedded):
    model, tok = embedded
    worker = Worker(model, tok, batch=False, concurrency=1)
    srv = _Server(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS), worker.limits)
    yield srv
    srv.close()
    worker.close()


# -- finding 6: idle half-sent heads cannot exhaust the connection slots ----------------------------------------------

@pytest.mark.parametrize("max_pending,heads", [(1, 80), pytest.param(64, 300, marks=pytest.mark.slow)],
                         ids=["short", "full"])
def test_half_sent_heads_cannot_exhaust_the_connection_slots(embedded, max_pending, heads):
    """Before: once the connection limit was full of half-sent heads, every request, /health included, was a 503
    until the head deadline (--read-timeout, 30 s here). Now the oldest idle connections make room. Full form: the
    CLI's queue cap (64: a limit of 256 connections) and 300 heads."""
    import uvicorn

    from lopa_fast.server import uvicorn_config

    model, tok = embedded
    limit = max(64, 4 * max_pending)  # uvicorn_config's connection limit
    worker = Worker(model, tok, batch=False, concurrency=1, max_pending=max_pending)
    cfg = uvicorn_config(create_app(worker, model_id="d2f-arith", defaults=DEFAULTS), host="127.0.0.1",
                         port=_free_port(), limits=worker.limits, log_level="critical",
                         max_pending=max_pending)
    assert cfg.limit_concurrency == limit and worker.limits.read_timeout_s == 30
    srv = _Server.__new__(_Server)
    srv.port, srv.server = cfg.port, uvicorn.Server(cfg)
    srv.url = f"http://127.0.0.1:{srv.port}"
    srv.thread = threading.Thread(target=srv.server.run, daemon=True)
    srv.thread.start()
    _wait(lambda: srv.server.started, "the server did not start")
    socks = []
    try:
        for _ in range(heads):  # more half-sent heads than the limit
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=HANG_S)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        time.sleep(0.5)
        assert _call(srv.url + "/health")[0] == 200
        status, body = _call(srv.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
        assert status == 200, body
        assert len(srv.server.server_state.connections) <= limit
    finally:
        for s in socks:
            s.close()
        srv.close()
        worker.close()


# -- finding 4: a corrupt Inductor artifact (a killed build's 0-byte *.so) ----------------------------------------------

@pytest.mark.parametrize("knobs", [dict(DEFAULTS), dict(strategy="threshold", threshold=0.9, max_new_tokens=32)],
                         ids=["lopa-round", "threshold-step"])
def test_a_corrupt_inductor_artifact_is_removed_and_the_step_runs_eagerly(embedded, monkeypatch, tmp_path, knobs):
    """Before: every later compile=True failed with "file too short" (the package neither recompiled nor fell
    back). Inductor's load of the cut-short artifact is stood in for (a real one takes 25-100 s per graph on CPU):
    the compiled callable raises what dlopen raises, wrapped as Dynamo wraps it."""
    import copy
    import warnings

    import lopa_fast
    from lopa_fast.decode import compiled

    model, tok = embedded
    cache = tmp_path / "inductor" / "ab"
    cache.mkdir(parents=True)
    (cache / "cabc.main.so").write_bytes(b"")  # what a killed link leaves
    (cache / "cgood.main.so").write_bytes(b"\x7fELF" + bytes(200))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled.inductor_cache_dir())  # the fallback moves it: restored
    monkeypatch.setattr(compiled, "inductor_cache_dir", lambda: str(tmp_path / "inductor"))
    calls = []

    def poisoned_compile(fn, **kw):
        def call(*a, **k):
            calls.append(fn.__name__)
            try:
                raise ImportError(f"{cache / 'cabc.main.so'}: file too short")
            except ImportError as e:
                raise RuntimeError("backend='inductor' raised:\nImportError: file too short") from e
        return call

    monkeypatch.setattr(torch, "compile", poisoned_compile)
    ids = tok(PROMPT)["input_ids"]
    eager = lopa_fast.generate(model, ids, **knobs)
    fresh = copy.deepcopy(model)  # no compiled steps of an earlier test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lopa_fast.generate(fresh, ids, compile=True, **knobs)
    assert calls, "the compiled path was not taken"
    assert out.generated_ids == eager.generated_ids
    corrupt = [w for w in caught if "corrupt artifact" in str(w.message)]
    assert len(corrupt) == len(set(calls)) >= 1, [str(w.message) for w in caught]  # one per compiled step, once
    assert not (cache / "cabc.main.so").exists() and (cache / "cgood.main.so").exists()
