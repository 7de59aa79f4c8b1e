"""Checks of one knob value on its own (no model, no other knob): each raises TypeError / ValueError / KnobError
naming the knob, the value and what is allowed. `GenerateConfig.validate` and the strategies' own rules
(lopa_fast.strategies) use them, so every knob error reads the same."""
from __future__ import annotations

import math

from lopa_fast.errors import KnobError

INT_KNOB_LIMIT = 2**31  # every int knob is below it (device tables index with int32); seeds: below 2**63
# the confidence formulas of lopa_fast.sampling.token_stats (d2f / lopa's sampling_strategy knob); here, torch-free,
# so that the strategy spec and GenerateConfig (imported by the CLI's --help) read the same tuple as sampling.py
SAMPLING_STRATEGIES = ("default", "margin", "neg_entropy")


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
                        knob=name, value=value)  # fmt: skip


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
