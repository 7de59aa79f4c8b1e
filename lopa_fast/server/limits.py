"""The server's per-request bounds, from one place: what an operator caps (`serve`'s flags) and the checks every
request passes before anything is allocated for it.

    max_branching_factor  the largest `branching_factor` (LoPA's k: k + 1 rows per forward; default 16)
    max_model_len         prompt + max_tokens, in tokens (default: the model's max_position_embeddings)
    max_num_seqs          requests decoding at once (the batch engine's seats and live requests; default 16)
    max_batch_rows        branch rows of one batched forward (default 64, at least max_branching_factor + 1): a
                          heavy request shares the forward with lighter ones instead of filling it
    max_body_bytes        the request body (default 1 MiB; more: 413 before the body is parsed)
    max_request_memory    one request's memory estimate (`lopa_fast.memory.request_bytes`; default a quarter of the
                          device's memory); above it: 400 naming the knob that drives it
    memory_budget         the estimates of all requests running at once, plus what the batch engine holds beyond
                          them (`MemoryBudget.held`: its KV pools and compiled-batch lanes; default half of the
                          device's memory); a request that fits alone waits until the running ones leave it room
    read_timeout_s        seconds to receive a request body (default 30; slower: 408)
    step_timeout_s        seconds one batched step of the batch engine may take (default 300, SGLang's watchdog default;
                          longer: its requests fail with a 503 and /health reports unhealthy until the step returns)
    min_body_rate         bytes per second a body must average once its first BODY_GRACE_S seconds are over
                          (default 1,024; slower: 408 and the connection closed; 0: only read_timeout_s), as
                          Apache's mod_reqtimeout MinRate: a client trickling its body frees its slot in seconds

`Limits.check(model, cfg, prompt_len)` is the one check (protocol.parse calls it after the config is bound);
it returns the request's estimate, which the worker reserves against `memory_budget` while the request runs.
"""
from __future__ import annotations

import dataclasses
import threading

from lopa_fast import memory, strategies

# a body's first seconds are free of the rate rule (a client's first packets, a slow start); then it must keep up
BODY_GRACE_S = 2.0


@dataclasses.dataclass
class Limits:
    max_branching_factor: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_batch_rows: int = 64
    max_body_bytes: int = 1 << 20
    max_request_memory: int | None = None
    memory_budget: int | None = None
    read_timeout_s: float = 30.0
    min_body_rate: int = 1024
    step_timeout_s: float = 300.0

    def __post_init__(self):
        for name in ("max_branching_factor", "max_num_seqs", "max_batch_rows", "max_body_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}; allowed: an integer >= 1")
        for name in ("max_model_len", "max_request_memory", "memory_budget"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r}; allowed: an integer >= 1 or None")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s={self.read_timeout_s!r}; allowed: > 0")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s={self.step_timeout_s!r}; allowed: > 0")
        if isinstance(self.min_body_rate, bool) or not isinstance(self.min_body_rate, int) or self.min_body_rate < 0:
            raise ValueError(f"min_body_rate={self.min_body_rate!r}; allowed: an integer >= 0 (bytes per second)")
        self.max_batch_rows = max(self.max_batch_rows, self.max_branching_factor + 1)

    def bind(self, model) -> "Limits":
        """The limits with their model-dependent defaults filled in (max_model_len, the memory caps)."""
        from lopa_fast.models.loading import total_memory

        total, _ = total_memory(memory.device_of(model))
        limit = model.config.max_position_embeddings
        return dataclasses.replace(
            self, max_model_len=min(self.max_model_len or limit, limit),
            max_request_memory=self.max_request_memory or total // 4,
            memory_budget=max(self.memory_budget or total // 2, self.max_request_memory or total // 4),
        )

    def check(self, model, cfg, prompt_len: int, verifier=None) -> int:
        """Refuse (ValueError subclasses carrying the field: `LimitError`) a bound config over a cap; return the
        request's memory estimate in bytes (verifier: the server's APD verifier, counted for a request that uses
        it)."""
        k = cfg.branching_factor  # checked by the strategies that read it (lopa); others leave any value unread
        if isinstance(k, int) and k > self.max_branching_factor:
            raise LimitError(f"branching_factor={k} is over this server's cap --max-branching-factor="
                             f"{self.max_branching_factor}", "branching_factor")
        total = prompt_len + cfg.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            field = "max_tokens" if prompt_len < self.max_model_len else "prompt"
            raise LimitError(f"prompt ({prompt_len} tokens) + max_tokens ({cfg.max_new_tokens}) = {total} is over "
                             f"this server's cap --max-model-len={self.max_model_len}", field)
        rows = strategies.get(cfg.strategy).rows(cfg)
        if rows > self.max_batch_rows:
            raise LimitError(f"strategy={cfg.strategy!r} with these knobs decodes {rows} rows per forward, over this "
                             f"server's cap --max-batch-rows={self.max_batch_rows}", "branching_factor")
        need = memory.request_bytes(model, total, cfg, prompt_len, verifier)
        if self.max_request_memory is not None and need > self.max_request_memory:
            field = "branching_factor" if rows > 1 else "max_tokens"
            raise LimitError(f"this request needs about {need / 2**20:.0f} MiB (lopa_fast.memory.request_bytes: "
                             f"{rows} rows x {total} positions), over this server's per-request cap of "
                             f"{self.max_request_memory / 2**20:.0f} MiB (--max-request-memory); lower {field}",
                             field)
        return need


class LimitError(ValueError):
    """A request over one of the server's caps; `field`: the body field to blame."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class MemoryBudget:
    """The running requests' estimates against `budget` bytes: `reserve(n, cancelled)` blocks until `n` fits
    (checking `cancelled()` every 0.25 s; returns False when it was cancelled meanwhile), `try_reserve(n)` does
    not wait (False: it does not fit now), `release(n)`. `held`:
    bytes the batch engine holds beyond the running requests' estimates (its KV pools and compiled-batch lanes past
    the shares the estimates reserve, idle lanes kept for their graphs: `BatchEngine(on_held=budget.hold)`),
    counted as used until it frees them; `reclaim()` (the engine's) is asked whenever a request would wait, so idle
    lanes never keep a request waiting."""

    def __init__(self, budget: int | None, reclaim=None):
        self.budget, self.used, self.held, self.reclaim = budget, 0, 0, reclaim
        self._cv = threading.Condition()

    def hold(self, n: int) -> None:
        """The engine's bytes beyond the estimates, now (it reports after every change)."""
        with self._cv:
            self.held = n
            self._cv.notify_all()

    def reserve(self, n: int, cancelled=lambda: False) -> bool:
        if self.budget is None:
            return True
        with self._cv:
            while not self._take(n):
                if cancelled():
                    return False
                self._cv.wait(0.25)
        return True

    def try_reserve(self, n: int) -> bool:
        """`reserve` without waiting: False (nothing reserved) when `n` does not fit now."""
        if self.budget is None:
            return True
        with self._cv:
            return self._take(n)

    def _take(self, n: int) -> bool:
        """Reserve `n` if it fits now (under the lock). A request checked against max_request_memory <= budget always
        fits alone: it never waits for running ones when none runs; what the engine holds (idle lanes) it frees when
        asked (`reclaim`), and hold() wakes a waiting reserve."""
        n = min(n, self.budget)
        if self.used + self.held + n > self.budget and (self.used or self.held):
            if self.held and self.reclaim is not None:
                self.reclaim()
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        if self.budget is None:
            return
        with self._cv:
            self.used -= min(n, self.budget)
            self._cv.notify_all()
