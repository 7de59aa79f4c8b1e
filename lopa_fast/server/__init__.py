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


def serve(model, tokenizer, *, model_id: str, defaults: dict,
          host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:  # fmt: skip
    """Serve `model` until interrupted. defaults: the server's knobs (validated by the caller); requests
    override them field by field."""
    import uvicorn

    worker = Worker(model, tokenizer)
    app = create_app(worker, model_id=model_id, defaults=defaults)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        worker.close()


__all__ = ["Handle", "Job", "RequestError", "Worker", "check_address", "create_app", "model_sampling_defaults", "parse",
           "serve"]  # fmt: skip
