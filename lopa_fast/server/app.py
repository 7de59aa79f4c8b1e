"""The FastAPI app: OpenAI-compatible completions and chat (plain JSON or server-sent events), /health, /v1/models.

Every request body is checked by `protocol.parse` (bad input: HTTP 400 with an OpenAI error object naming the
field; the routes read the body themselves, so FastAPI's 422 never arises), then run by the `Worker` (a request
the batch engine covers is handed to it once; worker.py). A streamed response sends one chunk per piece of text as
blocks become final (`lopa_fast.stream`), a last chunk with finish_reason and usage, then `data: [DONE]`. A client
that disconnects is cancelled (worker.py). No exception escapes a handler: an unexpected one is a 500 with an error
object, and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lopa_fast.errors import RoundCapError, StepTimeoutError
from lopa_fast.server.protocol import RequestError, checked, fan_out, parse
from lopa_fast.errors import is_out_of_memory
from lopa_fast.server.limits import BODY_GRACE_S
from lopa_fast.server.metrics import CONTENT_TYPE, Metrics, route_label
from lopa_fast.server.worker import Busy, Finished, Job, Worker
from lopa_fast.request.text import UNKNOWN_NOTE, answer_ids

log = logging.getLogger("lopa_fast.server")
access = logging.getLogger("lopa_fast.server.access")  # one line per request (create_app's access_log)
# a body over --max-body-bytes is read and discarded up to this many bytes (within the read timeout) before the 413
# is sent, so a client that writes its whole body before reading (urllib, http.client) reads the 413 instead of a
# connection reset; a larger body is cut off (nginx's lingering close, bounded the same way)
LINGER_BYTES = 64 << 20

FINISH_REASONS = {"stop": "stop", "length": "length", "round_cap": "length"}  # OpenAI's values; stats keep ours


RETRY_AFTER_S = 2  # a 503's Retry-After: a full queue or a batch that ran out of memory clears within rounds


def _error(exc: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else {}
    if exc.status in (408, 413):  # the body was not (all) read: close the connection, so a client still trickling
        # it does not keep the slot (255 trickled bodies held every slot for 80 s: issue 43, finding 1)
        headers["Connection"] = "close"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)


class _ApiKey:
    """ASGI middleware: with an API key, every route but /health needs `Authorization: Bearer <key>` (401
    otherwise, counted under the route's label: a closed set, never the raw path). A plain ASGI class, not
    FastAPI's @app.middleware("http"): that one wraps `receive`, and behind it `request.is_disconnected()` never
    reports a client that left (issue 36: 16 abandoned requests ran to completion)."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.key, self.metrics = app, None if api_key is None else api_key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        self.metrics.request(route_label(scope.get("path", "")), 401, 0.0)
        response = JSONResponse(RequestError("a valid API key is required (Authorization: Bearer <key>)", None, 401,
                                             "authentication_error", "invalid_api_key").body(),
                                status_code=401, headers={"WWW-Authenticate": "Bearer",
                                                          "Connection": "close"})
        # close: the 401 never reads the body, so a client trickling one would otherwise hold the slot (issue 43)
        await response(scope, receive, send)


class _AccessLog:
    """ASGI middleware: one INFO line per HTTP request on "lopa_fast.server.access": client, method, path, status
    and the latency to the response head. A plain ASGI class for the reason _ApiKey is one: FastAPI's
    @app.middleware("http") would hide a client's disconnect from the route (its requests would never be
    cancelled)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, logged = time.perf_counter(), [False]

        def line(status: int) -> None:
            logged[0] = True
            client = scope.get("client")
            access.info('%s "%s %s" %d %.1f ms', f"{client[0]}:{client[1]}" if client else "-", scope.get("method"),
                        scope.get("path"), status, 1000 * (time.perf_counter() - t0))

        async def send_logged(message):
            if message["type"] == "http.response.start":
                line(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            if not logged[0]:  # the app raised (or the client left) before any response head: a 500 as uvicorn sends
                line(500)


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def _event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return "data: " + json.dumps(obj) + "\n\n"


def usage(done: Finished, eos_token_id) -> dict:
    """OpenAI usage plus the decoding's forwards and TPF. completion_tokens: the tokens the model produced before
    its first EOS (a text stop cuts the text, not this count); tpf: stats["tpf"] (every returned position over
    forwards)."""
    st = done.result.stats
    completion = len(answer_ids(done.result.generated_ids, eos_token_id))
    return {"prompt_tokens": len(done.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(done.prompt_ids) + completion, "forwards": int(st.get("forwards", 0)),
            "tpf": float(st.get("tpf", 0.0))}


class Drain:
    """The server's shutdown clock. `start(seconds)` at the first SIGTERM / SIGINT (serve's uvicorn server calls
    it; `seconds`: --drain-timeout); `expired` once the in-flight requests' time is up, a margin before uvicorn's
    own deadline cancels the handlers (min(1 s, half the timeout)), so each unfinished request can still answer:
    a 503 error body, or a stream's error event and its [DONE] (issue 43: they were cut without either)."""

    def __init__(self) -> None:
        self.deadline: float | None = None

    def start(self, seconds: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + max(0.0, seconds - min(1.0, seconds / 2))

    @property
    def started(self) -> bool:
        return self.deadline is not None

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def _shutting_down() -> RequestError:
    return RequestError("the server is shutting down: the request was cancelled at its drain deadline "
                        "(--drain-timeout); retry on another instance", None, 503, "server_error",
                        "shutting_down")


def create_app(worker: Worker, *, model_id: str, defaults: dict, api_key: str | None = None,
               access_log: bool = True, log_prompts: bool = False) -> FastAPI:
    """The app serving `worker`'s model as `model_id`; `defaults`: the server's knobs (requests override them);
    `api_key`: when set, every route but /health needs `Authorization: Bearer <key>` (401 otherwise). The caps
    (body size, read timeout, branching factor, memory, ...) are `worker.limits` (lopa_fast.server.limits).
    access_log: one INFO line per request on "lopa_fast.server.access": client, method, path, status and the
    latency to the response head (a streamed response: to its first byte). log_prompts: notes quoting prompt text
    (words the tokenizer does not know) are logged at WARNING; without it, one INFO line without the text."""
    app = FastAPI(title="lopa_fast", summary="OpenAI-compatible diffusion-LLM decoding (LoPA, D2F, ...)")
    app.state.worker, app.state.model_id, app.state.defaults = worker, model_id, dict(defaults)
    limits = worker.limits
    created = int(time.time())
    eos = worker.model.eos_token_id
    metrics = app.state.metrics = Metrics()
    drain = app.state.drain = Drain()
    # parsing, tokenising and validation run here, never on the event loop (a large prompt must not freeze it)
    prep = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="lopa_fast.server.parse")

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("unexpected error")
        return _error(RequestError(f"{type(exc).__name__}: {exc}", None, 500, "server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        """404 (no such route) and 405 (a route without that method) as OpenAI error objects ({"error": ...}), as
        every other error of this server, instead of Starlette's {"detail": ...}."""
        what = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(RequestError(f"{what} ({_request.method} {_request.url.path})", None, exc.status_code,
                                         kind, code).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    app.add_middleware(_ApiKey, api_key=api_key, metrics=metrics)

    if access_log:  # added after _ApiKey, so it wraps it: a 401 is logged too
        app.add_middleware(_AccessLog)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes (was 405; issue 43)
    async def health():
        """200 {"status": "ok", ...} while the server can decode (its last self-check passed); 503 {"status":
        "unhealthy", "self_check": the reason, ...} otherwise (NaN weights, a probe after an out-of-memory failure
        that failed too)."""
        eng = getattr(worker, "engine", None)  # the batch engine's facts: batched rounds, the largest batch seen
        batch = {} if eng is None else {"batched_rounds": eng.rounds, "max_batch": eng.max_live,
                                        "oom_retried_forwards": eng.oom_splits}
        facts = worker.health
        body = {"status": facts.pop("status"), "model": model_id, **facts, **batch}
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(worker), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "lopa_fast"}]}

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str):
        """OpenAI's retrieve-model route: the served model's object, or a 404 error object naming it."""
        if model != model_id:
            return _error(RequestError(f"model {model!r} is not served; this server serves {model_id!r}", "model",
                                       404, code="model_not_found"))
        return {"id": model_id, "object": "model", "created": created, "owned_by": "lopa_fast"}

    @app.get("/version")
    async def version():
        """vLLM's /version: {"version": lopa_fast's}."""
        import lopa_fast

        return {"version": lopa_fast.__version__}

    async def _json_body(request: Request) -> dict:
        raw = await _read(request)
        try:
            body = json.loads(raw)
        except (RecursionError, ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({type(e).__name__})") from e
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
        return body

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: {"prompt": text} (or {"messages": [...]}, the chat template applied), optional
        "add_special_tokens" (default true; the prompt as /v1/completions encodes it) -> {"tokens": ids, "count":
        n, "max_model_len": the model's positions}."""
        try:
            body = await _json_body(request)
            ids = await asyncio.get_running_loop().run_in_executor(prep, _tokenize, body)
        except RequestError as e:
            return _error(e)
        return {"tokens": ids, "count": len(ids), "max_model_len": int(worker.model.config.max_position_embeddings)}

    def _tokenize(body: dict) -> list[int]:
        from lopa_fast.request.text import chat_ids, check_text_prompt

        unknown = sorted(set(body) - {"prompt", "messages", "add_special_tokens", "model"})
        if unknown:
            raise RequestError(f"{unknown[0]}: not a field of /tokenize (prompt or messages, add_special_tokens)",
                               unknown[0])
        tok = worker.tokenizer
        if ("prompt" in body) == ("messages" in body):
            raise RequestError("/tokenize takes one of prompt (text) or messages (a chat)", "prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise RequestError(f"add_special_tokens: {special!r}; expected true or false", "add_special_tokens")
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
                raise RequestError("messages: expected a non-empty list of {role, content} objects", "messages")
            return chat_ids(tok, msgs)
        text = body["prompt"]
        try:
            check_text_prompt(text)
        except (TypeError, ValueError) as e:
            raise RequestError(f"prompt: {e}", "prompt") from e
        return list(tok(text, add_special_tokens=special)["input_ids"])

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's /detokenize: {"tokens": ids} -> {"prompt": the text} (special tokens kept, as vLLM's)."""
        try:
            body = await _json_body(request)
            ids = body.get("tokens")
            vocab = int(worker.model.config.vocab_size)
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("tokens: expected a list of token ids (ints)", "tokens")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        except RequestError as e:
            return _error(e)
        return {"prompt": worker.tokenizer.decode(ids)}

    async def _read(request: Request) -> bytes:
        """The body, at most limits.max_body_bytes (413 past it, before anything is parsed), received within
        limits.read_timeout_s and at limits.min_body_rate (408 past either: the connection is closed)."""
        cap = limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            await _discard(request, 0)
            raise RequestError(f"the request body is {int(declared)} bytes; this server takes at most {cap} "
                               "(--max-body-bytes)", None, 413)
        chunks, size, over = [], 0, False
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        rate = limits.min_body_rate

        def deadline() -> float:
            """When the body's next bytes are due: within read_timeout_s in all, and (min_body_rate > 0) at an
            average of min_body_rate bytes/s once BODY_GRACE_S is over (mod_reqtimeout's MinRate rule)."""
            end = t0 + limits.read_timeout_s
            return min(end, t0 + BODY_GRACE_S + size / rate) if rate else end

        while True:
            try:
                message = await asyncio.wait_for(request.receive(), max(0.0, deadline() - loop.time()))
            except asyncio.TimeoutError as e:
                if loop.time() - t0 >= limits.read_timeout_s - 1e-3:
                    why = f"did not arrive within {limits.read_timeout_s:g} s"
                else:
                    why = f"arrived at under {rate} bytes/s ({size} bytes in {loop.time() - t0:.1f} s; --min-body-rate)"
                raise RequestError(f"the request body {why}", None, 408) from e
            if message["type"] == "http.disconnect":
                break
            size += len(message.get("body", b""))
            if size > cap:
                over = message.get("more_body", False) or "done"  # "done": nothing left to discard
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        if over:
            if over is True:
                await _discard(request, size)
            raise RequestError(f"the request body is over {cap} bytes, this server's cap (--max-body-bytes)",
                               None, 413)
        return b"".join(chunks)

    async def _discard(request: Request, seen: int) -> None:
        """Read and drop the rest of a refused body, up to LINGER_BYTES in all and within the read timeout (a
        client that writes its whole body before reading can then read the 413)."""
        async def drain():
            n = seen
            while n <= LINGER_BYTES:
                message = await request.receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return
                n += len(message.get("body", b""))

        try:
            await asyncio.wait_for(drain(), limits.read_timeout_s)
        except asyncio.TimeoutError:
            pass

    def _prepare(raw: bytes, endpoint: str, loop) -> tuple:
        """(parsed request, handle): JSON, the body's checks, tokenising, the knobs' checks and the queueing, on a
        parse thread. Raises RequestError."""
        try:
            body = json.loads(raw)
        except RecursionError as e:
            raise RequestError("the request body is nested too deeply") from e
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, an integer over Python's digit limit
            raise RequestError(f"the request body is not valid JSON ({e})") from e
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise RequestError(f"model {body['model']!r} is not served; this server serves {model_id!r}",
                               "model", 404, code="model_not_found")
        req = parse(body, endpoint, worker.model, worker.tokenizer, app.state.defaults, limits,
                    verifier=getattr(worker, "verifier", None))
        for note in req.warnings:  # a note quoting prompt text (unknown words) only with log_prompts (opt-in, as
            # vLLM's --enable-log-requests: prompts in logs are the operator's choice; issue 43, finding 7)
            if log_prompts or UNKNOWN_NOTE not in note:
                log.warning("%s", note)
            else:
                log.info("a prompt holds %s (not logged: serve --log-prompts)", UNKNOWN_NOTE)
        try:  # stream's own checks, by type as in parse (they passed there; a newer check may not)
            job = Job(req.prompt_ids, req.knobs, req.stop, req.memory, req.plan, req.text_stops, req.unit)
            handle = checked(None, worker.submit, job, loop,
                             endpoint=endpoint)
        except Busy as e:
            raise RequestError(f"the server is busy: {e}; retry later", None, 503, "server_error") from e
        return req, handle

    def _fan_out(raw: bytes, endpoint: str) -> tuple[list[dict], int] | None:
        try:
            body = json.loads(raw)
        except (RecursionError, ValueError, UnicodeDecodeError):
            return None  # _prepare names it
        return fan_out(body, endpoint, app.state.defaults)

    async def _serve(request: Request, endpoint: str):
        t0 = time.perf_counter()
        if drain.started:  # a keep-alive connection's request after SIGTERM: no new work
            metrics.request(endpoint, 503, time.perf_counter() - t0)
            return _error(_shutting_down())
        try:
            raw = await _read(request)
            loop = asyncio.get_running_loop()
            several = await loop.run_in_executor(prep, _fan_out, raw, endpoint)
            if several is not None:  # several choices: a list of prompts, or n > 1 samples
                return await _serve_choices(request, endpoint, *several, t0)
            req, handle = await loop.run_in_executor(prep, _prepare, raw, endpoint, loop)
        except RequestError as e:
            metrics.request(endpoint, e.status, time.perf_counter() - t0)
            return _error(e)
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": model_id}
        notes = {"warnings": req.warnings} if req.warnings else {}  # e.g. words the tokenizer does not know
        if req.stream:
            return StreamingResponse(_sse(handle, endpoint, head, request.is_disconnected, notes, req.include_usage,
                                          t0),  # time to first token and queue time observed there
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        done, first = None, None
        try:
            async for kind, value in handle.events(disconnected=request.is_disconnected,
                                                   shutdown=lambda: drain.expired):
                if kind == "shutdown":
                    metrics.request(endpoint, 503, time.perf_counter() - t0)
                    return _error(_shutting_down())
                if kind == "piece" and first is None:
                    first = time.perf_counter() - t0  # time to first token (the pieces themselves: done.text)
                if kind == "done":  # the pieces are not needed: done.text is them joined
                    done = value
                    metrics.timing(endpoint, first if first is not None else time.perf_counter() - t0,
                                   handle.queue_seconds)
                elif kind == "error":
                    err = _run_error(value)
                    metrics.request(endpoint, err.status, time.perf_counter() - t0)
                    return _error(err)
        finally:
            if done is None:
                handle.cancel()
        if done is None:  # the client left; nobody reads this
            metrics.request(endpoint, 499, time.perf_counter() - t0)
            return _error(RequestError("cancelled: the client disconnected", None, 499, "cancelled"))
        metrics.request(endpoint, 200, time.perf_counter() - t0, done.result.stats)
        return {**_completion(endpoint, head, done, eos), **notes}

    async def _serve_choices(request: Request, endpoint: str, parts: list[dict], n: int, t0: float):
        """A request of several choices (protocol.fan_out): each part checked and queued as a request of its own
        (they share the batch engine's rounds), their answers as the choices of one response, in order. Any part's
        error answers the whole request (the others are cancelled)."""
        loop = asyncio.get_running_loop()
        handles = []
        try:
            for part in parts:
                req, handle = await loop.run_in_executor(prep, _prepare, json.dumps(part).encode(), endpoint, loop)
                handles.append(handle)
        except RequestError as e:
            for h in handles:
                h.cancel()
            metrics.request(endpoint, e.status, time.perf_counter() - t0)
            return _error(e)

        async def answer(handle):
            first = None
            async for kind, value in handle.events(disconnected=request.is_disconnected,
                                                   shutdown=lambda: drain.expired):
                if kind == "shutdown":
                    return _shutting_down()
                if kind == "piece" and first is None:
                    first = time.perf_counter() - t0
                if kind == "done":
                    metrics.timing(endpoint, first if first is not None else time.perf_counter() - t0,
                                   handle.queue_seconds)
                    return value
                if kind == "error":
                    return _run_error(value)
            return None  # cancelled: the client left

        try:
            answers = await asyncio.gather(*(answer(h) for h in handles))
        finally:
            for h in handles:  # a no-op for the finished ones
                h.cancel()
        for a in answers:
            if a is None or isinstance(a, RequestError):
                err = a if a is not None else RequestError("cancelled: the client disconnected", None, 499,
                                                           "cancelled")
                metrics.request(endpoint, err.status, time.perf_counter() - t0)
                return _error(err)
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": model_id}
        objs = [_completion(endpoint, head, done, eos) for done in answers]
        for done in answers:
            metrics.request(endpoint, 200, time.perf_counter() - t0, done.result.stats)
        use = [o["usage"] for o in objs]
        prompt_tokens = sum(u["prompt_tokens"] for u in use[::n])  # each prompt once
        completion = sum(u["completion_tokens"] for u in use)
        forwards = sum(u["forwards"] for u in use)
        generated = sum(int(d.result.stats.get("generated_tokens", 0)) for d in answers)
        return {**head, "object": objs[0]["object"],
                "choices": [{**o["choices"][0], "index": i} for i, o in enumerate(objs)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion, "forwards": forwards,
                          "tpf": generated / forwards if forwards else 0.0},
                "stats": [o["stats"] for o in objs]}

    def _completion(endpoint: str, head: dict, done: Finished, eos) -> dict:
        st = done.result.stats
        reason = FINISH_REASONS.get(st.get("finish_reason"), "length")
        if endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {**head, "object": obj, "choices": [choice], "usage": usage(done, eos), "stats": _jsonable(st)}

    async def _sse(handle, endpoint: str, head: dict, disconnected, notes: dict, include_usage: bool, t0: float):
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

        def chunk(delta_text: str | None, reason=None, extra=None, delta=None) -> str:
            if endpoint == "chat":
                delta = delta or ({} if delta_text is None else {"content": delta_text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": reason}
            return _event({**head, "object": obj, "choices": [choice], **(extra or {})})

        finished, first = False, None
        try:
            if endpoint == "chat":
                yield chunk(None, delta={"role": "assistant", "content": ""})
            async for kind, value in handle.events(disconnected=disconnected, shutdown=lambda: drain.expired):
                if kind == "cancelled":
                    return
                if kind == "shutdown":  # headers are sent: the error travels as an event, then [DONE]
                    err = _shutting_down()
                    metrics.request(endpoint, err.status, time.perf_counter() - t0)
                    yield _event(err.body())
                if kind in ("piece", "done") and first is None:
                    first = time.perf_counter() - t0
                    metrics.timing(endpoint, first, handle.queue_seconds)
                if kind == "piece":
                    yield chunk(value)
                elif kind == "done":
                    st = value.result.stats
                    metrics.request(endpoint, 200, time.perf_counter() - t0, st)
                    reason = FINISH_REASONS.get(st.get("finish_reason"), "length")
                    yield chunk(None, reason, {"usage": usage(value, eos), "stats": _jsonable(st), **notes})
                    if include_usage:  # OpenAI's usage-only chunk: no choices
                        yield _event({**head, "object": obj, "choices": [], "usage": usage(value, eos)})
                elif kind == "error":  # headers are sent: the error travels as an event
                    err = _run_error(value)
                    metrics.request(endpoint, err.status, time.perf_counter() - t0)
                    yield _event(err.body())
            finished = True
            yield "data: [DONE]\n\n"
        finally:  # the client disconnected (the response task is cancelled) or the stream ended
            if not finished:
                handle.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    return app


def _run_error(exc: BaseException) -> RequestError:
    """An error raised while a request decoded (after its checks passed), by type: the round cap the request asked
    to fail on (on_round_cap="error") is a 400 naming max_rounds; anything else (NaN / inf logits, a failed
    collective, a bug) is a 500 naming its type, except an allocation failure: 503 with Retry-After."""
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    if isinstance(exc, RoundCapError):
        return RequestError(str(exc), "max_rounds")
    if isinstance(exc, StepTimeoutError):  # a hung step: this server is unhealthy until it returns
        return RequestError(str(exc), None, 503, "server_error", "step_timeout")
    if is_out_of_memory(exc):  # the batch it ran in was freed; the server goes on (503 + Retry-After)
        return RequestError(f"out of memory while decoding ({type(exc).__name__}: {str(exc).splitlines()[0]}); the "
                            "request's batch was freed: retry later, or lower max_tokens / branching_factor", None,
                            503, "server_error", "out_of_memory")
    return RequestError(f"{type(exc).__name__}: {exc}", None, 500, "server_error")
