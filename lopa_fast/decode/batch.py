"""Many D2F / LoPA requests at once: every live request's branch windows in ONE forward per round.

Each request keeps its own round state, tables, static prefix cache and finish line (a `FastDecoder`
driven step by step: `begin` / `next_bucket` / `prepare` / `finish` / `read_head` / `after_round` /
`result`); per round the batch runs one `model.forward_requests` over all live requests' windows (each
layer's projections, norms and MLP once for all rows; attention per request over its own keys and window in
the shapes of a solo round), then each request's own bookkeeping (the C++ twin on CPU, the torch round
elsewhere). So every request's tokens, forwards and stats are those of running it alone (tests/test_batch.py),
and a finished request leaves the batch (its rows are not computed again).

`Scheduler` adds continuous batching at round granularity: `submit()` queues a request, and at every
round boundary the queue is admitted into the running batch while the rows (sum of branch slots) stay
within `max_rows`; admission never changes a running request's tokens (each request's computation is
independent of its neighbours). Eager rounds only (compile=True runs requests one at a time).
`BatchEngine` serves callers on many threads (the server) from one engine thread running the schedulers.
"""
from __future__ import annotations

from collections import deque

import torch

from lopa_fast.decode.engine import FastDecoder
from lopa_fast.decode.syncs import round_scope
from lopa_fast.errors import KnobError
from lopa_fast.output import GenerateOutput


class Scheduler:
    """Requests of one model and one decoding config, batched per round (see the module docstring).

    model: DecoderLM; cfg: a bound GenerateConfig (one strategy, one set of knobs for every request);
    branching_factor / name: as `FastDecoder`; max_rows: the most branch slots (rows of the forward's batch,
    k + 1 per LoPA request) live at once (None: no cap). A request alone larger than the cap is refused."""

    def __init__(self, model, cfg, branching_factor: int, name: str, max_rows: int | None = None):
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise KnobError(f"max_rows={max_rows!r}; allowed: None or an int >= 1", knob="max_rows", value=max_rows)
        self.model, self.cfg, self.k, self.name, self.max_rows = model, cfg, branching_factor, name, max_rows
        self.queue: deque = deque()  # (request id, prompt, on_round, cfg)
        self.live: dict[int, FastDecoder] = {}
        self.done: dict[int, GenerateOutput] = {}
        self.failed: dict[int, Exception] = {}  # requests ended by their own error (step's docstring)
        self.rounds = 0  # batched forwards run
        self.last_batch = 0  # requests in the last step's forward
        self._next_id = 0

    def submit(self, prompt, on_round=None, cfg=None) -> int:
        """Queue a prompt (LongTensor [P] on the model's device; cfg: its bound config when it differs from
        the scheduler's only in its length, e.g. a per-prompt default max_new_tokens); returns its request id."""
        rid = self._next_id
        self._next_id += 1
        self.queue.append((rid, prompt, on_round, cfg or self.cfg))
        return rid

    def _rows(self, dec: FastDecoder) -> int:
        return dec.geo.NB

    def _admit(self) -> None:
        used = sum(self._rows(d) for d in self.live.values())
        while self.queue:
            rid, prompt, on_round, cfg = self.queue[0]
            dec = FastDecoder(self.model, prompt, cfg, self.k, self.name)
            need = self._rows(dec)
            if self.max_rows is not None and need > self.max_rows:
                raise KnobError(f"max_rows={self.max_rows} is smaller than one request's {need} branch slots",
                                knob="max_rows", value=self.max_rows)  # fmt: skip
            if self.max_rows is not None and used + need > self.max_rows and self.live:
                return  # wait for rows to free
            self.queue.popleft()
            dec.begin(on_round)
            self.live[rid] = dec
            used += need

    def step(self) -> list[int]:
        """Admit what fits, then run one batched round for every live request; returns the ids that finished
        (their outputs are in `self.done`, or their exception in `self.failed`).

        A request's own error (NaN/inf logits, its round cap under on_round_cap="error", an exception raised by its
        on_round hook, e.g. a cancelled stream) ends that request only: it leaves the batch with its exception and
        the others go on. An error of the shared forward ends the step for all (it is raised)."""
        self._admit()
        finished, plan = [], []
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
                del self.live[rid]
                finished.append(rid)
            else:
                plan.append((rid, dec, b))
        self.last_batch = len(plan)
        if not plan:
            return finished
        with round_scope():
            ws = [dec.prepare(*b) for _, dec, b in plan]
            outs = self.model.forward_requests([dec.forward_args(w) for (_, dec, _), w in zip(plan, ws)],
                                               self.cfg_mode, plan[0][1].geo.attn_backend)  # fmt: skip
            for (_, dec, _), w, (logits, k_win, v_win) in zip(plan, ws, outs):
                dec.finish(w, logits, k_win, v_win)
                dec.read_head()
        for rid, dec, _ in plan:
            try:
                dec.after_round()
            except Exception as e:  # noqa: BLE001 - e.g. its hook raised: this request ends, the batch goes on
                self._fail(rid, e)
                finished.append(rid)
        self.rounds += 1
        return finished

    def _fail(self, rid: int, exc: Exception) -> None:
        self.failed[rid] = exc
        self.live.pop(rid, None)

    @property
    def cfg_mode(self) -> str:
        return "full" if self.cfg.use_full_attention else "block_causal"

    def run(self) -> dict[int, GenerateOutput]:
        """Step until every submitted request has finished; returns {request id: output} (requests that failed
        are in `self.failed`). Each request's own round cap (max_rounds) bounds its rounds, so the loop ends."""
        while self.queue or self.live:
            self.step()
        return self.done


def run_batch(model, prompts: list, cfgs: list, branching_factor: int, name: str, max_rows: int | None = None,
              on_round=None) -> list[GenerateOutput]:
    """Decode `prompts` (LongTensors [P_i] on model.device, with their bound configs `cfgs`) together; outputs
    in the prompts' order. on_round: None or one hook per prompt (a list)."""
    hooks = on_round if on_round is not None else [None] * len(prompts)
    if len(prompts) == 1:  # nothing to share: the solo round (no per-request split of the forward)
        return [FastDecoder(model, prompts[0], cfgs[0], branching_factor, name).run(hooks[0])]
    sched = Scheduler(model, cfgs[0], branching_factor, name, max_rows)
    ids = [sched.submit(p, h, c) for p, h, c in zip(prompts, hooks, cfgs)]
    done = sched.run()
    for i in ids:  # a prompt's own error is raised as decoding it alone would raise it (the first, in order)
        if i in sched.failed:
            raise sched.failed[i]
    return [done[i] for i in ids]


class BatchEngine:
    """Continuous batching for callers on many threads (the server): `generate(prompt, cfg, on_round)` blocks
    its caller while one engine thread runs every submitted request in the running batch, admitted at the next
    round boundary (`Scheduler`; one scheduler per (strategy, branching factor, attention mode), stepped in
    turn). Each caller gets exactly its solo result, or its own exception (e.g. its hook raised: a cancelled
    stream); the other requests go on.

    model: DecoderLM; max_rows: the live branch-slot cap per scheduler (None: no cap); start: False keeps the
    thread from stepping until `start()` (tests use it to line requests up)."""

    def __init__(self, model, max_rows: int | None = None, start: bool = True):
        import threading

        self.model, self.max_rows = model, max_rows
        self._cv = threading.Condition()
        self._incoming: list = []  # (prompt, cfg, on_round, box)
        self._schedulers: dict = {}
        self._waiting: dict = {}  # (scheduler key, request id) -> box
        self.max_live = 0  # the most requests seen in one batched round
        self.rounds = 0
        self._closed = False
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lopa_fast.batch_engine", daemon=True)
        self._thread.start()
        if start:
            self.start()

    def start(self) -> None:
        self._go.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._go.set()
        self._thread.join()

    @staticmethod
    def covers(cfg) -> bool:
        """Whether a bound config can join a batch: d2f / lopa on the fast backend, eager, one process."""
        return cfg.strategy in ("d2f", "lopa") and not cfg.compile and not getattr(cfg, "distributed", False)

    def generate(self, prompt, cfg, on_round=None) -> GenerateOutput:
        """Decode one prompt (LongTensor [P] on the model's device; cfg bound, `covers(cfg)`) in the running
        batch; blocks until it finishes. Raises the request's own exception."""
        import threading

        box = {"event": threading.Event()}
        with self._cv:
            if self._closed:
                raise RuntimeError("BatchEngine: closed")
            self._incoming.append((prompt, cfg, on_round, box))
            self._cv.notify_all()
        box["event"].wait()
        if "error" in box:
            raise box["error"]
        return box["out"]

    def _loop(self) -> None:
        self._go.wait()
        with torch.inference_mode():  # thread-local: the callers' inference mode does not reach this thread
            self._serve()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._incoming and not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed and not self._incoming and not self._waiting:
                    return
                incoming, self._incoming = self._incoming, []
            for prompt, cfg, on_round, box in incoming:
                k = cfg.branching_factor if cfg.strategy == "lopa" else 1
                key = (cfg.strategy, k, bool(cfg.use_full_attention))
                sched = self._schedulers.get(key)
                if sched is None:
                    sched = self._schedulers[key] = Scheduler(self.model, cfg, k, cfg.strategy, self.max_rows)
                self._waiting[(key, sched.submit(prompt, on_round, cfg))] = box
            for key, sched in self._schedulers.items():
                if not (sched.queue or sched.live):
                    continue
                try:
                    ended = sched.step()
                except Exception as e:  # noqa: BLE001 - the shared forward failed: every request of this batch ends
                    ended = list(sched.live) + [rid for rid, *_ in sched.queue]
                    sched.live.clear()
                    sched.queue.clear()
                    for rid in ended:
                        sched.failed[rid] = e
                self.max_live = max(self.max_live, sched.last_batch)
                self.rounds += 1
                for rid in ended:
                    box = self._waiting.pop((key, rid))
                    if rid in sched.failed:
                        box["error"] = sched.failed.pop(rid)
                    else:
                        box["out"] = sched.done.pop(rid)
                    box["event"].set()
