"""Counting host syncs (device-to-host reads) while a decoding round runs.

CPU has no sync debug mode, so `count_host_syncs()` patches the Tensor methods through which a value
travels to the host (`item`, `tolist`, `__bool__`, `__int__`, `__float__`, `__index__`, `nonzero`, `cpu`,
`numpy`) with counting wrappers, globally, for the duration of the context. The fast decoder opens a
`round_scope()` around each round's device work; calls made inside a scope are attributed to rounds.

On CUDA, `torch.cuda.set_sync_debug_mode("warn")` reports every synchronizing call as a warning;
`count_host_syncs(cuda=True)` counts those warnings instead (it also keeps the CPU patch, which catches
reads that do not synchronize, e.g. of CPU tensors).

Usage:
    with count_host_syncs() as counter:
        out = generate(model, ids, backend="fast", ...)
    counter.per_round  # list[int]: host reads inside each round
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import torch

_PATCHED = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
_state = threading.local()


class SyncCounter:
    """Host reads seen while counting: `total` overall, `per_round` inside each `round_scope`."""

    def __init__(self):
        self.total = 0
        self.per_round: list[int] = []
        self.where: dict[str, int] = {}
        self._in_round = False

    def hit(self, name: str) -> None:
        self.total += 1
        self.where[name] = self.where.get(name, 0) + 1
        if self._in_round and self.per_round:
            self.per_round[-1] += 1


def active_counter() -> SyncCounter | None:
    return getattr(_state, "counter", None)


class _RoundScope:
    """`round_scope`'s context (a class: a generator-based context manager raises and catches a StopIteration at every
    exit, a cold path that costs a tiny CPU round ~5 us)."""

    __slots__ = ("counter",)

    def __enter__(self) -> None:
        c = self.counter = active_counter()
        if c is not None:
            c.per_round.append(0)
            c._in_round = True

    def __exit__(self, *exc) -> bool:
        if self.counter is not None:
            self.counter._in_round = False
        return False


def round_scope() -> _RoundScope:
    """Attribute host reads inside this block to one decoding round (no-op unless counting)."""
    return _RoundScope()


@contextlib.contextmanager
def count_host_syncs(cuda: bool | None = None):
    """Count device-to-host reads (see module docstring). Not re-entrant; not for production use."""
    if active_counter() is not None:
        raise RuntimeError("count_host_syncs: already counting (not re-entrant)")
    counter = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def wrap(name, fn):
        def counted(self, *a, **kw):
            c = active_counter()
            # only count reads that cross the device boundary on CPU too: any value leaving a tensor
            if c is not None and not getattr(_state, "inside", False):
                c.hit(name)
            _state.inside = True  # a patched method calling another one counts once
            try:
                return fn(self, *a, **kw)
            finally:
                _state.inside = False

        counted.__name__ = name
        return counted

    use_cuda = torch.cuda.is_available() if cuda is None else cuda
    _state.counter = counter
    _state.inside = False
    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    prev_mode = None
    try:
        if use_cuda:
            prev_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield counter
            counter.cuda_sync_warnings = sum("synchroniz" in str(w.message) for w in caught)
        else:
            yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        if prev_mode is not None:
            torch.cuda.set_sync_debug_mode(prev_mode)
        _state.counter = None
