"""The package's exception types, in one module (the CLI and a server map them to exit codes / statuses by type).

Each carries the offending field or path as attributes, and subclasses the builtin its callers already
catch (ValueError / RuntimeError), so `except ValueError` keeps working:

    LopaError               base of every lopa_fast error (a mixin; never raised by itself)
    CheckpointError         ValueError: a model directory / shard / adapter that cannot be loaded as asked
                            (.path: the file or directory; .key: the tensor or config key, when one is to blame)
    ConfigError             CheckpointError: a config.json (or generation_config.json, adapter_config.json) value
                            that is missing, of the wrong type, out of range or inconsistent (.file, .key, .value)
    MemoryBudgetError       ValueError: a model or a request that needs more memory than the machine has
                            (.needed_bytes, .total_bytes, .what)
    KnobError               ValueError: a generate() knob out of range (.knob, .value); TypeError knob errors stay
                            plain TypeError
    RoundCapError           RuntimeError: a decoding loop hit `max_rounds` with on_round_cap="error"
    NonFiniteLogitsError    RuntimeError: NaN / inf in the raw model output on a row a strategy reads
                            (.strategy, .round, .position, .value)
    DistributedError        RuntimeError: a branch-parallel round failed on some rank, or a collective failed / timed
                            out (.rank: the failing rank, -1 if unknown; .round)
"""
from __future__ import annotations


class LopaError(Exception):
    """Base of the package's errors (caught together with `except lopa_fast.LopaError`)."""


class CheckpointError(LopaError, ValueError):
    """A checkpoint directory, shard or adapter that cannot be loaded as asked."""

    def __init__(self, message: str, *, path=None, key: str | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.key = key


class ConfigError(CheckpointError):
    """A config.json value that is missing, of the wrong type, out of range or inconsistent."""

    def __init__(self, message: str, *, file=None, key: str | None = None, value=None):
        super().__init__(message, path=file, key=key)
        self.file = None if file is None else str(file)
        self.value = value


class MemoryBudgetError(LopaError, ValueError):
    """The estimated memory of a model (or of a request's cache and tables) exceeds the machine's total."""

    def __init__(self, message: str, *, needed_bytes: int = 0, total_bytes: int = 0, what: str = ""):
        super().__init__(message)
        self.needed_bytes, self.total_bytes, self.what = int(needed_bytes), int(total_bytes), what


class KnobError(LopaError, ValueError):
    """A generate() knob (or the prompt) out of its allowed range; names the knob and the value."""

    def __init__(self, message: str, *, knob: str | None = None, value=None):
        super().__init__(message)
        self.knob, self.value = knob, value


class RoundCapError(LopaError, RuntimeError):
    """Raised when a decoding loop hits `max_rounds` and `on_round_cap="error"`."""


class NonFiniteLogitsError(LopaError, RuntimeError):
    """NaN or +-inf in the raw model output on a row the strategy reads (before any deliberate -inf)."""

    def __init__(self, message: str | None = None, *, strategy: str = "", round: int = 0, position: int = -1,
                 value=None):
        if message is None:
            message = (
                f"{strategy}: non-finite logits ({value}) in round {round} at sequence position {position}; "
                "the model output is broken (NaN/inf weights, rope_theta / rms_norm_eps, or an fp16 overflow)"
            )
        super().__init__(message)
        self.strategy, self.round, self.position, self.value = strategy, int(round), int(position), value


class StepTimeoutError(LopaError, RuntimeError):
    """A batched step of the batch engine ran past its deadline (a hung forward or kernel): the requests waiting on it
    fail with this (the server: 503, /health unhealthy until the step returns)."""

    def __init__(self, seconds: float, timeout: float):
        self.seconds, self.timeout = seconds, timeout
        super().__init__(f"the batch engine's current step has run {seconds:.1f} s, past its deadline of {timeout:g} s "
                         "(--step-timeout): its requests are failed; the server reports unhealthy until it returns")


class DistributedError(LopaError, RuntimeError):
    """A branch-parallel request (generate(..., distributed=True)) failed: a rank raised (every rank raises this,
    naming it) or a collective failed or timed out (a peer died)."""

    def __init__(self, message: str, *, rank: int = -1, round: int = 0):
        super().__init__(message)
        self.rank, self.round = int(rank), int(round)


__all__ = [
    "CheckpointError", "ConfigError", "DistributedError", "KnobError", "LopaError", "MemoryBudgetError",
    "NonFiniteLogitsError", "RoundCapError", "StepTimeoutError",
]


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure: MemoryError, torch.OutOfMemoryError (CUDA), or the CPU allocator's
    plain RuntimeError ("DefaultCPUAllocator: can't allocate memory": torch gives it no type of its own, so this one
    case is read from the message)."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def drop_frames(exc: BaseException) -> BaseException:
    """`exc` with the local variables of its finished frames cleared (its cause and context too), returned. A
    raised exception keeps its traceback, and the traceback every frame's locals: after a failed batched forward
    that is every activation of the batch (issue 36: 1.4 GiB kept after one out-of-memory batch, so every later
    request failed too). The message and the frames' names and lines stay for the log."""
    import traceback

    seen, first = set(), exc
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        if exc.__cause__ is not None and id(exc.__cause__) not in seen:
            drop_frames(exc.__cause__)
        exc = exc.__context__
    return first
