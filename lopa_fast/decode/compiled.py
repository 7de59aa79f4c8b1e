"""Compiled rounds: `generate(..., compile=True)` compiles each bucket's round once and replays it.

A bucket is (the request's Geometry, Nb window columns, Rb LM-head rows, the statistics knobs that change the
graph: `key`; float knobs are runtime inputs in the round's tables, never keys); its round
(`lopa_fast.decode.round.round_step`: forward + selection + commit + spawn + the next plan) is

* on CUDA: captured as one `torch.cuda.CUDAGraph` over a static workspace (the round state tensors,
  allocated once per model and Geometry and reused by every later request of the same shapes); a replay
  updates the workspace in place. Capturing needs no compiler, so a 28-layer model costs one eager round
  per bucket instead of minutes of `torch.compile`.
* on CPU: `torch.compile(fullgraph=True, dynamic=False)` of the same function (Inductor); shapes are
  static per bucket, so every bucket compiles exactly once.

Callables are cached per model (weakly) and bucket: a second `generate` with the same shapes compiles
nothing. A workspace serves one request at a time (a batch's requests use compiled_batch's lanes instead). `stats()` reports graphs compiled / captured, the buckets used, and compile seconds per bucket.
The prefill round (window = prompt + first block, a bucket per prompt length) always runs eagerly.
The same machinery (`_run`) serves the APD step (`apd_step`) and the vanilla / threshold steps (`steps_step`:
lopa_fast.decode.static_steps, buckets (kind, *sizes), every step compiled, no prefill).
Batched steps (many requests' steps of one key as one graph per batch-size bucket) use the same LRUs, counters and
`capture`: lopa_fast.decode.compiled_batch.
Warm-up: run one `generate(..., compile=True)` with the shapes you will serve (docs/fast_decoder.md).
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import types
import warnings
import weakref

import torch

from lopa_fast.decode import round as rnd
from lopa_fast.logs import LONG_S

log = logging.getLogger(__name__)
# torch.compile of a bucket takes seconds (said at INFO); a CUDA-graph capture is one eager round (DEBUG unless long)
_COMPILING = "compiling %s (torch.compile, the first request of this shape)..."

_PER_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CODE_IDS = itertools.count()


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# the most compiled / captured buckets (and workspaces) one model keeps: the float knobs (temperature, top_p,
# thresholds, alpha) are runtime inputs, not keys, but prompt-length bands, batch shapes and the structural knobs
# still multiply them, so a bound keeps GPU graph memory and Dynamo's caches finite (issue 28 finding 5); the least
# recently used bucket goes first and compiles again if asked
MAX_BUCKETS = 64


class LRU(collections.OrderedDict):
    """A dict of at most `cap` entries: `get` and assignment make an entry the most recent, the least recent one
    leaves when a new one would exceed the cap (`evicted` counts them)."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap, self.evicted = cap, 0

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)
            self.evicted += 1


class RequestView:
    """One request's compile statistics: fallback (its compile=None: a failed capture runs the step eagerly), graphs
    built during it, the buckets it used, the seconds of the buckets it compiled (by label)."""

    __slots__ = ("fallback", "graphs", "buckets", "seconds")

    def __init__(self, fallback: bool):
        self.fallback, self.graphs, self.buckets, self.seconds = fallback, 0, set(), {}


class CompiledRounds:
    """The compiled / captured rounds of one model, keyed by bucket (at most MAX_BUCKETS, least recently used out)."""

    def __init__(self, cap: int = MAX_BUCKETS):
        self.fns = LRU(cap)  # bucket key -> callable(st, T) -> (st, info)
        self.emulate_graphs = False  # tests: take the CUDA-graph path on CPU (with `capture` emulated)
        self.workspaces = LRU(cap)  # (geo) -> static state dict (CUDA graphs; a graph keeps its own alive)
        self.compile_seconds = LRU(cap)  # bucket key -> seconds of its first (compiling) call
        self.graphs = 0  # graphs compiled (CPU) or captured (CUDA) so far for this model
        # the current request's view, per thread (requests on several threads share this object): fallback (its
        # compile=None: a failed capture runs the step eagerly), graphs, buckets used, seconds of buckets compiled
        self._local = threading.local()

    def _request(self) -> "RequestView":
        """This thread's current request view (an empty one before the thread's first `for_model`)."""
        view = getattr(self._local, "view", None)
        if view is None:
            view = self._local.view = RequestView(False)
        return view

    def view(self) -> "RequestView":
        """The current request's view (`for_model` just made it): a batch's request keeps it to be counted in
        (`run_batch`, `stats(view)`), since one engine thread runs many requests."""
        return self._request()

    def _count(self, n: int, views=None) -> None:
        """n graphs compiled / captured for this thread's request (or for each of `views`) and the model's total.
        Dynamo's counter is process-wide, so a compile on another thread at the same moment would be counted here
        too."""
        self.graphs += n
        for view in views or (self._request(),):
            view.graphs += n

    @classmethod
    def for_model(cls, model, cfg=None) -> "CompiledRounds":
        """The model's compiled steps, its per-request statistics reset. cfg: the request's config; with
        compile=None (auto) a capture that fails falls back to the eager step with a warning (`fallback`)."""
        cr = _PER_MODEL.get(model)
        if cr is None:
            cr = _PER_MODEL[model] = cls()
        cr._local.view = RequestView(cfg is not None and cfg.compile is None)
        return cr

    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def key(geo, cfg, Nb: int, Rb: int) -> tuple:
        """A D2F / LoPA round's compile key: the geometry, the bucket and what of the statistics knobs changes the
        graph: the confidence, top_k (a shape), the mask suppression, and whether T > 0 / a top-p filter applies.
        Their float values are runtime inputs (the tables, lopa_fast.decode.round.round_knobs), not keys."""
        stats_knobs = (cfg.sampling_strategy, cfg.top_p is not None and cfg.top_p < 1, cfg.top_k,
                       cfg.suppress_mask_token, cfg.temperature > 0)  # fmt: skip
        return (geo, stats_knobs, Nb, Rb)

    def step(self, model, st: dict, T: dict, geo, cfg, Nb: int, Rb: int) -> dict:
        """Run one D2F / LoPA round of bucket (Nb, Rb) with the compiled / captured callable (`run` with the round
        of lopa_fast.decode.round bound to the bucket); returns (state, info)."""
        return self.run(self.key(geo, cfg, Nb, Rb), (Nb, Rb), f"{Nb}x{Rb}", lambda: _bound_step(model, geo, cfg, Nb, Rb),
                        model, st, T, geo)

    def run(self, key: tuple, bucket: tuple, label: str, make, model, st: dict, T: dict, geo) -> tuple[dict, dict]:
        """One step of any strategy with the compiled / captured callable of `key` (hashable: the step's geometry
        and bucket; the caller's step function decides what it computes, this layer knows no strategy). `make()`
        returns the step, step(st, T) -> (st, info) with its own code object (`unique_code`); it is captured over
        geo's workspace (CUDA, or emulate_graphs) or torch.compile'd (CPU) on the key's first call, then replayed.
        Counted in stats() (bucket: compiled_buckets' entry; label: compile_seconds' name). The APD step
        (lopa_fast.decode.apd), the vanilla / threshold steps (lopa_fast.decode.static_steps) run through it."""
        self._request().buckets.add(bucket)
        fn = self.fns.get(key)
        if fn is None:
            what = "the step " + label
            captured = st["x"].is_cuda or self.emulate_graphs
            t0, g0 = time.perf_counter(), _dynamo_graphs()
            step = make()
            if captured:
                log.debug("capturing %s (a CUDA graph)...", what)
                try:
                    fn = self._capture(model, st, T, geo, step)
                    self._count(1)
                except Exception as e:  # noqa: BLE001 - compile=None (auto) only: this bucket runs its step eagerly
                    if not self._request().fallback:
                        raise
                    warnings.warn(f"compile (auto): capturing {what} failed ({type(e).__name__}: {e}); this bucket "
                                  "runs eagerly (pass compile=True to make it an error)", RuntimeWarning,
                                  stacklevel=2)  # fmt: skip
                    fn = step
                self.fns[key] = fn
                out = fn(st, T)
            else:
                log.info(_COMPILING, what)
                fn = self.fns[key] = compile_guarded(step, what)
                out = fn(st, T)
                self._count(_dynamo_graphs() - g0)
            self.compile_seconds[key] = time.perf_counter() - t0
            self._request().seconds[label] = round(self.compile_seconds[key], 3)
            _log_done(what, self.compile_seconds[key], captured)
            return out
        g0 = _dynamo_graphs()
        out = fn(st, T)
        self._count(_dynamo_graphs() - g0)  # a recompile inside a bucket would show here
        return out

    def call(self, key: tuple, bucket: tuple[int, int], label: str, make, *args):
        """`make()` (a function of tensors and dicts of tensors with static shapes per key) compiled once per key
        with torch.compile(fullgraph=True, dynamic=False), on any device, and run on args. The machinery of
        `step` for a round split into parts that cannot be one graph: lopa_fast.distributed compiles a rank's
        forward + statistics and, separately, the selection + plan, with the collectives between them outside
        any graph. Counted in stats() as `step`'s graphs (bucket: (Nb, Rb); label: its compile_seconds name)."""
        self._request().buckets.add(bucket)
        fn = self.fns.get(key)
        g0 = _dynamo_graphs()
        if fn is None:
            log.info(_COMPILING, f"the round part {label}")
            fn = self.fns[key] = compile_guarded(own_code(make(), f"{label}_{next(_CODE_IDS)}"),
                                                 f"the round part {label}")  # fmt: skip
            t0 = time.perf_counter()
            out = fn(*args)
            self.compile_seconds[key] = time.perf_counter() - t0
            self._request().seconds[label] = round(self.compile_seconds[key], 3)
            _log_done(f"the round part {label}", self.compile_seconds[key], captured=False)
        else:
            out = fn(*args)
        self._count(_dynamo_graphs() - g0)  # a recompile inside a bucket would show here
        return out

    # ------------------------------------------------------------------------------------------------
    def _capture(self, model, st: dict, T: dict, geo, step):
        """Capture `step(st, T) -> (st, info)` (one bucket's round or step) as a CUDA graph over the geometry's
        static workspace."""
        ws = self.workspaces.get(geo)
        if ws is None or ws["state"].keys() != st.keys():
            ws = self.workspaces[geo] = {"state": {k: v.clone() for k, v in st.items()},
                                         "tables": {k: v.clone() for k, v in T.items()}}  # fmt: skip
        S, TS = ws["state"], ws["tables"]

        def body() -> dict:  # one round on the workspace, written back into it; returns the trace facts
            out, info = step(dict(S), TS)
            for k, v in out.items():
                if v is not S[k]:  # the cache is updated in place
                    S[k].copy_(v)
            return info

        # warm-up on scratch copies (kernels compile / autotune, cuBLAS initialises), then the capture
        graph_replay, info = self.capture(lambda: step({k: v.clone() for k, v in S.items()}, TS), body)

        def replay(cur: dict, tables: dict) -> tuple[dict, dict]:
            if cur is not S:  # a new request (or the eager prefill round): load its state into the workspace
                for k, v in cur.items():
                    S[k].copy_(v)
                for k, v in tables.items():
                    TS[k].copy_(v)
            graph_replay()
            return S, info  # info: graph-owned outputs, rewritten by the next replay

        return replay

    @staticmethod
    def capture(warmup, body):
        """(replay, body's outputs): `warmup()` on a side stream, then `body()` captured as one CUDA graph;
        replay() reruns the captured kernels, rewriting the same output tensors. (Tests replace this with a
        CPU emulation that reruns `body` to exercise the workspace logic without a device.)"""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warmup()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = body()
        return graph.replay, outputs

    def stats(self, view: "RequestView | None" = None) -> dict:
        """Per-request view (this thread's current one, or `view`): graphs built during this request, the buckets it
        used, and the seconds of each bucket it compiled (empty on a warm cache)."""
        view = view or self._request()
        return {
            "compiled_graphs": view.graphs,
            "compiled_buckets": sorted(view.buckets),
            "compile_seconds": dict(view.seconds),
        }


def compile_wanted(cfg, device) -> bool:
    """Whether a request compiles / captures its steps: compile=True, or compile=None (auto) on CUDA (capture; one
    process: distributed rounds run eager unless asked)."""
    if cfg.compile is None:
        return torch.device(device).type == "cuda" and not cfg.distributed
    return bool(cfg.compile)


# what dlopen says of a cached Inductor artifact a killed build left behind (a 0-byte or cut *.so)
_CORRUPT_ARTIFACT = ("file too short", "invalid ELF header", "ELF load command", "not a dynamic executable")


def _corrupt_artifact(exc: BaseException) -> bool:
    """Whether a compile failed on a corrupt cached artifact: dlopen's message somewhere in the exception chain
    (it reaches us wrapped, e.g. in Dynamo's BackendCompilerFailed, with no type of its own)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(m in str(exc) for m in _CORRUPT_ARTIFACT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def inductor_cache_dir() -> str | None:
    """Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR, else its default under the temp dir)."""
    try:
        from torch._inductor.runtime.runtime_utils import cache_dir
    except ImportError:  # another torch layout
        try:
            from torch._inductor.runtime.cache_dir_utils import cache_dir
        except ImportError:
            return None
    return cache_dir()


def purge_corrupt_artifacts(root: str | None = None) -> list[str]:
    """Delete the shared objects under Inductor's cache (or `root`) that cannot be loaded because they are cut
    short: empty, or shorter than an ELF header (64 bytes). Returns their paths. (A process killed while Inductor
    linked leaves a 0-byte *.so, and every later compile of that graph fails with "file too short": issue 36.)"""
    import os

    root = root or inductor_cache_dir()
    removed = []
    if root is None or not os.path.isdir(root):
        return removed
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            try:
                if f.endswith(".so") and os.path.getsize(path) < 64:
                    os.remove(path)
                    removed.append(path)
            except OSError:
                pass
    return removed


def compile_guarded(fn, what: str):
    """torch.compile(fn, fullgraph=True, dynamic=False), made to survive a corrupt Inductor cache: when the compiled
    call fails on a corrupt cached artifact (`_corrupt_artifact`; it fails while loading, before running anything),
    the cut-short artifacts are deleted (`purge_corrupt_artifacts`, so later compiles build them anew), one
    RuntimeWarning names them, and this callable runs `fn` eagerly from then on (same results: the compiled and
    eager steps are bit-equal, tests/test_compiled_*). Any other error propagates."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    state = {"fn": compiled}

    def call(*args, **kwargs):
        try:
            return state["fn"](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - only a corrupt artifact is handled; the rest is re-raised
            if state["fn"] is fn or not _corrupt_artifact(e):
                raise
            removed = purge_corrupt_artifacts()
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            warnings.warn(f"compile: the Inductor cache holds a corrupt artifact ({first}); removed "
                          f"{len(removed)} cut-short file(s) {removed[:3]}; {what} runs eagerly in this process, "
                          "later compiles rebuild", RuntimeWarning, stacklevel=2)  # fmt: skip
            state["fn"] = fn
            return fn(*args, **kwargs)

    return call


def _log_done(what: str, seconds: float, captured: bool) -> None:
    """The after-line of a compile (INFO) or a capture (DEBUG unless it took LONG_S or more)."""
    level = logging.INFO if not captured or seconds >= LONG_S else logging.DEBUG
    log.log(level, "%s %s in %.1f s", "captured" if captured else "compiled", what, seconds)


def own_code(fn, name: str):
    """fn as a function with its OWN code object named `name` (the same closure): Dynamo keeps compiled graphs per
    code object, so each bucket's function gets one (see _bound_step)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def unique_code(fn, name: str):
    """`own_code` under `name` plus a process-unique number (each bucket's step: its own code object)."""
    return own_code(fn, f"{name}_{next(_CODE_IDS)}")


def _bound_step(model, geo, cfg, Nb: int, Rb: int):
    """round_step with the bucket's constants bound, as a function with its OWN code object: Dynamo keeps
    its compiled graphs per code object (and refuses more than `recompile_limit` = 8 per object), so one
    shared closure would turn every new bucket into a "recompile" of the same code and scan all the other
    buckets' guards on each call."""

    def step(st: dict, T: dict) -> tuple[dict, dict]:
        return rnd.round_step(model, st, T, geo, cfg, Nb, Rb)

    code = step.__code__.replace(co_name=f"round_step_{Nb}x{Rb}_{next(_CODE_IDS)}")
    return types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)
