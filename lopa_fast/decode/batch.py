"""The one decoding loop (`Scheduler.step`): every live request's branch windows in ONE forward per round (per
forward of a round). A solo request is a batch of one (`run_solo`, the `fast` entry of every strategy with a
driver), a list of prompts `run_batch`, the server's requests `BatchEngine`'s; no driver has a loop of its own.

How a round runs here (the drivers, the KV pool, attention per request or pooled, multi-forward rounds, continuous
batching, compiled groups): docs/internals.md.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from lopa_fast.decode import compiled_batch
from lopa_fast.decode.compiled import rounds_of
from lopa_fast.decode.driver import batch_step_of, forwards_of
from lopa_fast.decode.shapes import LENGTH_QUANTUM, quantized_length
from lopa_fast.decode.kv_pool import KVPool
from lopa_fast.decode.syncs import round_scope
from lopa_fast.errors import KnobError, StepTimeoutError, drop_frames, is_out_of_memory
from lopa_fast.output import GenerateOutput


def batchable(cfg, spec) -> bool:
    """Whether requests of this validated config can share a forward: its strategy (`spec`, the registry's
    lopa_fast.strategies.Strategy the plan resolved: this package imports no strategy) has a driver whose steps of
    this config batch (`batches`), one process, and with compile=True a driver that runs compiled batched steps
    (`compile_batches`; otherwise compiled requests run one at a time)."""
    if spec.driver is None or not spec.batches(cfg) or cfg.distributed:
        return False
    return cfg.compile is not True or spec.compile_batches


class Scheduler:
    """Requests of one model and one decoding config, batched per round (see the module docstring).

    model: DecoderLM; cfg: a bound GenerateConfig (one strategy, one set of knobs for every request); spec: its
    strategy's spec (the plan's; it gives the per-request driver and the rows of one request); verifier: the second
    model of a strategy that takes one (its spec's `takes_verifier`: APD), the same object for every request of the
    scheduler, so a round's verifier forwards are one; max_rows: the most branch slots (rows of the forward's batch, k +
    1 per LoPA request) live at once (None: no cap); max_slots: the most requests live at once (KV pool slots; None: no
    cap); slot_len: the most cache rows of one pool slot (a request needs its buffer length + 1: `engine.buffer_len`;
    None: no cap). A request that can never fit (more rows than max_rows, a longer cache than slot_len) is refused by
    `submit` with a KnobError; one that fits waits in the queue until rows and a slot free. `pool`: the KV pool
    (lopa_fast.decode.kv_pool) holding every live request's committed prefix."""

    def __init__(self, model, cfg, max_rows: int | None = None, max_slots: int | None = None,
                 slot_len: int | None = None, verifier=None, *, spec):
        for knob, v in (("max_rows", max_rows), ("max_slots", max_slots), ("slot_len", slot_len)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise KnobError(f"{knob}={v!r}; allowed: None or an int >= 1", knob=knob, value=v)
        self.model, self.cfg, self.spec = model, cfg, spec
        if self.spec.driver is None:
            raise KnobError(f"Scheduler: strategy={cfg.strategy!r} has no batch driver (its requests run one at a "
                            "time)", knob="strategy", value=cfg.strategy)
        self._driver = self.spec.load("driver")
        # the driver's extra models (the strategy's verifier), passed to every request's driver
        self._extra = {"verifier": verifier} if self.spec.takes_verifier else {}
        self.max_rows, self.max_slots, self.slot_len = max_rows, max_slots, slot_len
        self.queue: deque = deque()  # (request id, prompt, on_round, cfg, rows, cache rows)
        self.live: dict = {}  # request id -> its driver
        self.done: dict[int, GenerateOutput] = {}
        self.failed: dict[int, Exception] = {}  # requests ended by their own error (step's docstring)
        self.pool = KVPool(model)
        self.slot_of: dict[int, int] = {}  # live request id -> its pool slot
        self.workspace_of: dict = {}  # live request id -> the workspace key of its last compiled batched step
        self.state_of: dict = {}  # live request id -> the state dict of its last compiled batched step (lane resident)
        self._rows: dict[int, int] = {}  # request id -> the cache rows of its pool slot (the spec's cache_rows)
        self.rows_per_request = self.spec.rows(cfg)  # branch slots (forward rows) of one request (LoPA: k + 1)
        self.rounds = 0  # batched forwards run
        self.last_batch = 0  # requests in the last step's forward
        self.oom_splits = 0  # shared forwards that ran out of memory and were retried in halves (`_forward_split`)
        self.last_groups = 0  # forwards of the last step (the eager one, one per compiled step key)
        self._next_id = 0

    def submit(self, prompt, on_round=None, cfg=None) -> int:
        """Queue a prompt (LongTensor [P] on the model's device; cfg: its bound config when it differs from
        the scheduler's only in its length, e.g. a per-prompt default max_new_tokens); returns its request id.
        Raises KnobError when the request can never fit the caps (max_rows, slot_len)."""
        cfg = cfg or self.cfg
        need, cache_rows = self.rows_per_request, self.spec.cache_rows(prompt.numel(), cfg)
        if self.max_rows is not None and need > self.max_rows:
            raise KnobError(f"max_rows={self.max_rows} is smaller than one request's {need} branch slots",
                            knob="max_rows", value=self.max_rows)
        if self.slot_len is not None and cache_rows > self.slot_len:
            raise KnobError(f"slot_len={self.slot_len} is smaller than this request's {cache_rows} cache rows (prompt "
                            f"{prompt.numel()} + max_new_tokens {cfg.max_new_tokens}, rounded up to a multiple of "
                            f"{LENGTH_QUANTUM}, + 1)", knob="slot_len", value=self.slot_len)
        self._rows[self._next_id] = cache_rows
        rid = self._next_id
        self._next_id += 1
        self.queue.append((rid, prompt, on_round, cfg, need, cache_rows))
        return rid

    def _admit(self) -> list[int]:
        """Admit the queue's head while rows and slots allow (at least one request when none is live); the pool is
        sized once for the admitted group. Returns the ids of requests whose own setup failed (in `failed`)."""
        used, n_live = len(self.live) * self.rows_per_request, len(self.live)
        take = []
        for item in self.queue:
            need = item[4]
            if n_live + len(take) > 0 and (
                (self.max_rows is not None and used + need > self.max_rows)
                or (self.max_slots is not None and n_live + len(take) >= self.max_slots)
            ):
                break  # first come, first served: wait for rows / a slot to free
            take.append(item)
            used += need
        if not take:
            return []
        for _ in take:
            self.queue.popleft()
        # the pool's doubling stays within the slots its live and admitted requests need (what their estimates
        # reserve: lopa_fast.memory.request_bytes' cache term); past that it grows to the exact need
        need = sum(quantized_length(r) for r in [*(self._rows[rid] for rid in self.live), *(t[5] for t in take)])
        for st in self.state_of.values():  # a growth copies the pool's rows: every cache back in its slot first
            compiled_batch.release(st)
        grown = self.pool.ensure(max(t[5] for t in take), len(self.pool.used) + len(take), self.slot_len,
                                 self.max_slots, max_bytes=need * self.pool.row_bytes)
        if grown:  # the live requests' caches move to the new pool (their rows copied): re-point their views
            for rid, dec in self.live.items():
                dec.use_cache(*self.pool.views(self.slot_of[rid], self._rows[rid]))
        failed = []
        for rid, prompt, on_round, cfg, _, cache_rows in take:
            slot = self.pool.acquire(cache_rows)
            self.slot_of[rid] = slot
            try:
                dec = self._driver(self.model, prompt, cfg, cache=self.pool.views(slot, cache_rows), **self._extra)
                dec.begin(on_round)
            except Exception as e:  # noqa: BLE001 - this request's setup failed: it ends, the batch goes on
                self._fail(rid, e)
                failed.append(rid)
                continue
            self.live[rid] = dec
        return failed

    def step(self) -> list[int]:
        """Admit what fits, then run one batched round for every live request; returns the ids that finished
        (their outputs are in `self.done`, or their exception in `self.failed`). A finished request's pool slot
        and rows are free for the next admission.

        A request's own error (NaN/inf logits, its round cap under on_round_cap="error", an exception raised by its
        on_round hook, e.g. a cancelled stream) ends that request only: it leaves the batch with its exception and
        the others go on. So does one whose forward alone runs out of memory (the shared forward is retried in halves
        first: `_forwards`). Any other error of the shared forward ends the step for all (it is raised; `abort` ends
        them)."""
        finished, plan = self._admit(), []
        for rid, dec in list(self.live.items()):
            try:
                b = dec.next_bucket()
                if b is None:
                    self.done[rid] = dec.result()
            except Exception as e:  # noqa: BLE001 - this request's error, handed to its caller
                self._fail(rid, e)
                finished.append(rid)
                continue
            if b is None:
                self._leave(rid)
                finished.append(rid)
            else:
                plan.append((rid, dec, b))
        self.last_batch = len(plan)
        if not plan:
            return finished
        # a driver's compiled steps (compile=True, or auto on CUDA) come as BatchSteps (its optional `batch_step`;
        # None: an eager step), grouped by key: one batched graph each (compiled_batch)
        eager, groups = [], {}
        for item in plan:
            step = batch_step_of(item[1], item[2])
            if step is None:
                compiled_batch.release(self.state_of.get(item[0]))  # an eager step reads its pool slot (pooled)
                eager.append(item)
            else:
                groups.setdefault(step.key, []).append((item[1], step))
                self.workspace_of[item[0]] = step.workspace
                self.state_of[item[0]] = step.state  # (its lane residency ends when it leaves: `_leave`)
        failed_now: set = set()
        with round_scope():
            if eager:
                failed_now = self._forwards(eager, [dec.prepare(*b) for _, dec, b in eager])
            for members in groups.values():
                outs = compiled_batch.run([st for _, st in members], self.model)
                for (dec, _), (st, info) in zip(members, outs):
                    dec.take(st, info)
                    dec.read_head()
            self.last_groups = len(groups) + bool(eager)
        finished += sorted(failed_now)  # out of memory alone (`_forwards`): they left the batch, the others go on
        for rid, dec, _ in plan:
            if rid in failed_now:
                continue
            try:
                dec.after_round()
            except Exception as e:  # noqa: BLE001 - e.g. its hook raised: this request ends, the batch goes on
                self._fail(rid, e)
                finished.append(rid)
        self.rounds += 1
        return finished

    def _forwards(self, plan: list, ws: list) -> set:
        """The round's forwards (inside its round_scope). A driver's round is one forward of the scheduler's model
        (its `mode` / `attn_backend`) or, when its `forwards(w)` gives them ((model, mask, attn backend), ... in
        order: APD's drafter then verifier), several: forward f of every request whose round has one runs as ONE
        `forward_requests` per (model, mask, backend) (a scheduler's requests share the model, the mask and the
        verifier: one group), then each request's `finish` (which prepares its next forward's inputs); `read_head`
        after its last. "model" is anything with `forward_requests` (e.g. a stand-in for a forward the model does
        not batch itself), grouped by equality. The KV pool holds the scheduler's model's caches; another model's
        forward (the verifier's) attends over each request's own cache (no pool).
        A shared forward that runs out of memory is retried in halves (`_forward_split`: each request's result is
        the one it gets alone, so the retry changes no value); a request whose forward alone runs out of memory
        fails with that error and leaves the batch, the others go on (issue 43: one OOM failed the whole batch).
        Returns the ids of the requests that failed so."""
        seqs = [forwards_of(dec, w, self.model) for (_, dec, _), w in zip(plan, ws)]
        failed: set = set()
        for f in range(max(len(q) for q in seqs)):
            groups: dict = {}
            for i, seq in enumerate(seqs):
                if f < len(seq) and plan[i][0] not in failed:
                    groups.setdefault(seq[f], []).append(i)
            for (model, mode, backend), idx in groups.items():
                for i, out in self._forward_split(model, mode, backend, plan, ws, idx).items():
                    if isinstance(out, BaseException):
                        failed.add(plan[i][0])
                        self._fail(plan[i][0], out)
                        continue
                    logits, k_win, v_win = out
                    dec = plan[i][1]
                    dec.finish(ws[i], logits, k_win, v_win)
                    if f == len(seqs[i]) - 1:
                        dec.read_head()
        return failed

    def _forward_split(self, model, mode, backend, plan: list, ws: list, idx: list) -> dict:
        """{plan index: (logits, k_win, v_win), or the allocation error of a request that ran out of memory alone}
        for one group's forward; an out-of-memory group of several requests is retried in two halves (the freed
        activations of the failed attempt first)."""
        pooled = model is self.model and len(idx) > 1  # one request: its own slot views, as solo
        parts = [plan[i][1].forward_args(ws[i]) for i in idx]
        if pooled:
            parts = [dict(p, slot=self.slot_of[plan[i][0]]) for p, i in zip(parts, idx)]
        try:
            outs = model.forward_requests(parts, mode, backend, pool=(self.pool.k, self.pool.v) if pooled else None)
        except Exception as e:  # noqa: BLE001 - only an allocation failure is retried; anything else ends the step
            if not is_out_of_memory(e):
                raise
            err = drop_frames(e)  # the failed attempt's activations go now
            del parts
            self.oom_splits += 1
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            if len(idx) == 1:
                return {idx[0]: err}
            half = len(idx) // 2
            return {**self._forward_split(model, mode, backend, plan, ws, idx[:half]),
                    **self._forward_split(model, mode, backend, plan, ws, idx[half:])}
        return dict(zip(idx, outs))

    def _leave(self, rid: int) -> None:
        """A request leaves the batch: its rows and its pool slot free."""
        self.live.pop(rid, None)
        self._rows.pop(rid, None)
        self.workspace_of.pop(rid, None)
        compiled_batch.release(self.state_of.pop(rid, None))  # its state back in its own tensors (the pool slot's)
        slot = self.slot_of.pop(rid, None)
        if slot is not None:
            self.pool.release(slot)

    def _fail(self, rid: int, exc: Exception) -> None:
        self.failed[rid] = exc
        self._leave(rid)

    def abort(self, exc: Exception) -> list[int]:
        """End every live and queued request with `exc` (e.g. the shared forward failed); returns their ids."""
        ended = list(self.live) + [item[0] for item in self.queue]
        self.queue.clear()
        for rid in ended:
            self._fail(rid, exc)
        return ended

    def run(self) -> dict[int, GenerateOutput]:
        """Step until every submitted request has finished; returns {request id: output} (requests that failed
        are in `self.failed`). Each request's own round cap (max_rounds) bounds its rounds, so the loop ends. An
        error that ends a whole step (the shared forward's, an interrupt) is raised after `abort` ended every request
        (none stays resident in a compiled lane: compiled_batch.release)."""
        try:
            while self.queue or self.live:
                self.step()
        except BaseException as e:  # the shared step failed (or an interrupt): every request ends with it, its lane
            try:  # residency and pool slot released (`abort`), then the error goes on as it came
                self.abort(e)
            except Exception:  # noqa: BLE001 - a failed clean-up must not hide the error that caused it
                logging.getLogger(__name__).exception("Scheduler.run: ending the requests after an error failed")
            raise
        return self.done


def run_batch(model, prompts: list, cfgs: list, max_rows: int | None = None, on_round=None,
              verifier=None, *, spec) -> list[GenerateOutput]:
    """Decode `prompts` (LongTensors [P_i] on model.device, with their bound configs `cfgs`, one strategy that
    `batchable`) together; outputs in the prompts' order. on_round: None or one hook per prompt (a list);
    verifier: the strategy's second model, if it takes one (`Scheduler`)."""
    hooks = on_round if on_round is not None else [None] * len(prompts)
    sched = Scheduler(model, cfgs[0], max_rows, verifier=verifier, spec=spec)
    ids = [sched.submit(p, h, c) for p, h, c in zip(prompts, hooks, cfgs)]
    done = sched.run()
    for i in ids:  # a prompt's own error is raised as decoding it alone would raise it (the first, in order)
        if i in sched.failed:
            raise sched.failed[i]
    return [done[i] for i in ids]


def run_solo(model, prompt, cfg, verifier=None, on_round=None, *, spec) -> GenerateOutput:
    """The fast path of every strategy whose spec gives a driver (the spec's `fast`): one request as a batch of
    one, stepped by the one loop (`Scheduler.step`; its KV pool slot is its cache; compile=True: the compiled batch
    step of batch bucket 1). prompt: LongTensor [P] on model.device; cfg: bound and covered (lopa_fast.api checked
    it, and the pair of models for a strategy that takes a verifier); on_round: the progress hook; spec: the
    strategy's (the registry's `load("fast")` binds it). Raises the
    request's own error as its round found it."""
    sched = Scheduler(model, cfg, verifier=verifier, spec=spec)
    rid = sched.submit(prompt, on_round)
    sched.run()
    if rid in sched.failed:
        raise sched.failed[rid]
    return sched.done[rid]


def _tell(on_done, out, error) -> None:
    """A request's end to its caller (`BatchEngine.submit`'s on_done, on the engine thread); what the callback raises
    is logged, never the engine thread's end (it serves every other request)."""
    try:
        on_done(out, error)
    except Exception:  # noqa: BLE001 - the caller's bug, not the batch's
        logging.getLogger(__name__).exception("BatchEngine: a request's on_done raised")


class BatchEngine:
    """Continuous batching for callers on many threads (the server): `submit(prompt, cfg, on_round, on_done=)`
    hands a request over and returns (`generate` blocks its caller until the end) while one engine thread runs every
    submitted request in the running batch, admitted at the next round boundary (`Scheduler`; one scheduler per
    (strategy, rows per request, attention mode, verifier), stepped in turn). Each caller gets exactly its solo
    result, or its own exception (e.g. its hook raised: a cancelled stream); the other requests go on.

    model: DecoderLM; max_rows / max_slots / slot_len: each scheduler's caps (`Scheduler`; None: no cap); start:
    False keeps the thread from stepping until `start()` (tests use it to line requests up).

    Memory: a scheduler's KV pool goes with its last request (the scheduler is dropped). The compiled-batch lane
    workspaces its requests used stay after them (with the graphs over them: the next request of those shapes
    replays), counted, until `reclaim()` (the server's budget calls it when a request would wait for memory) frees
    those no live request uses (`compiled_batch.free_workspaces`). `held_bytes`: what the pools and lanes hold now;
    on_held(n) (the server's `MemoryBudget.hold`) hears, after every change, the part of it beyond the live
    requests' shares of their estimates (`lopa_fast.memory.resident_bytes`: a pool slot, two lanes when
    compiled)."""

    def __init__(self, model, max_rows: int | None = None, start: bool = True, max_slots: int | None = None,
                 slot_len: int | None = None, on_held=None, step_timeout_s: float | None = None,
                 share_bytes=None):
        self.model, self.max_rows, self.max_slots, self.slot_len = model, max_rows, max_slots, slot_len
        # the watchdog: a step running longer fails the requests waiting on the engine (`stalled`, `generate`)
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # time.monotonic() when the running step began (None: between)
        self._on_held = on_held
        # the memory accounting is passed in (the server's: lopa_fast.memory.resident_bytes(model, total, cfg,
        # verifier)): a request's share of the pools and lanes; without one no share is counted
        self._share_bytes = share_bytes or (lambda model, total, cfg, verifier: 0)
        self._shares: dict = {}  # (scheduler key, request id) -> its estimate's share of the pools and lanes
        self.held_bytes = 0
        self._sizes = None  # the pools' bytes and the lane counts at the last `_account` (`_held_changed`)
        self._workspaces: set = set()  # workspace keys its requests used (it frees only those: a request decoding
        # outside the engine, e.g. the server's self-check, keeps its own)
        self._reclaim = False  # reclaim() asked: free the idle lanes at the next turn of the engine thread
        self._cv = threading.Condition()
        self._incoming: list = []  # (prompt, cfg, spec, on_round, verifier, on_done)
        self._schedulers: dict = {}
        self._waiting: dict = {}  # (scheduler key, request id) -> its on_done
        self.max_live = 0  # the most requests seen in one batched round
        self.batch_sizes: dict[int, int] = {}  # requests in one batched round -> rounds of that size (/metrics)
        self.rounds = 0
        self.oom_splits = 0  # its schedulers' out-of-memory forwards retried in halves (/health)
        self._closed = False
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lopa_fast.batch_engine", daemon=True)
        self._thread.start()
        if start:
            self.start()

    def start(self) -> None:
        self._go.set()

    def alive(self) -> bool:
        """Whether the engine thread still runs (an exception that escaped its loop ends it: nothing is served)."""
        return self._thread.is_alive()

    def stalled(self) -> float | None:
        """Seconds the running step has taken when that is past `step_timeout_s` (a hung forward: the watchdog's
        verdict), else None."""
        started, limit = self._step_started, self.step_timeout_s
        if started is None or limit is None:
            return None
        took = time.monotonic() - started
        return took if took > limit else None

    def reclaim(self) -> None:
        """Free, on the engine thread, the lane workspaces no live request uses (any thread may ask; the held bytes
        are reported again once done)."""
        with self._cv:
            self._reclaim = True
            self._cv.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests; the engine thread ends once the submitted ones have (waits at most `timeout`
        seconds for it; None: until it ends)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._go.set()
        self._thread.join(timeout)

    @staticmethod
    def covers(cfg, spec) -> bool:
        """Whether a bound config can join a batch (`batchable`: a strategy with a driver, one process, compiled only
        with `compile_batches`)."""
        return batchable(cfg, spec)

    def submit(self, prompt, cfg, on_round=None, verifier=None, *, spec, on_done) -> None:
        """Hand one prompt (LongTensor [P] on the model's device; cfg bound, `covers(cfg, spec)`; spec: its
        strategy's; verifier: the strategy's second model, checked by the caller) to the running batch and return at
        once. `on_done(out, error)` runs on the engine thread when the request ends: its GenerateOutput and None, or
        None and its own exception (a refusal: it can never fit the caps; its hook raised; NaN logits). It must not
        block: every other request waits for it. Raises RuntimeError when the engine is closed."""
        with self._cv:
            if self._closed:
                raise RuntimeError("BatchEngine: closed")
            self._incoming.append((prompt, cfg, spec, on_round, verifier, on_done))
            self._cv.notify_all()

    def generate(self, prompt, cfg, on_round=None, verifier=None, *, spec) -> GenerateOutput:
        """`submit`, then block until the request finishes; returns its output or raises its own exception."""
        box, ended = {}, threading.Event()

        def on_done(out, error):
            box.update(out=out, error=error)
            ended.set()

        self.submit(prompt, cfg, on_round, verifier, spec=spec, on_done=on_done)
        # the watchdog (step_timeout_s): a caller does not wait on a step that hangs; its request fails with
        # StepTimeoutError (it is dropped at its next round if the step ever returns: its hook sees the cancel)
        while not ended.wait(None if self.step_timeout_s is None else min(1.0, self.step_timeout_s / 4)):
            took = self.stalled()
            if took is not None:
                raise StepTimeoutError(took, self.step_timeout_s)
        if box["error"] is not None:
            raise box["error"]
        return box["out"]

    def _loop(self) -> None:
        self._go.wait()
        with torch.inference_mode():  # thread-local: the callers' inference mode does not reach this thread
            self._serve()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._incoming and not self._waiting and not self._closed and not self._reclaim:
                    self._cv.wait()
                if self._closed and not self._incoming and not self._waiting:
                    return
                incoming, self._incoming = self._incoming, []
                reclaim, self._reclaim = self._reclaim, False
            if reclaim:
                self._account(free=True)
            for prompt, cfg, spec, on_round, verifier, on_done in incoming:
                # one verifier object per scheduler (its round's verifier forward is one); the scheduler holds it,
                # so its id is not reused while the key lives; the rest of the key is the strategy's (`share_key`:
                # what its requests' forwards must agree on, e.g. D2F / LoPA's attention mode)
                key = (cfg.strategy, spec.rows(cfg), *spec.share_key(cfg), id(verifier))
                sched = self._schedulers.get(key)
                if sched is None:
                    sched = self._schedulers[key] = Scheduler(self.model, cfg, self.max_rows, self.max_slots,
                                                              self.slot_len, verifier, spec=spec)
                try:
                    rid = sched.submit(prompt, on_round, cfg)
                    self._waiting[(key, rid)] = on_done
                    self._shares[(key, rid)] = self._share_bytes(self.model, prompt.numel() + cfg.max_new_tokens,
                                                                     cfg, verifier)
                except Exception as e:  # noqa: BLE001 - refused (it can never fit the caps): only its caller hears
                    _tell(on_done, None, e)
            for key, sched in list(self._schedulers.items()):
                if not (sched.queue or sched.live):
                    # idle: dropped with its KV pool (a client cycling k or modes would otherwise grow memory
                    # without bound: one pool per key, ~225 MiB each for a 7B model in bf16); the next request of
                    # its key builds a new one
                    del self._schedulers[key]
                    continue
                self._step_started = time.monotonic()
                splits = sched.oom_splits
                try:
                    ended = sched.step()
                except Exception as e:  # noqa: BLE001 - the shared forward failed: every request of this batch ends
                    ended = sched.abort(e)
                finally:
                    self._step_started = None
                    self.oom_splits += sched.oom_splits - splits
                self.max_live = max(self.max_live, sched.last_batch)
                if sched.last_batch:
                    self.batch_sizes[sched.last_batch] = self.batch_sizes.get(sched.last_batch, 0) + 1
                self._workspaces.update(sched.workspace_of.values())
                self.rounds += 1
                ends = []
                for rid in ended:
                    on_done = self._waiting.pop((key, rid))
                    self._shares.pop((key, rid), None)
                    if rid in sched.failed:  # its frames' tensors (the batch's activations) go now, not with its caller
                        ends.append((on_done, None, drop_frames(sched.failed.pop(rid))))
                    else:
                        ends.append((on_done, sched.done.pop(rid), None))
                if not (sched.queue or sched.live):
                    del self._schedulers[key]  # its last request ended: the pool goes with it (see above)
                if ended or self._held_changed():  # before the callers hear: the budget sees the freed memory first
                    self._account()
                for end in ends:
                    _tell(*end)
                del ends

    def _held_changed(self) -> bool:
        """Whether the pools or the lanes changed size since the last `_account` (a growth, a new workspace)."""
        cr = rounds_of(self.model)
        lanes = 0 if cr is None else (len(cr.fns), sum(len(w["lanes"]) for k, w in cr.workspaces.items()
                                                        if k[:1] == ("batch",)))
        now = (sum(s.pool.nbytes() for s in self._schedulers.values()), lanes)
        changed, self._sizes = now != self._sizes, now
        return changed

    def _account(self, free: bool = False) -> None:
        """Count what the pools and lanes hold (`held_bytes`) and report the part beyond the live requests' shares
        (on_held); free: first free the lanes its requests used that no live request uses (`reclaim`)."""
        cr = rounds_of(self.model)
        lanes = 0
        if cr is not None:
            if free:
                live = {w for s in self._schedulers.values() for w in s.workspace_of.values()}
                compiled_batch.free_workspaces(cr, live, self._workspaces - live)
                self._workspaces &= live
            lanes = compiled_batch.lane_bytes(cr, self._workspaces)
        self.held_bytes = sum(s.pool.nbytes() for s in self._schedulers.values()) + lanes
        self._held_changed()
        if self._on_held is not None:
            self._on_held(max(0, self.held_bytes - sum(self._shares.values())))
