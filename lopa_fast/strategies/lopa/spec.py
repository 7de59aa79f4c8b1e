"""The D2F round family's specs: d2f, Discrete Diffusion Forcing's pipelined block decoding (docs/semantics.md
section 2), and lopa, Lookahead Parallel Decoding (section 3): D2F's round with an anchor and k lookahead branches
verified in one forward (branching_factor=1 is plain D2F). Both run the device-resident round of this folder
(driver.py, round.py) stepped by the one loop (`batch.run_solo`); their oracles are reference_d2f.py and
reference_lopa.py."""
from __future__ import annotations

from lopa_fast.request.knobs import SAMPLING_STRATEGIES, check_bool, check_choice, check_positive_int, check_prob
from lopa_fast.strategies.lopa.knobs import LopaKnobs
from lopa_fast.strategies.registry import SOLO, Strategy, register

THRESHOLDS = ("block_add_threshold", "decoded_token_threshold", "skip_threshold")  # tau_add, tau_act, tau_conf


def check_values(cfg) -> None:
    """D2F's round knobs (shared with LoPA): the three thresholds, the confidence, the attention (checked for every
    request: `Strategy.check_values`)."""
    for name in THRESHOLDS:
        check_prob(name, getattr(cfg, name))
    check_choice("sampling_strategy", cfg.sampling_strategy, SAMPLING_STRATEGIES)
    check_bool("use_full_attention", cfg.use_full_attention)


def check_strict_length(cfg) -> None:
    """strict_length=True: the request must be whole blocks of block_size (blocks are appended whole)."""
    if cfg.strict_length and cfg.max_new_tokens is not None and cfg.max_new_tokens % cfg.block_size:
        raise ValueError(
            f"max_new_tokens={cfg.max_new_tokens} must be a multiple of block_size={cfg.block_size} "
            f"for strategy={cfg.strategy!r} with strict_length=True (blocks of block_size tokens are appended; "
            "strict_length=False decodes whole blocks and cuts the output to max_new_tokens)"
        )


def block_size(cfg) -> int:
    return cfg.block_size


def cache_rows(prompt_len: int, cfg) -> int:
    """The request's static cache: its buffer (prompt + generated blocks, rounded up) + the trash row."""
    from lopa_fast.strategies.lopa.driver import buffer_len

    return buffer_len(prompt_len, cfg) + 1


def eval_knobs(block_size: int) -> dict:
    """The eval's D2F knobs (the spec's GSM8K row, shared by the LoPA rows): tau_add 0.1, tau_act 0.95, tau_conf 0.9,
    neg_entropy, full attention (LoPA's default)."""
    return dict(block_size=block_size, block_add_threshold=0.1, decoded_token_threshold=0.95, skip_threshold=0.9,
                sampling_strategy="neg_entropy", use_full_attention=True)


def eval_rows(block_size: int, gen_len: int) -> dict[str, dict]:
    return {"d2f": dict(strategy="d2f", **eval_knobs(block_size))}


def round_driver(model, prompt, cfg, branching_factor: int, name: str, cache=None, branch_stats: bool = False):
    """The device-resident round's driver (lopa_fast.decode.driver) for d2f and lopa: one process
    (`driver.FastDecoder`), or with distributed=True the round's branch slots over the process group's ranks
    (`strategies/lopa/distributed.driver`: its forward and finish exchange across ranks)."""
    if cfg.distributed:
        from lopa_fast.strategies.lopa.distributed import driver as distributed_driver

        return distributed_driver(model, prompt, cfg, branching_factor, name, cache, branch_stats)
    from lopa_fast.strategies.lopa.driver import FastDecoder

    return FastDecoder(model, prompt, cfg, branching_factor, name, cache=cache, branch_stats=branch_stats)


def driver(model, prompt, cfg, cache=None):
    """The per-request driver of the one loop (lopa_fast.decode.batch): the round with one branch."""
    return round_driver(model, prompt, cfg, 1, "d2f", cache)


def attention_mode(cfg) -> tuple:
    """The batch engine's key part (`Strategy.share_key`): requests of one attention mode share a scheduler."""
    return (bool(cfg.use_full_attention),)


# what d2f and lopa share: the round's knobs, blocks, cache, batching key and capabilities
ROUND = dict(fast=SOLO, validate=check_strict_length, length_unit=block_size, cache_rows=cache_rows,
             share_key=attention_mode, knob_class=LopaKnobs, compile=True, compile_batches=True, distributed=True)

D2F_SPEC = register(Strategy(
    name="d2f", summary="D2F pipelined block decoding (one branch per round)",
    reference="lopa_fast.strategies.lopa.reference_d2f:generate", check_values=check_values, driver=driver,
    eval_rows=eval_rows, **ROUND,
))


# ---- lopa: the same round with k lookahead branches ----------------------------------------------------------


def check_lopa_values(cfg) -> None:
    """LoPA's own knobs (k, the branch score's top-p and alpha; checked for every request: `Strategy.check_values`;
    D2F's round knobs it shares are D2F's)."""
    check_positive_int("branching_factor", cfg.branching_factor)
    check_prob("branch_topp", cfg.branch_topp)
    check_prob("selection_conf_alpha", cfg.selection_conf_alpha)


def lopa_rows(cfg) -> int:
    """Branch slots of one request: the anchor and k lookaheads for k >= 2, else the anchor alone."""
    k = cfg.branching_factor
    return k + 1 if k >= 2 else 1


def lopa_eval_rows(block_size: int, gen_len: int) -> dict[str, dict]:
    """The eval's rows: k in {2, 4, 8} with D2F's eval knobs, branch_topp 1 and alpha 0 (the spec defaults)."""
    return {f"lopa-k{k}": dict(strategy="lopa", branching_factor=k, **eval_knobs(block_size)) for k in (2, 4, 8)}


def lopa_driver(model, prompt, cfg, cache=None):
    """The per-request driver of the one loop (lopa_fast.decode.batch): the round with k + 1 branches (branch
    statistics on)."""
    return round_driver(model, prompt, cfg, cfg.branching_factor, "lopa", cache, branch_stats=True)


LOPA_SPEC = register(Strategy(
    name="lopa", summary="LoPA: anchor + k lookahead branches verified in one forward per round",
    reference="lopa_fast.strategies.lopa.reference_lopa:generate", check_values=check_lopa_values, rows=lopa_rows,
    driver=lopa_driver, eval_rows=lopa_eval_rows, **ROUND,
))
