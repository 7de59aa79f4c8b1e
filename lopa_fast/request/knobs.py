"""Checks of one knob value on its own (no model, no other knob): each raises TypeError / ValueError / KnobError
naming the knob, the value and what is allowed. `GenerateConfig.validate` and the strategies' own rules
(lopa_fast.strategies) use them, so every knob error reads the same."""
from __future__ import annotations

import dataclasses
import math

from lopa_fast.errors import KnobError

INT_KNOB_LIMIT = 2**31  # every int knob is below it (device tables index with int32); seeds: below 2**63
# the confidence formulas of lopa_fast.sampling.token_stats (d2f / lopa's sampling_strategy knob); here, torch-free,
# so that the strategy spec and GenerateConfig (imported by the CLI's --help) read the same tuple as sampling.py
SAMPLING_STRATEGIES = ("default", "margin", "neg_entropy")
MAX_STOP_SEQUENCES, MAX_STOP_LENGTH = 16, 32  # checked on the device every round: a bounded static loop


def knob(default, help: str, *, choices=None, unset: str | None = None):
    """A GenerateConfig field (the shared ones in lopa_fast.config, a strategy's in its folder's knobs.py): its
    default and, as field metadata, what the CLI's --help and the docs show.

    help:    one line saying what the knob does.
    choices: the allowed values of a choice knob (a tuple, or a function returning one: the strategy registry
             grows at run time); None values in it stand for the unset default.
    unset:   for a knob whose default is None, what that runs as (e.g. "the model's", "max_new_tokens").
    """
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if unset is not None:
        meta["unset"] = unset
    return dataclasses.field(default=default, metadata=meta)


def knob_choices(f: dataclasses.Field) -> tuple | None:
    """The allowed values of a GenerateConfig field (None: not a choice knob); None entries left out."""
    choices = f.metadata.get("choices")
    if callable(choices):
        choices = choices()
    return None if choices is None else tuple(c for c in choices if c is not None)


def check_stop(stop) -> None:
    """stop: None or a non-empty tuple of 1..MAX_STOP_LENGTH token ids (ints >= 0), at most MAX_STOP_SEQUENCES."""
    if stop is None:
        return
    example = "e.g. stop=[[13, 198], [7]]"
    if not isinstance(stop, tuple) or not stop:
        raise TypeError(f"stop={stop!r}; expected a non-empty list of token-id sequences ({example})")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"stop: {len(stop)} sequences; allowed: at most {MAX_STOP_SEQUENCES}")
    for q in stop:
        if not q or len(q) > MAX_STOP_LENGTH or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in q
        ):
            raise ValueError(f"stop sequence {list(q)!r}; allowed: 1..{MAX_STOP_LENGTH} token ids (ints >= 0) "
                             f"({example})")


def check_number(name, value, *, allow_none=False, integer=False, limit=INT_KNOB_LIMIT):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an int" if integer else "a number"
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected {kind}")
    if isinstance(value, float) and not math.isfinite(value):
        raise KnobError(f"{name}={value!r}; expected a finite number", knob=name, value=value)
    if isinstance(value, int) and abs(value) >= limit:
        raise KnobError(f"{name}={value!r} is out of range; allowed: |{name}| < 2**{limit.bit_length() - 1}",
                        knob=name, value=value)


def check_prob(name, value, *, allow_none=False):
    check_number(name, value, allow_none=allow_none)
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r}; allowed: a probability in [0, 1]")


def check_positive_int(name, value, *, allow_none=False):
    check_number(name, value, allow_none=allow_none, integer=True)
    if value is not None and value <= 0:
        raise ValueError(f"{name}={value!r}; allowed: an int >= 1")


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected True or False")


def check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {', '.join(repr(a) for a in allowed)}")
