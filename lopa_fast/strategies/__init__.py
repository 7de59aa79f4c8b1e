"""Decoding strategies: the registry (`registry.py`: the `Strategy` spec, `register`, `get`, `names`) and the
built-in strategies, one folder each, registered in this order on import (the lines below):

    vanilla/    threshold/    lopa/ (d2f and lopa: one round)    apd/

A folder holds a strategy whole: `spec.py` (its knobs, checks, defaults, eval rows and the `register` call),
`reference.py` (the readable oracle: imports nothing of the fast path), `driver.py` (its per-request driver for the
one loop, lopa_fast.decode.batch) and `step.py` (the step function its driver runs eagerly, compiled, captured and
batched). How to add one: docs/architecture.md ("Adding a strategy")."""
from lopa_fast.strategies.registry import (SOLO, Strategy, decode_length, fast_not_covered, find, get, names, owners,
                                          register, specific_knobs, unregister)
from lopa_fast.strategies.registry import check_distributed, check_values, compose_config
from lopa_fast.strategies.vanilla import spec as _vanilla  # noqa: E402,F401  (each line registers a folder's specs)
from lopa_fast.strategies.threshold import spec as _threshold  # noqa: E402,F401
from lopa_fast.strategies.lopa import spec as _lopa  # noqa: E402,F401  (d2f, then lopa)
from lopa_fast.strategies.apd import spec as _apd  # noqa: E402,F401

__all__ = ["SOLO", "Strategy", "check_distributed", "check_values", "compose_config", "decode_length",
           "fast_not_covered", "find", "get", "names", "owners", "register", "specific_knobs", "unregister"]
