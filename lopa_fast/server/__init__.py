"""`python -m lopa_fast serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn; `pip install '.[serve]'`).

    python -m lopa_fast serve [--model DIR] [--lora DIR] [--host 127.0.0.1] [--port 8000] [knob flags]

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events), GET /health,
    GET /v1/models, GET /metrics (Prometheus text); an access log line per request (`--no-access-log`). docs/serve.md
    has the fields, the defaults, the caps (`limits`), the API key and the errors.

Modules, one job each: `protocol` (request body -> validated knobs and prompt ids; errors naming the field),
`worker` (the execution seam: `Worker.submit(job) -> Handle`), `app` (the routes, server-sent events, error
responses, the API key), `limits` (the per-request caps and the memory budget), `metrics` (/metrics).
"""
from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from lopa_fast.server.limits import Limits

# the public names, imported on first use (PEP 562): `python -m lopa_fast --help` reads the served knobs
# (lopa_fast.server.served) without importing FastAPI, pydantic and torch (~4 s)
_LAZY = {"create_app": "app", "Limits": "limits", "model_sampling_defaults": "protocol", "parse": "protocol"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"lopa_fast.server.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'lopa_fast.server' has no attribute {name!r}")


def check_address(host: str, port: int) -> None:
    """Raise OSError when `host:port` cannot be listened on now (in use, not an address of this machine); bound
    the way uvicorn binds (SO_REUSEADDR), then released."""
    import socket

    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)


LOOPBACK = ("127.0.0.1", "::1", "localhost")
API_KEY_ENV = "LOPA_FAST_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_auth(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """Refuse (ValueError) to listen beyond loopback without an API key, unless explicitly waived."""
    if api_key is None and not allow_no_key and not is_loopback(host):
        raise ValueError(f"--host {host} listens beyond this machine without an API key: pass --api-key KEY (or set "
                         f"{API_KEY_ENV}), or --no-api-key to serve anyone who can reach the port")


def _header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a deadline for a request's head: a connection that has not sent a complete
    request line and headers `seconds` after it opened (or after its last response) is closed. (uvicorn waits for
    a half-sent head forever; the body has its own deadline, limits.read_timeout_s, in the app.)

    And connection slots idle heads cannot exhaust: when a new connection finds uvicorn's connection limit
    (`limit_concurrency`) reached, the oldest connections with no request in progress (a half-sent head, an idle
    keep-alive) are closed to make room for it. Before (issue 36), 256 half-sent heads made every request, /health
    included, a 503 until the head deadline passed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def _arm(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            self._head_timer = self.loop.call_later(seconds, self._head_timeout)

        def _head_timeout(self) -> None:
            if self._idle():
                self.transport.close()  # no (new) request head within the deadline

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._opened = self.loop.time()
            self._arm()
            cap = self.limit_concurrency
            if cap is not None and len(self.connections) >= cap:
                idle = sorted((c for c in self.connections if c is not self and c._idle()),
                              key=lambda c: getattr(c, "_opened", 0.0))
                for c in idle[: len(self.connections) - cap + 1]:
                    c.transport.close()
                    self.connections.discard(c)  # now, not at its connection_lost: this one's request counts them

        def _idle(self) -> bool:
            """No request in progress: nothing or a part of a head received since the last response."""
            return self.conn.their_state == h11.IDLE and not self.transport.is_closing()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return Protocol


DRAIN_TIMEOUT_S = 30.0  # serve's default deadline for in-flight requests after SIGTERM / SIGINT


def uvicorn_config(app, *, host: str, port: int, limits: Limits, log_level: str = "info", max_pending: int = 64,
                   drain_timeout_s: float = DRAIN_TIMEOUT_S):
    """The uvicorn.Config `serve` runs: the h11 protocol with a request-head deadline (limits.read_timeout_s), idle
    keep-alive connections closed after 5 s, at most max(64, 4 * max_pending) connections at once (more: 503), and
    `drain_timeout_s` for in-flight requests at shutdown (then they are cancelled). uvicorn's own access lines are
    off: the app logs one per request with its latency (create_app, access_log)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5, access_log=False,
                          http=_header_timeout_protocol(limits.read_timeout_s),
                          limit_concurrency=max(64, 4 * max_pending),
                          timeout_graceful_shutdown=drain_timeout_s)


def _server_class(on_exit=None):
    """uvicorn.Server, where a second SIGTERM ends the drain as a second SIGINT does (uvicorn forces the exit on a
    second SIGINT only: a second SIGTERM was ignored while orphaned requests ran on). on_exit: called at the first
    signal (serve: the app's drain clock starts, so unfinished requests answer before the deadline)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                self.force_exit = True
            elif on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

    return Server


def serve(model, tokenizer, *, model_id: str, defaults: dict, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", limits: Limits | None = None, api_key: str | None = None,
          warm_up: bool = True, verifier=None, access_log: bool = True, log_prompts: bool = False,
          drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Serve `model` until interrupted. defaults: the server's knobs (validated by the caller); requests
    override them field by field; limits: the caps (lopa_fast.server.limits); api_key: required of every
    client (Authorization: Bearer) when set. warm_up: the self-check (finite weights, one short request) before
    listening, so /health is not ok before the server can decode (a failed self-check: /health 503 unhealthy).
    verifier: the server's one APD verifier (checked against the model by the caller), used by the requests that
    set apd_mixture_weight. access_log: one INFO line per request on the "lopa_fast.server.access" logger.
    Shutdown (SIGTERM / SIGINT): no new connections, in-flight requests get `drain_timeout_s` seconds, then they
    are cancelled (a second signal ends the wait at once); running requests stop at their next round."""
    from lopa_fast.server.app import create_app
    from lopa_fast.server.worker import Worker

    worker = Worker(model, tokenizer, limits=limits, verifier=verifier)
    if warm_up:  # the self-check (with --compile: its compile); said while it runs when it takes > 2 s
        import logging

        from lopa_fast import logs

        with logs.step(logging.getLogger("lopa_fast.server"), "warming up (the self-check: one short decode)",
                       "warmed up", long=False):
            worker.warm_up(defaults)
    app = create_app(worker, model_id=model_id, defaults=defaults, api_key=api_key, access_log=access_log,
                     log_prompts=log_prompts)
    try:
        config = uvicorn_config(app, host=host, port=port, limits=worker.limits, log_level=log_level,
                                max_pending=worker.max_pending, drain_timeout_s=drain_timeout_s)
        _server_class(on_exit=lambda: app.state.drain.start(drain_timeout_s))(config).run()
    finally:
        worker.close(timeout=drain_timeout_s)


__all__ = ["Limits", "check_address", "check_auth", "create_app", "model_sampling_defaults", "parse", "serve"]
