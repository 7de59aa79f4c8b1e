"""The library's logging: module loggers (`logging.getLogger(__name__)`) under the "lopa_fast" logger, which
carries only a NullHandler (lopa_fast/__init__.py): the application decides where records go. The CLI shows
INFO on stderr (`-q` warnings only, `-v` DEBUG; lopa_fast.cli.checks.log_to_stderr).

`step` frames a step that may take long (a torch.compile, a model load) with a line before it
and one after it with the seconds it took, so that no step stalls silently; `progress` is a tqdm bar over a
long countable step, shown only where those INFO lines are.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

ROOT = "lopa_fast"
LONG_S = 2.0  # a step this long says what it did at INFO even when it was not expected to be long


@contextlib.contextmanager
def step(log: logging.Logger, what: str, done: str, long: bool = True):
    """Log `what...` before the block and `done in X s` after it: at INFO when the step is expected to be
    `long`, else at DEBUG, and then `what...` at INFO once the step has run LONG_S seconds and the after-line
    at INFO when it took LONG_S or more: no step stalls silently for more than LONG_S. A failing step logs
    nothing more: its exception says what happened."""
    log.log(logging.INFO if long else logging.DEBUG, "%s...", what)
    # a step not expected to be long that still runs after LONG_S (a busy machine, a cold disk cache) says so then,
    # while it runs, not only once it is over
    late = None
    if not long and log.isEnabledFor(logging.INFO):
        late = threading.Timer(LONG_S, log.info, ("%s...", what))
        late.daemon = True
        late.start()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if late is not None:
            late.cancel()
    seconds = time.perf_counter() - t0
    log.log(logging.INFO if long or seconds >= LONG_S else logging.DEBUG, "%s in %.1f s", done, seconds)


def progress(iterable, log: logging.Logger, desc: str, total: int | None = None):
    """A tqdm bar on stderr over `iterable`, shown only when `log` shows INFO (the CLI's default, not `-q`;
    a library user sees it after enabling INFO on "lopa_fast")."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False,
                disable=not log.isEnabledFor(logging.INFO))
