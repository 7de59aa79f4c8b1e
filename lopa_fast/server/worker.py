"""The server's request-execution seam: `Worker.submit(job) -> Handle`; the HTTP side sees only `submit`,
`Handle.events()` and `Handle.cancel()`.

A request the batch engine covers is handed to it once, by `submit` (or, while no seat or memory is free, by one
`_pump` task on the event loop); the engine thread emits its pieces and its end straight to the event loop. Other
requests (the reference backend, strategies without a driver, `batch=False`) run one at a time on a job thread.
The flow, cancellation and the watchdog: docs/serve.md "Execution and cancellation".
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import threading
import time

import lopa_fast
from lopa_fast.memory import resident_bytes
from lopa_fast.errors import drop_frames, is_out_of_memory

MAX_PENDING = 64  # requests queued or running at once; one more is refused (HTTP 503), never queued without bound


def free_memory() -> None:
    """Hand memory no tensor holds back: the cycle collector, CUDA's cached blocks, and glibc's free heap pages
    (malloc_trim: freed small blocks otherwise stay in the process, and under an address-space cap they are the
    room the next request needs)."""
    import ctypes
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class Busy(RuntimeError):
    """The queue holds MAX_PENDING requests already (the server answers 503)."""


class Cancelled(Exception):
    """Raised by the per-round hook in the worker thread when the request's handle was cancelled."""


@dataclasses.dataclass
class Job:
    """One request as the worker runs it.

    prompt_ids: the encoded prompt (list[int], the chat template already applied).
    knobs:      generate knobs (GenerateConfig field names; stop excluded), already validated by the caller.
    stop:       lopa_fast.stream's stop=: text stops (str) and / or token-id sequences (list[int]), or None.
    """

    prompt_ids: list[int]
    knobs: dict
    stop: list | None = None
    memory: int = 0  # the request's memory estimate (limits.Limits.check): reserved against the budget while it runs
    plan: object = None  # the request resolved and checked once by the caller (protocol.parse's Parsed.plan): run as
    #                      it is, not resolved again; None: resolved here from knobs / stop (lopa_fast.stream)
    text_stops: list = dataclasses.field(default_factory=list)  # with `plan`: its text stops
    unit: int = 1  # with `plan`: the pieces' unit (the requested config's length unit)


@dataclasses.dataclass
class Finished:
    """The end of a request: the text (pieces joined), generate's output (generated_ids, stats) and the prompt ids."""

    text: str
    result: object  # lopa_fast.GenerateOutput
    prompt_ids: list[int]


class Handle:
    """One submitted request, read from the asyncio side.

    `events()` yields ("piece", str) for every piece of text as it becomes final, then exactly one of
    ("done", Finished), ("error", exception), ("cancelled", None) or
    ("shutdown", None). `cancel()` may be called from any thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.rounds = 0  # rounds the per-round hook has seen (a cancelled request's progress when it stopped)
        # the watchdog of a request on the batch engine (no thread of ours waits on it): polled by `events` while no
        # event arrives; it ends the request when the engine's step is past its deadline (Worker._watchdog)
        self.watch = None
        self.ended = False  # its end was counted and emitted (Worker._end: once, whichever thread gets there first)
        # time.monotonic() at submit and when the worker took it up: the queue time /metrics reports
        self.submitted, self.started = time.monotonic(), None

    @property
    def queue_seconds(self) -> float | None:
        """Seconds the request waited before the worker took it up (None: it has not started)."""
        return None if self.started is None else max(0.0, self.started - self.submitted)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Drop the request if it waits; stop it at its next round if it runs (its result is discarded)."""
        self._cancelled.set()

    def check(self, prefix=None, info=None) -> None:
        """The per-round hook (worker thread): raise Cancelled once the request was cancelled."""
        if self._cancelled.is_set():
            raise Cancelled
        self.rounds += 1

    def emit(self, kind: str, value=None) -> None:
        """Hand an event to the asyncio side (worker thread). A loop already closed (server shut down) drops it."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:
            pass

    async def events(self, disconnected=None, poll_s: float = 0.25, shutdown=None):
        """The request's events (class docstring). disconnected: an async callable polled every `poll_s` seconds
        while no event arrives; when it returns True the request is cancelled and ("cancelled", None) ends the
        iteration. shutdown: a callable checked before every event and every poll; when it returns True (the
        server's drain deadline has passed) the request is cancelled and ("shutdown", None) ends the iteration,
        so its handler can still answer before the server closes the connection."""
        while True:
            if shutdown is not None and shutdown():
                self.cancel()
                yield "shutdown", None
                return
            try:
                kind, value = await asyncio.wait_for(self._events.get(), poll_s)
            except asyncio.TimeoutError:
                if self.watch is not None:
                    self.watch()  # a stalled step: the end event is queued now
                if disconnected is not None and await disconnected():
                    self.cancel()
                    yield "cancelled", None
                    return
                continue
            yield kind, value
            if kind != "piece":
                return


class Worker:
    """Runs submitted requests (module docstring); `counts` for /health (plus `batch` facts of the engine).

    batch: share forwards between concurrent requests through a BatchEngine (False: one request at a time, as
    a plain sequential server); concurrency: the job threads for the requests the engine does not cover (they run
    one at a time: default 1; the engine caps its live requests at limits.max_num_seqs); limits: the server's caps
    (lopa_fast.server.limits.Limits: the batch engine's rows and live requests, the memory budget every running
    request's estimate is reserved against)."""

    def __init__(self, model, tokenizer, *, max_pending: int = MAX_PENDING,
                 batch: bool = True, concurrency: int | None = None, limits=None, verifier=None):
        from lopa_fast.decode.batch import BatchEngine
        from lopa_fast.decode.shapes import quantized_length
        from lopa_fast.server.limits import Limits, MemoryBudget

        self.model, self.tokenizer = model, tokenizer
        self.verifier = verifier  # APD's, for the requests that use one (Strategy.uses_verifier)
        self.limits = limits = (limits or Limits()).bind(model)
        concurrency = concurrency or 1
        self.max_pending = max_pending
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._solo = threading.Lock()  # requests outside the batch engine run one at a time (whatever `concurrency`)
        self.memory = MemoryBudget(limits.memory_budget)
        # each scheduler's KV pool: at most --max-num-seqs slots of --max-model-len positions (the slot of the
        # longest request the limits admit); what the pools and lanes hold beyond the running requests' estimates
        # counts against the budget (`MemoryBudget.hold`)
        self.engine = BatchEngine(model, max_rows=limits.max_batch_rows, max_slots=limits.max_num_seqs,
                                  slot_len=quantized_length(limits.max_model_len) + 1,
                                  on_held=self.memory.hold, share_bytes=resident_bytes,
                                  step_timeout_s=limits.step_timeout_s) if batch else None
        if self.engine is not None:  # a request that would wait for memory first frees the engine's idle lanes
            self.memory.reclaim = self.engine.reclaim
        self.counts = {"pending": 0, "running": 0, "served": 0, "cancelled": 0, "failed": 0, "out_of_memory": 0}
        self._health = {"status": "ok", "self_check": "not run"}
        self._defaults: dict = {}
        self._recovering = threading.Lock()
        self._running: set = set()  # the handles close cancels: decoding now, or waiting for a seat on the loop
        self._waiting: collections.deque = collections.deque()  # (handle, stream, memory) of requests on the engine
        #                                                         waiting for a seat (`_pump` hands them off)
        self._pumping = False  # a `_pump` task runs
        self._wake = None  # (its loop, its asyncio.Event): set by `_end`, a seat or memory may be free now
        self._probe_failed = False  # the self-check after an out-of-memory failure failed (it runs again)
        self._closed = False  # close() was called
        self._threads = [threading.Thread(target=self._serve, name=f"lopa_fast.server.worker.{i}", daemon=True)
                         for i in range(concurrency if batch else 1)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        """Validate `job` and queue it; returns its Handle. Bad input raises here, typed as lopa_fast.stream
        raises it (KnobError, ValueError, TypeError, ...), before anything is queued or run; a full queue raises
        Busy. Call from the event loop's thread (or pass `loop`). A request the engine covers is handed to it from
        here when its memory estimate fits now (else by a task on `loop` once it does); the others go to the job
        thread."""
        from lopa_fast.output.stream import TextStream
        from lopa_fast.request.text import text_decoder

        handle = Handle(loop or asyncio.get_running_loop())
        if job.plan is not None:  # validated once, by the caller: run as it is
            text = TextStream.of_plan(job.plan, text_decoder(self.tokenizer), job.text_stops, job.unit,
                                      on_round=handle.check, engine=self.engine)
        else:
            text = lopa_fast.stream(self.model, job.prompt_ids, tokenizer=self.tokenizer, stop=job.stop,
                                    on_round=handle.check, engine=self.engine, verifier=self._verifier_for(job.knobs),
                                    **job.knobs)
        if self.engine is not None and self.engine.stalled() is not None:  # the watchdog: nothing would be served
            raise Busy("the batch engine's current step is past its deadline (--step-timeout); the server is unhealthy")
        with self._lock:
            if self.counts["pending"] >= self.max_pending:
                raise Busy(f"{self.counts['pending']} requests are queued or running (the cap is {self.max_pending})")
            self.counts["pending"] += 1
        if not text.on_engine:
            self._queue.put((handle, text, job.memory))
            return handle
        with self._lock:  # first come, first served: it waits behind any request already waiting for a seat
            waits = bool(self._waiting) or not self._take_seat(job.memory)
            if waits:
                self._waiting.append((handle, text, job.memory))
                self._running.add(handle)
                pump, self._pumping = not self._pumping, True
        if not waits:
            self._hand_off(handle, text, job.memory)
        elif pump:  # the waiting requests are handed off by one task on the event loop, not by a thread
            asyncio.run_coroutine_threadsafe(self._pump(), handle._loop)
        return handle

    def _take_seat(self, memory: int) -> bool:
        """(Under `_lock`.) Count a request on the engine as running when a seat is free (at most
        limits.max_num_seqs decode at once) and its memory estimate fits the budget now."""
        if self.counts["running"] >= self.limits.max_num_seqs or not self.memory.try_reserve(memory):
            return False
        self.counts["running"] += 1
        return True

    async def _pump(self) -> None:
        """Hand the waiting requests on the engine off in order, each once a seat and its memory are free; drop a
        cancelled one before it starts. Ends when none waits (the next one to wait starts it again)."""
        wake = asyncio.Event()
        self._wake = (asyncio.get_running_loop(), wake)
        while True:
            wake.clear()
            ready, dropped = [], []
            with self._lock:
                for item in [w for w in self._waiting if w[0].cancelled]:
                    self._waiting.remove(item)
                    self._running.discard(item[0])
                    dropped.append(item[0])
                while self._waiting and self._take_seat(self._waiting[0][2]):
                    ready.append(self._waiting.popleft())
                idle = not self._waiting
                if idle:
                    self._pumping = False
            for handle in dropped:
                self._count(pending=-1, cancelled=1)  # dropped before it started
                handle.emit("cancelled")
            for item in ready:
                self._hand_off(*item)
            del ready, dropped
            if idle:
                return
            try:  # woken when a request ends (`_end`, on the engine's thread); a cancel is seen within 50 ms
                await asyncio.wait_for(wake.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    def _hand_off(self, handle: Handle, text, memory: int) -> None:
        """The one hand-off of a request on the engine (its seat taken, its memory reserved): the engine thread emits
        its pieces and its end to the event loop; `Handle.events` runs its watchdog."""
        self._start(handle, counted=True)
        handle.watch = self._watchdog(handle, text, memory)
        try:
            text.submit(lambda piece: handle.emit("piece", piece),
                        lambda error: self._ended(handle, text, memory, error))
        except Exception as e:  # noqa: BLE001 - e.g. the engine is closed: this request fails, nothing else
            self._ended(handle, text, memory, e)

    def _ended(self, handle: Handle, text, memory: int, error: BaseException | None) -> None:
        """`_end` of a request on the engine (its thread, or the watchdog's on the event loop): the self-check it may
        ask for (a decode) runs on a thread of its own, beside the engine's, which serves every other request."""
        if self._end(handle, text, memory, error):
            threading.Thread(target=self._recover, name="lopa_fast.server.recover", daemon=True).start()

    def _watchdog(self, handle: Handle, text, memory: int):
        """A request on the engine fails with StepTimeoutError once the engine's step is past its deadline (no
        thread of ours waits on it: `Handle.events` polls this); the engine drops it at its next round, if the step
        ever returns (its end, then, is not counted again)."""
        from lopa_fast.errors import StepTimeoutError

        def watch() -> None:
            took = self.engine.stalled()
            if took is not None:
                self._ended(handle, text, memory, StepTimeoutError(took, self.engine.step_timeout_s))

        return watch

    def _start(self, handle: Handle, counted: bool = False) -> None:
        """A request starts decoding (counted: its seat was counted as running already, `_take_seat`)."""
        if not counted:
            self._count(running=1)
        handle.started = time.monotonic()
        with self._lock:
            self._running.add(handle)

    def _end(self, handle: Handle, text, memory: int, error: BaseException | None) -> bool:
        """A running request ended (error None: served): its memory released, the counts, then its end event; once
        per request (the engine's end after the watchdog's is ignored).
        Returns whether the server should check itself now (`_recover`: after an out-of-memory failure, or a request
        served after a failed probe)."""
        with self._lock:
            if handle.ended:
                return False
            handle.ended = True
            self._running.discard(handle)
        oom = False
        if error is None:
            end, outcome = ("done", Finished(text.text, text.result, text.prompt_ids)), "served"
        elif isinstance(error, Cancelled):
            end, outcome = ("cancelled", None), "cancelled"
        else:  # the request fails, the worker keeps serving
            oom = is_out_of_memory(error)
            handle.cancel()  # e.g. a step timeout: if its step ever returns, the engine drops it at its next round
            end, outcome = ("error", drop_frames(error)), "failed"  # its frames' tensors are freed now
        self.memory.release(memory)
        self._count(running=-1, pending=-1, out_of_memory=int(oom), **{outcome: 1})  # before the end event
        if self._wake is not None and self._waiting:  # a waiting request may take the seat and memory now
            try:
                self._wake[0].call_soon_threadsafe(self._wake[1].set)
            except RuntimeError:  # its loop closed
                pass
        handle.emit(*end)
        return oom or (outcome == "served" and self._probe_failed)  # after a failed probe: check once more

    def _verifier_for(self, knobs: dict):
        """The server's verifier for a request whose knobs use one (apd with apd_mixture_weight), else None."""
        from lopa_fast import strategies
        from lopa_fast.config import GenerateConfig

        if self.verifier is None:
            return None
        cfg = GenerateConfig(**knobs)
        return self.verifier if strategies.get(cfg.strategy).uses_verifier(cfg) else None

    def warm_up(self, defaults: dict | None = None) -> None:
        """Before serving: the self-check (`self_check`: finite weights, one short request with the server's
        defaults). A failed self-check is logged and makes /health unhealthy (503 naming the reason); the server
        still answers requests."""
        self._defaults = dict(defaults or {})
        self.self_check(weights=True)

    def self_check(self, weights: bool = False) -> bool:
        """Whether the server can decode: (weights=True) every weight finite, then one short request with the
        server's defaults (one new token) decodes. Sets `health` (the /health answer) and returns the verdict."""
        import logging
        import warnings

        import torch

        log = logging.getLogger("lopa_fast.server")
        reason = None
        if weights:
            bad = next((n for n, t in self.model.named_parameters() if not bool(torch.isfinite(t).all())), None)
            if bad is not None:
                reason = f"the weight {bad} holds NaN or inf"
        if reason is None:
            knobs = {**self._defaults, "max_new_tokens": 1}
            bos = getattr(self.model.config, "bos_token_id", None)
            try:
                with warnings.catch_warnings(), torch.inference_mode():
                    warnings.simplefilter("ignore")
                    lopa_fast.generate(self.model, [bos if bos is not None else 1], **knobs,
                                       verifier=self._verifier_for(knobs))
            except Exception as e:  # noqa: BLE001 - the verdict, not a crash
                reason = f"a one-token request failed: {type(e).__name__}: {e}"
                drop_frames(e)
        with self._lock:
            self._health = {"status": "ok" if reason is None else "unhealthy", "self_check": reason or "passed"}
        if reason is not None:
            log.error("self-check failed (%s); /health reports unhealthy", reason)
        return reason is None

    @property
    def health(self) -> dict:
        """/health's facts: status "ok" (the last self-check passed) or "unhealthy", the self-check's verdict, the
        requests that failed for memory (`out_of_memory`), and `counts`."""
        with self._lock:
            facts = {**self._health, **self.counts}
        # liveness: a job thread or the batch engine's thread that has died (an exception escaped it) serves nothing
        # more, whatever the last self-check said (issue 43: /health read "ok" beside a dead engine)
        dead = [t.name for t in self._threads if not t.is_alive()]
        if self.engine is not None and not self.engine.alive():
            dead.append("lopa_fast.batch_engine")
        if dead and not self._closed:
            facts.update(status="unhealthy", dead_threads=dead)
        # the watchdog: a batched step running past --step-timeout (a hung forward) serves nobody
        stalled = self.engine.stalled() if self.engine is not None else None
        if stalled is not None:
            facts.update(status="unhealthy", stalled_step_s=round(stalled, 1))
        return facts

    def _recover(self) -> None:
        """After a request failed for memory: give the freed memory back (the collector, the allocator's caches,
        glibc's free lists), then check the server still decodes (one probe at a time; the others skip it). A
        probe that fails leaves /health unhealthy until a request is served again."""
        if not self._recovering.acquire(blocking=False):
            return
        try:
            free_memory()
            self._probe_failed = not self.self_check()
        finally:
            self._recovering.release()

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker: queued requests are cancelled, running ones too (they stop at their next round: by
        now nobody reads them, the server drained or its drain deadline passed). Waits at most `timeout` seconds
        for the job threads and the engine's (None: until they end)."""
        import time

        with self._lock:
            running = list(self._running)
            self._closed = True  # its threads end from here on: /health no longer calls that a fault
        for h in running:
            h.cancel()
        for _ in self._threads:
            self._queue.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.engine is not None and not any(t.is_alive() for t in self._threads):
            # its requests were cancelled above: they leave at their next round, and its thread ends
            self.engine.close(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _count(self, **delta) -> None:
        with self._lock:
            for k, v in delta.items():
                self.counts[k] += v

    def _serve(self) -> None:
        """A job thread: the requests the engine does not cover, one at a time (`_solo`)."""
        while True:
            item = self._queue.get()
            if item is None:
                self._drain()
                return
            handle, text, memory = item
            # a request waits (queued) until the running ones leave its memory estimate room in the budget
            if handle.cancelled or not self.memory.reserve(memory, lambda: handle.cancelled):
                self._count(pending=-1, cancelled=1)  # dropped before it started
                handle.emit("cancelled")
                continue
            self._start(handle)
            error = None
            try:
                with self._solo, text:  # the pieces go to the event loop from this thread, the one running the rounds
                    text.run(lambda piece: handle.emit("piece", piece))
            except Exception as e:  # noqa: BLE001 - the request fails (or was cancelled), the worker keeps serving
                error = e
            if self._end(handle, text, memory, error):
                self._recover()
            # this thread holds nothing of a finished request while it waits for the next (a stream, its caches)
            del item, handle, text, error

    def _drain(self) -> None:
        stops = 0  # the other job threads' stop markers go back for them
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stops += 1
            else:
                self._count(pending=-1, cancelled=1)
                item[0].emit("cancelled")
        for _ in range(stops):
            self._queue.put(None)
