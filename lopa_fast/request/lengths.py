"""Lengths of a request: max_new_tokens' default (the model's generation_config.json, else 512) and the length
decoded, in whole blocks of the strategy's length unit (docs/decoding.md "Lengths": rounded up before decoding, the
output cut after)."""
from __future__ import annotations

from lopa_fast.errors import KnobError
from lopa_fast.request.knobs import INT_KNOB_LIMIT

DEFAULT_MAX_NEW_TOKENS = 512  # max_new_tokens=None when the model's generation_config.json has none


def default_max_new_tokens(model) -> tuple[int, str]:
    """(max_new_tokens, source) for `max_new_tokens=None`: `max_new_tokens` of the generation_config.json in the
    model's directory (`model.name_or_path`, set by load_model) when it has one, else DEFAULT_MAX_NEW_TOKENS."""
    from pathlib import Path

    from lopa_fast.errors import ConfigError
    from lopa_fast.models.checkpoint import read_json

    where = getattr(model, "name_or_path", None)
    f = Path(where) / "generation_config.json" if where else None
    if f is None or not f.is_file():
        return DEFAULT_MAX_NEW_TOKENS, "default"
    data = read_json(f)  # ConfigError naming the file when it is not JSON
    n = data.get("max_new_tokens") if isinstance(data, dict) else None
    if n is None:
        return DEFAULT_MAX_NEW_TOKENS, "default"
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < INT_KNOB_LIMIT:
        raise ConfigError(f"{f}: max_new_tokens={n!r}; expected an int >= 1", file=f, key="max_new_tokens", value=n)
    return n, "generation_config.json"


def plan_length(cfg, model, prompt_len: int, spec) -> tuple:
    """(config whose max_new_tokens is the length to DECODE, info) for a prompt of `prompt_len` tokens.

    info: requested (the length the output is cut to), decoded (whole blocks), source ("argument",
    "generation_config.json" or "default"), clipped (the reason, when the default was clipped to the room
    left in max_position_embeddings). An explicit max_new_tokens that fits but whose whole-block rounding
    does not raises KnobError (the position limit check of a plain overflow stays in prompts.check_prompt).
    """
    limit = model.config.max_position_embeddings
    room = limit - prompt_len
    info: dict = {}
    unit = cfg.length_unit(spec)  # decoding needs whole blocks of it, strict or not
    if cfg.max_new_tokens is None:
        n, source = default_max_new_tokens(model)
        if cfg.strict_length and n % unit:
            raise KnobError(
                f"max_new_tokens=None: the default {n} ({source}) is not a multiple of the block {unit} and "
                "strict_length=True; pass max_new_tokens=", knob="max_new_tokens", value=n)
        fit = (room // unit) * unit
        if fit < 1:
            raise KnobError(
                f"max_new_tokens: the prompt ({prompt_len} tokens) leaves {max(room, 0)} of the model's "
                f"max_position_embeddings={limit} positions, less than one block of {unit}; shorten the prompt",
                knob="max_new_tokens", value=None)
        if n > fit:
            info["clipped"] = (f"max_new_tokens {n} ({source}) clipped to {fit}: prompt {prompt_len} + {n} "
                               f"exceeds max_position_embeddings={limit}")
            n = fit
        info["source"] = source
    else:
        n = cfg.max_new_tokens
        info["source"] = "argument"
        d = cfg.decode_length(n, spec)
        if prompt_len + n > limit:
            raise KnobError(
                f"prompt length {prompt_len} + max_new_tokens {n} = {prompt_len + n} exceeds the model's "
                f"max_position_embeddings={limit}", knob="max_new_tokens", value=n)
        if prompt_len + d > limit:
            raise KnobError(
                f"max_new_tokens={n} is decoded in whole blocks of {unit} ({d} positions), and prompt length "
                f"{prompt_len} + {d} exceeds the model's max_position_embeddings={limit}; pass max_new_tokens <= "
                f"{max(room // unit * unit, 0)} or a smaller block", knob="max_new_tokens", value=n)
    info["requested"] = n
    info["decoded"] = cfg.decode_length(n, spec)
    return cfg.replace(max_new_tokens=info["decoded"]), info
