"""A config's knobs checked against the model (GenerateConfig.resolve): the model can run diffusion decoding, and
the mask / EOS ids (the model's when unset), top_k and the stop sequences fit its vocabulary."""
from __future__ import annotations


def model_ids(cfg, model) -> tuple[int, int | None]:
    """(mask_token_id, eos_token_id) of a validated config on `model` (the model's where the config has None);
    ValueError naming the knob, the value and what the model allows."""
    if not model.config.is_diffusion:  # the real reason first: a causal AR model has no mask token to ask for
        raise ValueError(
            f"model_type {model.config.model_type!r} (causal AR Qwen2) cannot run diffusion decoding; "
            "use a Dream / D2F / DiffuCoder / LLaDA model (a qwen2 model is APD's verifier: strategy='apd', "
            "verifier=)"
        )
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else model.mask_token_id
    if mask is None:
        raise ValueError("mask_token_id=None and the model config has none; pass mask_token_id=")
    vocab = model.config.vocab_size
    if not 0 <= mask < vocab:
        raise ValueError(f"mask_token_id={mask}; allowed: an id in [0, vocab_size={vocab})")
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else model.eos_token_id
    if eos is not None and not 0 <= eos < vocab:
        raise ValueError(f"eos_token_id={eos}; allowed: an id in [0, vocab_size={vocab})")
    if eos is not None and eos == mask:
        raise ValueError(f"eos_token_id={eos} equals mask_token_id; they must differ")
    if cfg.top_k is not None and cfg.top_k > vocab:
        raise ValueError(f"top_k={cfg.top_k}; allowed: 1..vocab_size={vocab}")
    for q in cfg.stop or ():
        if max(q) >= vocab:
            raise ValueError(f"stop sequence {list(q)!r} holds id {max(q)}; allowed: ids in [0, vocab_size={vocab})")
    return mask, eos
