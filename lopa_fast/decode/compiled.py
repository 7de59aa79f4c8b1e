"""The compile layer: a step function compiled or captured once per key, then replayed. It knows no strategy.

A key is hashable (a step's geometry, bucket and the knobs that change its graph: the caller decides; float knobs
are runtime inputs in the step's tables, never keys). A step becomes a graph in one place (`CompiledRounds.build`):

* on CUDA (or under the tests' emulated capture, `emulate_graphs`): captured as one `torch.cuda.CUDAGraph` over
  static tensors the caller owns (a workspace: `CompiledRounds.workspace`); a replay rewrites them in place.
  Capturing needs no compiler, so a 28-layer model costs one eager step per key instead of minutes of
  `torch.compile`. Under compile=None (auto) a capture that fails runs the step eagerly with a warning.
* otherwise: `torch.compile(fullgraph=True, dynamic=False)` (`compile_guarded`, the one torch.compile call: it
  survives a corrupt Inductor cache); shapes are static per key, so every key compiles exactly once.

Callables and workspaces are cached per model (weakly: `CompiledRounds.for_model`) in LRUs of at most MAX_BUCKETS
(`get_or_build`: a second `generate` with the same shapes compiles nothing); `stats()` reports per request the
graphs compiled / captured, the buckets used and the compile seconds per bucket.
Users: lopa_fast.decode.compiled_batch (every compiled decoding step: a batch of requests whose steps share a key
as one graph per batch-size bucket; a solo request is batch bucket 1) and lopa_fast.distributed (`call`: a round
split into graphs around its collectives).
Warm-up: run one `generate(..., compile=True)` with the shapes you will serve (docs/fast_decoder.md).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import tempfile
import threading
import time
import types
import warnings
import weakref
from typing import Callable

import torch

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
    """The compiled / captured steps of one model, keyed (at most MAX_BUCKETS, least recently used out). Public
    interface: `for_model` / `view` / `stats` (per-request statistics), `get_or_build` (a key's callable, built
    on its first use and counted), `build` (a step as a graph: the one compile / capture site), `workspace` (the
    static tensors a captured graph reads), `captures` (whether steps on a tensor's device are captured), `call`
    (a compiled part of a round: lopa_fast.distributed)."""

    def __init__(self, cap: int = MAX_BUCKETS):
        self.fns = LRU(cap)  # key -> its callable (whatever the builder made)
        self.emulate_graphs = False  # tests: take the CUDA-graph path on CPU (with `capture` emulated)
        self.workspaces = LRU(cap)  # workspace key -> the static tensors of captured graphs (a graph keeps its own)
        self.compile_seconds = LRU(cap)  # key -> seconds of its first (compiling) call
        self.graphs = 0  # graphs compiled (CPU) or captured (CUDA) so far for this model
        # the current request's view, per thread (requests on several threads share this object): fallback (its
        # compile=None: a failed capture runs the step eagerly), graphs, buckets used, seconds of buckets compiled
        self._local = threading.local()

    def view(self) -> "RequestView":
        """This thread's current request view (`for_model` just made it; an empty one before the thread's first
        `for_model`): a batch's request keeps it to be counted in (`stats(view)`), since one engine thread runs many
        requests."""
        view = getattr(self._local, "view", None)
        if view is None:
            view = self._local.view = RequestView(False)
        return view

    def count(self, n: int, views=None) -> None:
        """n graphs compiled / captured for each of `views` (default: this thread's request) and the model's total.
        Dynamo's counter is process-wide, so a compile on another thread at the same moment would be counted here
        too."""
        self.graphs += n
        for view in views or (self.view(),):
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

    def captures(self, t: torch.Tensor) -> bool:
        """Whether steps over tensors like `t` are captured as CUDA graphs (t on CUDA, or `emulate_graphs`) rather
        than torch.compile'd."""
        return t.is_cuda or self.emulate_graphs

    def workspace(self, key, fits: Callable, make: Callable):
        """The static tensors stored under `key` (a captured graph reads and rewrites them): the stored ones when
        fits(them), else make()'s, stored (graphs captured over the old ones keep those alive)."""
        ws = self.workspaces.get(key)
        if ws is None or not fits(ws):
            ws = self.workspaces[key] = make()
        return ws

    # ------------------------------------------------------------------------------------------------
    def get_or_build(self, key, bucket: tuple, label: str, views, build: Callable, call: Callable, captured: bool,
                     what: str | None = None):
        """call(the callable of `key`): the cached one, or build()'s on the key's first use (then timed, logged and
        its seconds kept under `label`). bucket: the requests' `compiled_buckets` entry (views: their RequestViews);
        graphs Dynamo compiled during the call are counted for them (a recompile inside a bucket would show);
        captured: the builder captures (a CUDA graph, counted by `build`; DEBUG log unless long); what: its name in
        the log (default "the step <label>")."""
        views = list(views) or [self.view()]
        for v in views:
            v.buckets.add(bucket)
        fn = self.fns.get(key)
        first = fn is None
        g0, t0 = _dynamo_graphs(), time.perf_counter()
        if first:
            fn = self.fns[key] = build()
        out = call(fn)
        self.count(_dynamo_graphs() - g0, views)
        if first:
            seconds = self.compile_seconds[key] = time.perf_counter() - t0
            for v in views:
                v.seconds[label] = round(seconds, 3)
            # a compile at INFO; a capture (one eager round) at DEBUG unless it took LONG_S or more
            level = logging.INFO if not captured or seconds >= LONG_S else logging.DEBUG
            log.log(level, "%s %s in %.1f s", "captured" if captured else "compiled", what or "the step " + label,
                    seconds)
        return out

    def build(self, label: str, views, step: Callable, capture: tuple | None = None,
              what: str | None = None) -> Callable:
        """The one place a step becomes a graph. capture None: torch.compile(step) (`compile_guarded`, with its own
        code object), called as fn(*args). capture (warmup, body): warmup() on a side stream, then body() captured
        as one CUDA graph (`capture`); fn(*args) replays it (the graph reads its workspace, not args) and returns
        body's outputs (graph-owned tensors, rewritten by the next replay). Under compile=None (views[0].fallback)
        a capture that fails warns and fn = step, run eagerly. what: its name in the log and the warning."""
        what = what or "the step " + label
        if capture is None:
            log.info(_COMPILING, what)
            return compile_guarded(unique_code(step, label), what)
        log.debug("capturing %s (a CUDA graph)...", what)
        try:
            replay, outputs = self.capture(*capture)
        except Exception as e:  # noqa: BLE001 - compile=None (auto) only: this key runs its step eagerly
            if not views[0].fallback:
                raise
            warnings.warn(f"compile (auto): capturing {what} failed ({type(e).__name__}: {e}); it runs eagerly "
                          "(pass compile=True to make it an error)", RuntimeWarning, stacklevel=4)
            return step
        self.count(1, views)

        def replayed(*args):
            replay()
            return outputs

        return replayed

    def call(self, key: tuple, bucket: tuple, label: str, make: Callable, *args):
        """`make()` (a function of tensors and dicts of tensors with static shapes per key) compiled once per key
        (`build`: torch.compile on any device, never captured) and run on args. For a round split into parts that
        cannot be one graph: lopa_fast.distributed compiles a rank's forward + statistics and, separately, the
        selection + plan, with the collectives between them outside any graph. Counted in stats() (bucket: its
        compiled_buckets entry; label: its compile_seconds name)."""
        views, what = [self.view()], "the round part " + label
        return self.get_or_build(key, bucket, label, views, lambda: self.build(label, views, make(), what=what),
                                 lambda fn: fn(*args), captured=False, what=what)

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
        view = view or self.view()
        return {
            "compiled_graphs": view.graphs,
            "compiled_buckets": sorted(view.buckets),
            "compile_seconds": dict(view.seconds),
        }


def rounds_of(model) -> "CompiledRounds | None":
    """The model's CompiledRounds, or None when it never compiled (none is made here)."""
    return _PER_MODEL.get(model)


def compile_wanted(cfg, device) -> bool:
    """Whether a request compiles / captures its steps: compile=True, or compile=None (auto) on CUDA (capture; one
    process: distributed rounds run eager unless asked)."""
    if cfg.compile is None:
        return torch.device(device).type == "cuda" and not cfg.distributed
    return bool(cfg.compile)


def compiled_for(model, cfg, device) -> tuple["CompiledRounds | None", "RequestView | None"]:
    """A request's (the model's CompiledRounds, the request's view) when it compiles (`compile_wanted`), else
    (None, None): what every driver keeps to run its compiled steps and report their statistics."""
    if not compile_wanted(cfg, device):
        return None, None
    cr = CompiledRounds.for_model(model, cfg)
    return cr, cr.view()


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


def fresh_inductor_cache() -> str:
    """Point Inductor at a new, empty cache directory (TORCHINDUCTOR_CACHE_DIR, read by Inductor at each build) and
    return it: after a compile failed, later compiles in this process build every artifact anew instead of loading
    a cached one that may be what failed (a cut-short ISA probe library fails every C++ build: issue 43, finding 6)."""
    path = tempfile.mkdtemp(prefix="lopa_fast_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def compile_guarded(fn, what: str):
    """torch.compile(fn, fullgraph=True, dynamic=False), made to survive a broken compile: when the compiled call
    fails with anything but an out-of-memory error (which the server's recovery handles), this callable warns once
    and runs `fn` eagerly from then on (same results: the compiled and eager steps are bit-equal,
    tests/test_compiled_*), and later compiles use a clean Inductor cache directory (`fresh_inductor_cache`). A
    corrupt cached artifact (`_corrupt_artifact`: dlopen's messages) also has its cut-short files deleted
    (`purge_corrupt_artifacts`). An error of `fn` itself still propagates: the eager rerun raises it."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    state = {"fn": compiled}

    def call(*args, **kwargs):
        try:
            return state["fn"](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compile failure runs the step eagerly (issue 43, finding 6)
            if state["fn"] is fn or isinstance(e, torch.OutOfMemoryError):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            if _corrupt_artifact(e):
                removed = purge_corrupt_artifacts()
                cause = (f"the Inductor cache holds a corrupt artifact ({first}); removed {len(removed)} cut-short "
                         f"file(s) {removed[:3]}")
            else:
                cause = f"compiling {what} failed ({type(e).__name__}: {first})"
            clean = fresh_inductor_cache()
            warnings.warn(f"compile: {cause}; {what} runs eagerly in this process, later compiles rebuild in a clean "
                          f"cache {clean}", RuntimeWarning, stacklevel=2)
            state["fn"] = fn
            return fn(*args, **kwargs)

    return call


def unique_code(fn, name: str):
    """fn as a function with its OWN code object (the same closure), named `name` plus a process-unique number:
    Dynamo keeps compiled graphs per code object (and refuses more than `recompile_limit` = 8 per object), so one
    shared closure would turn every new bucket into a "recompile" of the same code and scan all the other buckets'
    guards on each call."""
    name = f"{name}_{next(_CODE_IDS)}"
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
