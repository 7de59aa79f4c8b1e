"""LLaDA-style block loops (vanilla with block_length, threshold): the knobs' values and the rule between the
decoded length, block_length and steps, shared by the two strategies that read them."""
from __future__ import annotations

from lopa_fast.request.knobs import check_bool, check_positive_int
from lopa_fast.strategies.registry import decode_length


def check_steps_and_block_length(cfg) -> None:
    check_positive_int("steps", cfg.steps, allow_none=True)
    check_positive_int("block_length", cfg.block_length, allow_none=True)


def check_flags(cfg, names) -> None:
    for name in names:
        if getattr(cfg, name) is not None:
            check_bool(name, getattr(cfg, name))


def check_blocks(cfg) -> None:
    """gen_length % block_length == 0 and steps % num_blocks == 0 (gen_length: the decoded length, i.e.
    max_new_tokens rounded up to whole blocks unless strict_length)."""
    bl = cfg.block_length
    if bl is None or cfg.max_new_tokens is None:
        return  # vanilla Dream has no blocks; LLaDA / threshold's default block_length is resolved by resolve()
    if cfg.strict_length and cfg.max_new_tokens % bl:
        raise ValueError(
            f"block_length={bl} must divide max_new_tokens={cfg.max_new_tokens} with strict_length=True "
            f"(strategy={cfg.strategy!r} decodes max_new_tokens in blocks of block_length)"
        )
    n = decode_length(cfg.max_new_tokens, bl, cfg.strict_length)  # bl is the strategy's length unit here
    nb = n // bl
    if cfg.steps is not None and cfg.steps % nb:
        raise ValueError(
            f"steps={cfg.steps} must be a multiple of the number of blocks {nb} "
            f"(= max_new_tokens {n} / block_length {bl})"
        )
