"""threshold: Fast-dLLM's confidence-threshold parallel decoding (and dParallel's entropy threshold) over
LLaDA-style blocks, with the prefix / dual caches. docs/semantics.md section 4.3."""
from __future__ import annotations

from lopa_fast.request.knobs import check_choice, check_number, check_prob
from lopa_fast.strategies import blocks
from lopa_fast.strategies.registry import SOLO, Strategy, register
from lopa_fast.strategies.threshold.knobs import CACHE_MODES, ThresholdKnobs

KNOBS = ("steps", "block_length", "threshold", "factor", "entropy_threshold", "cache", "count_noop_forward")
RULES = ("threshold", "factor", "entropy_threshold")  # at most one of them
# none of RULES given: Fast-dLLM's default confidence threshold (its generate.py / eval scripts' threshold=0.9), on
# every route (generate, the CLI, the server, lm-eval), as a model's other defaults are (issue 42, finding 3)
DEFAULT_THRESHOLD = 0.9


def validate(cfg) -> None:
    blocks.check_steps_and_block_length(cfg)
    check_prob("threshold", cfg.threshold, allow_none=True)
    check_number("factor", cfg.factor, allow_none=True)
    if cfg.factor is not None and cfg.factor <= 0:
        raise ValueError(f"factor={cfg.factor!r}; allowed: a number > 0")
    check_number("entropy_threshold", cfg.entropy_threshold, allow_none=True)
    if cfg.entropy_threshold is not None and cfg.entropy_threshold < 0:
        raise ValueError(f"entropy_threshold={cfg.entropy_threshold!r}; allowed: >= 0 (nats)")
    if cfg.cache is not None:
        check_choice("cache", cfg.cache, CACHE_MODES)
    blocks.check_flags(cfg, ("count_noop_forward",))
    given = [k for k in RULES if getattr(cfg, k) is not None]
    if len(given) > 1:
        raise ValueError(f"threshold strategy: {' and '.join(f'{k}={getattr(cfg, k)!r}' for k in given)} given; "
                         "allowed: exactly one of threshold=, factor=, entropy_threshold=")
    blocks.check_blocks(cfg)  # none given: resolve sets Fast-dLLM's default rule, threshold=DEFAULT_THRESHOLD


def resolve(cfg, model):
    bl = length_unit(cfg)
    if all(getattr(cfg, k) is None for k in RULES):
        cfg = cfg.replace(threshold=DEFAULT_THRESHOLD)
    out = cfg.replace(block_length=bl, steps=cfg.steps if cfg.steps is not None else cfg.max_new_tokens // bl,
                      count_noop_forward=bool(cfg.count_noop_forward))
    blocks.check_blocks(out)
    return out


def cache_rows(prompt_len: int, cfg) -> int:
    """The cache of every position (cache "prefix" / "dual") or none."""
    return prompt_len + cfg.max_new_tokens if cfg.cache is not None else 1


def length_unit(cfg) -> int:
    return cfg.block_length if cfg.block_length is not None else cfg.block_size


def eval_rows(block_size: int, gen_len: int) -> dict[str, dict]:
    """The eval's row: Fast-dLLM's confidence threshold 0.9 (its default), block_length = the block size, no cache."""
    return {"threshold": dict(strategy="threshold", block_size=block_size, block_length=block_size,
                              threshold=DEFAULT_THRESHOLD)}


SPEC = register(Strategy(
    name="threshold", summary="Fast-dLLM / dParallel threshold decoding (confidence, factor or entropy rule)",
    reference="lopa_fast.strategies.threshold.reference:generate", fast=SOLO,
    knobs=KNOBS, knob_class=ThresholdKnobs, validate=validate, resolve=resolve, length_unit=length_unit,
    driver="lopa_fast.strategies.threshold.driver:ThresholdDriver", cache_rows=cache_rows,
    compile=True, compile_batches=True, eval_rows=eval_rows,
))
