"""lopa_fast: fast, faithful decoding for diffusion LLMs (LoPA, D2F, Fast-dLLM, APD, dParallel)."""
import logging as _logging

from lopa_fast.api import generate
from lopa_fast.config import GenerateConfig, LopaConfig
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
from lopa_fast.models import KVCache, load_model, load_tokenizer
from lopa_fast.output import GenerateOutput
from lopa_fast.stream import TextStream, stream

# a library adds no handler of its own: the application decides where "lopa_fast" records go (lopa_fast.logs)
_logging.getLogger("lopa_fast").addHandler(_logging.NullHandler())

__version__ = "0.1.0"
__all__ = [
    "CheckpointError", "ConfigError", "DistributedError", "KnobError", "LopaError", "MemoryBudgetError", "NonFiniteLogitsError",
    "GenerateConfig", "GenerateOutput", "KVCache", "LopaConfig", "RoundCapError", "generate", "load_model",
    "load_tokenizer", "stream", "TextStream",
]  # fmt: skip
