"""Decoding strategies: the registry (`registry.py`: the `Strategy` spec, `register`, `get`, `names`) and the
built-in strategies, one module each (vanilla, threshold, d2f, lopa, apd), registered in that order on import.
How to add one: docs/architecture.md ("Adding a strategy")."""
from lopa_fast.strategies.registry import (SOLO, Strategy, decode_length, fast_not_covered, find, get, names, owners,
                                          register, specific_knobs, unregister)
from lopa_fast.strategies.registry import check_values
from lopa_fast.strategies import vanilla, threshold, d2f, lopa, apd  # noqa: E402,F401  (registers the built-ins)

__all__ = ["SOLO", "Strategy", "check_values", "decode_length", "fast_not_covered", "find", "get", "names", "owners", "register", "specific_knobs", "unregister"]
