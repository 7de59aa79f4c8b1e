"""lopa_fast: fast, faithful decoding for diffusion LLMs (LoPA, D2F, Fast-dLLM, APD, dParallel)."""
from lopa_fast.models import KVCache, load_model, load_tokenizer

__version__ = "0.1.0"
__all__ = ["KVCache", "load_model", "load_tokenizer"]
