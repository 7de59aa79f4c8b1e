"""Model configuration: one dataclass for both families, parsed from an HF config.json.

The runtime only needs the architectural numbers and the special ids; everything else in a real
config.json (use_cache, torch_dtype, auto_map, ...) is ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# model_type spellings seen in public checkpoints -> family
QWEN2_FAMILY_TYPES = {"dream": "dream", "diffucoder": "dream", "qwen2": "qwen2"}
LLADA_TYPES = {"llada": "llada"}
SUPPORTED_MODEL_TYPES = sorted(set(QWEN2_FAMILY_TYPES) | set(LLADA_TYPES))


@dataclass
class ModelConfig:
    """Architecture + special ids.

    `kind` is one of "dream" (Dream / DiffuCoder / D2F-*: bidirectional, shifted logits),
    "qwen2" (Qwen2.5 causal AR: causal, shifted) and "llada" (bidirectional, unshifted).
    """

    kind: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    bos_token_id: int | None = None

    @property
    def attention(self) -> str:
        """Default attention pattern of the family: "full" or "causal"."""
        return "causal" if self.kind == "qwen2" else "full"

    @property
    def logits_shift(self) -> bool:
        """True when the raw logit at position j predicts token j+1 (Dream family, Qwen2 AR)."""
        return self.kind in ("dream", "qwen2")


def _first_id(value):
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _require(cfg: dict, key: str, source: str):
    if key not in cfg:
        raise ValueError(f"{source}: missing required key {key!r}")
    return cfg[key]


def parse_config(cfg: dict, generation_cfg: dict | None = None, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the dicts of config.json and (optional) generation_config.json.

    Special ids come from config.json first, then generation_config.json for the ones it lacks.
    """
    gen = generation_cfg or {}
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError(f"{source}: no 'model_type'; supported: {SUPPORTED_MODEL_TYPES}")
    key = str(model_type).lower()
    if key in QWEN2_FAMILY_TYPES:
        kind = QWEN2_FAMILY_TYPES[key]
        hidden = int(_require(cfg, "hidden_size", source))
        heads = int(_require(cfg, "num_attention_heads", source))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling not in (None, {}) and (rope_scaling or {}).get("type", rope_scaling.get("rope_type")) not in (
            None,
            "default",
        ):
            raise ValueError(f"{source}: rope_scaling={rope_scaling!r} is not supported (only none/default)")
        mc = ModelConfig(
            kind=kind,
            model_type=str(model_type),
            vocab_size=int(_require(cfg, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(cfg, "intermediate_size", source)),
            num_layers=int(_require(cfg, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True,
        )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    elif key in LLADA_TYPES:
        hidden = int(_require(cfg, "d_model", source))
        heads = int(_require(cfg, "n_heads", source))
        mlp_hidden = cfg.get("mlp_hidden_size")
        if mlp_hidden is None:
            mlp_hidden = int(cfg.get("mlp_ratio", 4)) * hidden
        # LLaDA's SwiGLU splits ff_proj / up_proj, each of width mlp_hidden_size (12288 for 8B).
        norm = cfg.get("layer_norm_type", "rms")
        if norm not in ("rms", "default_rms"):
            raise ValueError(f"{source}: layer_norm_type={norm!r} is not supported (only 'rms')")
        block = cfg.get("block_type", "llama")
        if block != "llama":
            raise ValueError(f"{source}: block_type={block!r} is not supported (only 'llama')")
        if cfg.get("include_bias", False):
            raise ValueError(f"{source}: include_bias=true is not supported (LLaDA checkpoints have no biases)")
        vocab = int(cfg.get("embedding_size") or _require(cfg, "vocab_size", source))
        mc = ModelConfig(
            kind="llada",
            model_type=str(model_type),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(mlp_hidden),
            num_layers=int(_require(cfg, "n_layers", source)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("n_kv_heads") or heads),
            head_dim=hidden // heads,
            max_position_embeddings=int(cfg.get("max_sequence_length", 4096)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("weight_tying", False)),
            qkv_bias=bool(cfg.get("include_qkv_bias", False)),
        )
    else:
        raise ValueError(f"{source}: unknown model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")

    if mc.num_heads % mc.num_kv_heads:
        raise ValueError(f"{source}: num_attention_heads={mc.num_heads} is not a multiple of kv heads {mc.num_kv_heads}")
    defaults = {"llada": {"mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081}}.get(mc.kind, {})
    for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        value = cfg.get(name)
        if value is None:
            value = gen.get(name)
        if value is None:
            value = defaults.get(name)
        if name == "eos_token_id":
            mc.eos_token_ids = _id_list(value)
        setattr(mc, name, _first_id(value))
    return mc
