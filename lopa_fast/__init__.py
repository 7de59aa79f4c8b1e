"""lopa_fast: fast, faithful decoding for diffusion LLMs (LoPA, D2F, Fast-dLLM, APD, dParallel).

The public names are imported on first use (PEP 562 `__getattr__`): `import lopa_fast` costs ~0.1 s, and
`python -m lopa_fast --help` or a bad flag answers without importing torch (~4 s); `lopa_fast.generate` imports what
it needs the first time it is read.
"""
import importlib as _importlib
import logging as _logging

from lopa_fast.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    KnobError,
    LopaError,
    MemoryBudgetError,
    NonFiniteLogitsError,
    RoundCapError,
)

# a library adds no handler of its own: the application decides where "lopa_fast" records go (lopa_fast.logs)
_logging.getLogger("lopa_fast").addHandler(_logging.NullHandler())

# public name -> the module that defines it
_LAZY = {
    "generate": "lopa_fast.api",
    "GenerateConfig": "lopa_fast.config",
    "LopaConfig": "lopa_fast.config",
    "KVCache": "lopa_fast.models",
    "load_model": "lopa_fast.models",
    "load_tokenizer": "lopa_fast.models",
    "GenerateOutput": "lopa_fast.output",
    "TextStream": "lopa_fast.output.stream",
    "stream": "lopa_fast.output.stream",
}


# light submodules readable as attributes after a bare `import lopa_fast` (`lopa_fast.assets.model_dir()`, as the
# README writes it; issue 42, finding 4): imported on first read, no torch
_SUBMODULES = ("assets", "tasks")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later reads are plain attribute reads
        return value
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")  # the import binds it on the package
    raise AttributeError(f"module 'lopa_fast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__version__ = "0.1.0"
__all__ = [
    "CheckpointError", "ConfigError", "DistributedError", "KnobError", "LopaError", "MemoryBudgetError",
    "NonFiniteLogitsError",
    "GenerateConfig", "GenerateOutput", "KVCache", "LopaConfig", "RoundCapError", "generate", "load_model",
    "load_tokenizer", "stream", "TextStream",
]
