"""The tiny config.json of each model family, in its real checkpoints' format (Dream / qwen2 / llada): what tests,
benchmarks and the embedded-model recipes build random models and checkpoints from (lopa_fast.testing). A new
family adds its tiny config here, beside its parse in config.py."""
from __future__ import annotations


def tiny_hf_config(
    kind: str = "dream",
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    mask_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> dict:
    """config.json dict for kind in {"dream", "qwen2", "llada"}; special ids default to the top of the vocab."""
    mask = vocab_size - 1 if mask_token_id is None else mask_token_id
    eos = vocab_size - 2 if eos_token_id is None else eos_token_id
    pad = eos if pad_token_id is None else pad_token_id
    bos = vocab_size - 3 if bos_token_id is None else bos_token_id
    if kind in ("dream", "qwen2"):
        cfg = {
            "model_type": "Dream" if kind == "dream" else "qwen2",
            "architectures": ["DreamModel" if kind == "dream" else "Qwen2ForCausalLM"],
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": max_position_embeddings,
            "rope_theta": rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": tie_word_embeddings,
            "hidden_act": "silu",
            "eos_token_id": eos,
            "pad_token_id": pad,
            "bos_token_id": bos,
        }
        if kind == "dream":
            cfg["mask_token_id"] = mask
        return cfg
    if kind == "llada":
        return {
            "model_type": "llada",
            "architectures": ["LLaDAModelLM"],
            "d_model": hidden_size,
            "n_heads": num_heads,
            "n_kv_heads": num_kv_heads,
            "n_layers": num_layers,
            "mlp_hidden_size": intermediate_size,
            "mlp_ratio": 4,
            "embedding_size": vocab_size,
            "vocab_size": vocab_size,
            "max_sequence_length": max_position_embeddings,
            "rope_theta": rope_theta,
            "rms_norm_eps": 1e-5,
            "layer_norm_type": "rms",
            "block_type": "llama",
            "include_bias": False,
            "include_qkv_bias": False,
            "weight_tying": tie_word_embeddings,
            "mask_token_id": mask,
            "eos_token_id": eos,
            "pad_token_id": pad,
        }
    raise ValueError(f"tiny_hf_config: kind={kind!r}; allowed: 'dream', 'qwen2', 'llada'")
