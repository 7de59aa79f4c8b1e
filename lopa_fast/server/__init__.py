"""`python -m lopa_fast serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn; `pip install '.[serve]'`).

    python -m lopa_fast serve [--model DIR] [--lora DIR] [--host 127.0.0.1] [--port 8000] [knob flags]

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events), GET /health,
    GET /v1/models. docs/serve.md has the fields, the defaults and the errors.

Modules, one job each: `protocol` (request body -> validated knobs and prompt ids; errors naming the field),
`worker` (the execution seam: `Worker.submit(job) -> Handle`, one request at a time today), `app` (the routes,
server-sent events, error responses).
"""
from __future__ import annotations

from lopa_fast.server.app import create_app
from lopa_fast.server.limits import Limits
from lopa_fast.server.protocol import RequestError, model_sampling_defaults, parse
from lopa_fast.server.worker import Handle, Job, Worker


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
                         f"{API_KEY_ENV}), or --no-api-key to serve anyone who can reach the port")  # fmt: skip


def serve(model, tokenizer, *, model_id: str, defaults: dict, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", limits: Limits | None = None, api_key: str | None = None,
          warm_up: bool = True) -> None:  # fmt: skip
    """Serve `model` until interrupted. defaults: the server's knobs (validated by the caller); requests
    override them field by field; limits: the caps (lopa_fast.server.limits); api_key: required of every
    client (Authorization: Bearer) when set. warm_up: build what the first request would (the CPU round ops)
    and decode one short request before listening, so /health is not ok before the server can decode."""
    import uvicorn

    worker = Worker(model, tokenizer, limits=limits)
    if warm_up:
        worker.warm_up(defaults)
    app = create_app(worker, model_id=model_id, defaults=defaults, api_key=api_key)
    try:
        # timeout_keep_alive: an idle connection is closed after it; the body's read timeout is limits'
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                    limit_concurrency=max(64, 4 * worker.max_pending))
    finally:
        worker.close()


__all__ = ["Handle", "Job", "Limits", "RequestError", "Worker", "check_address", "check_auth", "create_app",
           "model_sampling_defaults", "parse", "serve"]  # fmt: skip
