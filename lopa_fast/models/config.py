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


@dataclass(frozen=True)
class Family:
    """What the decoders need to know of a model family: one row per family (`FAMILIES`), read through
    ModelConfig's properties of the same names. Decoders, strategies, reference decoders and config checks read
    these, never the family's name (tests/test_family_properties.py)."""

    attention: str  # default attention pattern: "full" (bidirectional dLLM) or "causal" (AR)
    logits_shift: bool  # the raw logit at position j predicts token j+1 (else token j)
    is_diffusion: bool  # a masked-diffusion LM: it can run diffusion decoding (has a mask token to fill)
    causal_verifier: bool  # a causal AR LM: usable as APD's verifier
    stats_in_float64: bool  # token statistics as LLaDA's upstream: Gumbel-max in float64 on raw logits (no top-p /
    #                         top-k), confidence = float64 softmax[x0]; else Dream's sampler (temperature, top-p,
    #                         top-k, fp32 softmax; at T > 0 it draws every row it is given)
    refresh_commits_first: bool  # threshold with a cache: the refresh forward commits the block's first token
    #                              unconditionally (Fast-dLLM's Dream dual cache); else it commits by the rule
    vanilla_commit: str | None  # the vanilla sampler upstream ships for the family: "block_topk" (LLaDA's
    #                             `generate`: blocks of block_length, top-k by confidence with the even transfer
    #                             schedule, remasking/cfg_scale knobs) or "timestep" (Dream's `diffusion_generate`:
    #                             a linear timestep schedule over the whole generation, alg/alg_temp/eps knobs);
    #                             None: no diffusion decoding
    eot_token_id: int | None = None  # the end-of-turn id upstream hard-codes for the family (LLaDA's <|eot_id|>,
    #                                  126348: confidence_eos_eot_inf commits it last when the vocabulary holds it)


# kind -> its family's facts (the one place; lopa_fast.models.qwen2 / llada build the networks)
FAMILIES = {
    "dream": Family(attention="full", logits_shift=True, is_diffusion=True, causal_verifier=False,
                    stats_in_float64=False, refresh_commits_first=True, vanilla_commit="timestep"),
    "qwen2": Family(attention="causal", logits_shift=True, is_diffusion=False, causal_verifier=True,
                    stats_in_float64=False, refresh_commits_first=False, vanilla_commit=None),
    "llada": Family(attention="full", logits_shift=False, is_diffusion=True, causal_verifier=False,
                    stats_in_float64=True, refresh_commits_first=False, vanilla_commit="block_topk",
                    eot_token_id=126348),
}


@dataclass
class ModelConfig:
    """Architecture + special ids.

    `kind` is one of "dream" (Dream / DiffuCoder / D2F-*: bidirectional, shifted logits),
    "qwen2" (Qwen2.5 causal AR: causal, shifted) and "llada" (bidirectional, unshifted). Only lopa_fast.models
    reads it: everything a decoder needs of the family is an attribute set from its `Family` row.
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

    def __post_init__(self) -> None:
        # the family's facts (`Family`'s fields: attention, logits_shift, is_diffusion, ...) as plain attributes of
        # the config, so a decoder reads `config.attention` and never the family's name
        for name in Family.__dataclass_fields__:
            setattr(self, name, getattr(FAMILIES[self.kind], name))


_MISSING = object()
SIZE_LIMIT = 2**31  # every size / id is below it (int32 device indices)


def _fail(source, key, value, allowed):
    from lopa_fast.errors import ConfigError

    raise ConfigError(f"{source}: {key}={value!r}; allowed: {allowed}", file=source, key=key, value=value)


def _int(cfg: dict, key: str, source: str, default=_MISSING, *, lo: int = 1, hi: int = SIZE_LIMIT) -> int:
    """cfg[key] as an int in [lo, hi) (a whole float such as 4096.0 is accepted), else ConfigError naming it."""
    value = cfg.get(key, default)
    if value is _MISSING:
        from lopa_fast.errors import ConfigError

        raise ConfigError(f"{source}: missing required key {key!r}", file=source, key=key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
        _fail(source, key, value, f"an int in [{lo}, {hi})")
    return value


def _float(cfg: dict, key: str, source: str, default: float, *, lo: float, hi: float, what: str) -> float:
    """cfg[key] as a finite float in (lo, hi) (exclusive), else ConfigError naming it."""
    value = cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < float(value) < hi:
        _fail(source, key, value, what)
    return float(value)


def _flag(cfg: dict, key: str, source: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        _fail(source, key, value, "true or false")
    return value


def _id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _check_ids(mc: "ModelConfig", source: str) -> None:
    """Every special id an int inside the vocabulary."""
    ids = [(n, getattr(mc, n)) for n in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")]
    ids += [("eos_token_id", v) for v in mc.eos_token_ids]
    for name, v in ids:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < mc.vocab_size):
            _fail(source, name, v, f"an id in [0, vocab_size={mc.vocab_size})")


def parse_config(cfg: dict, generation_cfg: dict | None = None, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the dicts of config.json and (optional) generation_config.json.

    Special ids come from config.json first, then generation_config.json for the ones it lacks.
    """
    from lopa_fast.errors import ConfigError

    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: holds a JSON {type(cfg).__name__}, expected an object", file=source, value=cfg)
    if generation_cfg is not None and not isinstance(generation_cfg, dict):
        raise ConfigError(f"generation_config.json next to {source}: expected a JSON object", file=source)
    gen = generation_cfg or {}
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: no 'model_type'; supported: {SUPPORTED_MODEL_TYPES}", file=source,
                          key="model_type")
    if not isinstance(model_type, str):
        _fail(source, "model_type", model_type, f"a string, one of {SUPPORTED_MODEL_TYPES}")
    key = str(model_type).lower()
    if key in QWEN2_FAMILY_TYPES:
        kind = QWEN2_FAMILY_TYPES[key]
        hidden = _int(cfg, "hidden_size", source)
        heads = _int(cfg, "num_attention_heads", source)
        mc = ModelConfig(
            kind=kind,
            model_type=str(model_type),
            vocab_size=_int(cfg, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size", source),
            num_layers=_int(cfg, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", source, cfg.get("num_key_value_heads") or heads),
            head_dim=_int(cfg, "head_dim", source) if cfg.get("head_dim") else _derived_head_dim(hidden, heads, source),
            max_position_embeddings=_int(cfg, "max_position_embeddings", source, 32768),
            rope_theta=_qwen2_rope_theta(cfg, source),
            rms_norm_eps=_float(cfg, "rms_norm_eps", source, 1e-6, lo=0.0, hi=1.0, what="a number in (0, 1)"),
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", source, False),
            qkv_bias=True,
        )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (only 'silu')", file=source)
    elif key in LLADA_TYPES:
        hidden = _int(cfg, "d_model", source)
        heads = _int(cfg, "n_heads", source)
        if cfg.get("mlp_hidden_size") is not None:
            mlp_hidden = _int(cfg, "mlp_hidden_size", source)
        else:
            mlp_hidden = _int(cfg, "mlp_ratio", source, 4) * hidden
        # LLaDA's SwiGLU splits ff_proj / up_proj, each of width mlp_hidden_size (12288 for 8B).
        norm = cfg.get("layer_norm_type", "rms")
        if norm not in ("rms", "default_rms"):
            raise ConfigError(f"{source}: layer_norm_type={norm!r} is not supported (only 'rms')", file=source)
        block = cfg.get("block_type", "llama")
        if block != "llama":
            raise ConfigError(f"{source}: block_type={block!r} is not supported (only 'llama')", file=source)
        if cfg.get("include_bias", False):
            raise ConfigError(f"{source}: include_bias=true is not supported (LLaDA checkpoints have no biases)",
                              file=source)
        vocab = _int(cfg, "embedding_size", source) if cfg.get("embedding_size") else _int(cfg, "vocab_size", source)
        mc = ModelConfig(
            kind="llada",
            model_type=str(model_type),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(mlp_hidden),
            num_layers=_int(cfg, "n_layers", source),
            num_heads=heads,
            num_kv_heads=_int(cfg, "n_kv_heads", source, cfg.get("n_kv_heads") or heads),
            head_dim=_derived_head_dim(hidden, heads, source, ("d_model", "n_heads")),
            max_position_embeddings=_int(cfg, "max_sequence_length", source, 4096),
            rope_theta=_llada_rope_theta(cfg, source),
            rms_norm_eps=_float(cfg, "rms_norm_eps", source, 1e-5, lo=0.0, hi=1.0, what="a number in (0, 1)"),
            tie_word_embeddings=_flag(cfg, "weight_tying", source, False),
            qkv_bias=_flag(cfg, "include_qkv_bias", source, False),
        )
    else:
        raise ConfigError(f"{source}: unknown model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}",
                          file=source)

    llada = mc.kind == "llada"  # kv heads divide heads (heads divide hidden: _derived_head_dim)
    if mc.num_heads % mc.num_kv_heads:
        _fail(source, "n_kv_heads" if llada else "num_key_value_heads", mc.num_kv_heads,
              f"a divisor of {'n_heads' if llada else 'num_attention_heads'}={mc.num_heads}")
    if mc.head_dim % 2:
        _fail(source, "d_model" if llada else "head_dim", mc.head_dim, "an even head dimension (RoPE rotates pairs)")
    defaults = {"llada": {"mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081}}.get(mc.kind, {})
    for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        value = cfg.get(name)
        if value is None:
            value = gen.get(name)
        if value is None:
            value = defaults.get(name)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool)) and not (
            isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            _fail(source, name, value, f"an int id in [0, vocab_size={mc.vocab_size}) (or a list of them)")
        ids = _id_list(value)
        if name == "eos_token_id":
            mc.eos_token_ids = ids
        setattr(mc, name, ids[0] if ids else None)
    _check_ids(mc, source)
    return mc


# the config.json keys that describe rotary embeddings in any transformers release
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")


def _qwen2_rope_theta(cfg: dict, source: str) -> float:
    """RoPE base of a Qwen2-layout config (Dream, DiffuCoder, D2F, Qwen2.5), read through transformers' own
    Qwen2Config, which normalises the spellings of every transformers release: 4.x writes `rope_theta` and
    `rope_scaling` at the top level, 5.x writes them only inside `rope_parameters` (a Qwen2 saved by 5.24 with
    rope_theta 1e6 has no top-level rope_theta; reading the top level fell back to 10000 and moved logits by 1.7e-3).
    Any scaling the runtime does not implement (linear, dynamic, yarn, llama3, ...) and sliding-window attention
    are refused, naming the field."""
    from lopa_fast.errors import ConfigError

    if cfg.get("use_sliding_window"):
        _fail(source, "use_sliding_window", cfg["use_sliding_window"], "false (sliding-window attention is not "
              "implemented)")
    if "rope_parameters" not in cfg and cfg.get("rope_scaling") in (None, {}):
        # the plain layout every release reads the same way (a top-level rope_theta, else 10000): no need to pay
        # transformers' ~1.5-3 s import for it
        return _rope_theta({"rope_theta": cfg.get("rope_theta", 10000.0)}, source, "rope_scaling", top_level=True)
    try:
        from transformers import Qwen2Config
    except ImportError as e:  # a requirement of the package; say which one is missing
        raise ConfigError(f"{source}: reading a Qwen2-layout config needs transformers ({e})", file=source) from e
    # only the rope fields go through the config class (the other keys are checked here, naming the key; the
    # class's strict field validation would raise its own error types for them first)
    rope = {k: cfg[k] for k in _ROPE_KEYS if k in cfg}
    try:
        hf = Qwen2Config(**rope)
    except Exception as e:  # noqa: BLE001 - transformers' validation errors have no common base; name the field
        key = "rope_parameters" if "rope_parameters" in rope else "rope_scaling" if "rope_scaling" in rope else \
            "rope_theta"
        raise ConfigError(f"{source}: {key}: transformers' Qwen2Config refuses it ({e})", file=source, key=key) from e
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # transformers 4.x: the top-level pair
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return _rope_theta(params, source, "rope_parameters" if "rope_parameters" in cfg else "rope_scaling",
                       top_level="rope_theta" in cfg)


def _llada_rope_theta(cfg: dict, source: str) -> float:
    """RoPE base of a LLaDA config (remote code, no transformers class): `rope_parameters` where a transformers
    5.x save wrote it, else the top-level `rope_theta` and `rope_scaling`; rope must be on and alibi off."""
    if cfg.get("rope") is False:
        _fail(source, "rope", False, "true (LLaDA's rotary embeddings; other position schemes are not implemented)")
    if cfg.get("alibi"):
        _fail(source, "alibi", cfg["alibi"], "false (ALiBi is not implemented)")
    params = cfg.get("rope_parameters")
    field = "rope_parameters"
    top_level = params is None and "rope_theta" in cfg
    if params is None:
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            _fail(source, "rope_scaling", scaling, "null or an object")
        params = {**(scaling or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
        field = "rope_scaling"
    return _rope_theta(params, source, field, top_level)


def _rope_theta(params, source: str, field: str, top_level: bool = False) -> float:
    """The base of plain (rope_type "default") rotary embeddings from normalised rope parameters, else
    ConfigError naming `field` (and the top-level key "rope_theta" when config.json wrote the base there).
    Per-layer-type parameters (a dict of dicts) must all be the same plain rope."""
    if not isinstance(params, dict):
        _fail(source, field, params, "an object")
    if params and all(isinstance(v, dict) for v in params.values()):  # {"full_attention": {...}, ...}
        thetas = {_rope_theta(v, source, f"{field}.{k}") for k, v in params.items()}
        if len(thetas) != 1:
            _fail(source, field, params, "one rope_theta for every layer type")
        return thetas.pop()
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        _fail(source, f"{field}.rope_type", rope_type, "'default' (scaled RoPE variants are not implemented)")
    theta = params.get("rope_theta", 10000.0)
    if theta is None:
        theta = 10000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 < float(theta) < float("inf"):
        _fail(source, "rope_theta" if top_level or "rope_theta" not in params else f"{field}.rope_theta", theta,
              "a finite number > 0")
    return float(theta)


def _derived_head_dim(hidden: int, heads: int, source: str, keys=("hidden_size", "num_attention_heads")) -> int:
    if hidden % heads:
        _fail(source, keys[1], heads, f"a divisor of {keys[0]}={hidden}")
    return hidden // heads
