"""Plain-PyTorch model runtime: Qwen2 family (Dream, DiffuCoder, D2F, Qwen2.5) and LLaDA."""
from lopa_fast.errors import CheckpointError
from lopa_fast.models.checkpoint import read_config
from lopa_fast.models.config import ModelConfig, parse_config
from lopa_fast.models.kv_cache import KVCache
from lopa_fast.models.llada import LLaDAModel
from lopa_fast.models.loading import build_model, load_model, load_tokenizer, save_checkpoint
from lopa_fast.models.lora import merge_lora
from lopa_fast.models.qwen2 import Qwen2Model
from lopa_fast.models.transformer import DecoderLM

__all__ = [
    "CheckpointError", "DecoderLM", "KVCache", "LLaDAModel", "ModelConfig", "Qwen2Model", "build_model",
    "load_model", "load_tokenizer", "merge_lora", "parse_config", "read_config", "save_checkpoint",
]
