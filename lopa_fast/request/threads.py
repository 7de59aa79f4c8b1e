"""The CPU thread policy of a decoding call (`lopa_fast.generate`, `lopa_fast.stream`, the lm-eval model).

Why: on small models every op is tiny (the embedded model's matmuls are ~65 x 128 x 384), so torch's intra-op
threads cost more to wake and join than they compute: on the shared 2-core machine one `generate` on the embedded
model took 488 ms at torch's default (2 threads) against 54.5 ms at one thread (issue 26; bench/results/threads.md
re-measures it beside a 60M-parameter model, where more threads pay).

Policy (`LOPA_FAST_THREADS`, read per call): "auto" (the default): a CPU call on a model with fewer than
SMALL_MODEL_PARAMS parameters outside its embeddings runs with ONE thread, for the duration of the call only (the
calling thread's previous count is restored when it returns); larger models and GPU calls keep torch's setting. "keep":
never change it. An int N >= 1: every CPU call runs with N threads (scoped the same way). The CLI's --threads and the
server set the process's count themselves. The scope is the calling thread's: torch's CPU thread count is per thread
(`scoped`).
"""
from __future__ import annotations

import logging
import os

import torch

from lopa_fast.errors import KnobError
from lopa_fast.ops._backend import env_value

log = logging.getLogger(__name__)

ENV = "LOPA_FAST_THREADS"
# below this many non-embedding parameters a CPU forward is dominated by per-op overhead, where one thread is
# fastest (bench/results/threads.md: the embedded model, 0.8M body parameters, 11-35x faster at one thread than at
# torch's two; the 60M-parameter model, 42.5M body parameters, 1.5x slower at one thread)
SMALL_MODEL_PARAMS = 20_000_000

def policy() -> str | int:
    """The policy from LOPA_FAST_THREADS: "auto", "keep" or an int >= 1 (KnobError naming the variable else)."""
    raw = (env_value(ENV) or "auto").strip().lower()  # (no KeyError when unset: ops._backend.env_value)
    if raw in ("auto", "keep", ""):
        return raw or "auto"
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise KnobError(f"{ENV}={os.environ.get(ENV)!r}; allowed: 'auto', 'keep' or an int >= 1", knob=ENV,
                        value=os.environ.get(ENV))
    return n


def body_params(model) -> int:
    """Parameters outside the embedding and the LM head (what every position's forward multiplies through)."""
    c = model.config
    per_layer = (c.hidden_size * c.head_dim * (c.num_heads * 2 + c.num_kv_heads * 2)  # q, o and k, v
                 + 3 * c.hidden_size * c.intermediate_size)  # gate, up, down
    return c.num_layers * per_layer


def threads_for(model) -> int | None:
    """The thread count a call on `model` runs with under the policy, or None to keep torch's setting."""
    p = policy()
    device = getattr(model, "device", torch.device("cpu"))
    if p == "keep" or torch.device(device).type != "cpu":
        return None
    if isinstance(p, int):
        return p
    try:
        small = body_params(model) < SMALL_MODEL_PARAMS
    except (AttributeError, TypeError):  # a duck-typed model without the architecture numbers: leave torch alone
        return None
    return 1 if small else None


class scoped:  # (lower-case: used as a function, `with scoped(model):`)
    """Run the body with `threads_for(model)` threads in the calling thread, then give that thread its previous
    count back; nothing changes when it is None. torch's CPU thread count (OpenMP) is per calling thread once the
    thread has run an op (a new thread starts from the last count set anywhere), so concurrent calls on several
    threads each scope their own. (A class: a generator-based context manager raises and catches a StopIteration at
    every exit.)"""

    __slots__ = ("n", "saved")

    def __init__(self, model):
        self.n = threads_for(model)
        self.saved = None

    def __enter__(self) -> None:
        n = self.n
        if n is None:
            return
        saved = torch.get_num_threads()
        if saved != n:
            log.debug("decoding with %d CPU thread(s) (%s=%s; this thread had %d)", n, ENV, policy(), saved)
            torch.set_num_threads(n)
            self.saved = saved

    def __exit__(self, *exc) -> bool:
        if self.saved is not None:
            torch.set_num_threads(self.saved)
        return False
