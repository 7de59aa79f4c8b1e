"""lopa: Lookahead Parallel Decoding (docs/semantics.md section 3): D2F's round with an anchor and k lookahead
branches verified in one forward; branching_factor=1 is plain D2F."""
from __future__ import annotations

from lopa_fast.knobs import check_positive_int, check_prob
from lopa_fast.strategies.d2f import block_size, cache_rows, check_strict_length, eval_knobs, round_driver
from lopa_fast.strategies.registry import SOLO, Strategy, register


def check_values(cfg) -> None:
    """LoPA's own knobs (k, the branch score's top-p and alpha; checked for every request: `Strategy.check_values`;
    D2F's round knobs it shares are D2F's)."""
    check_positive_int("branching_factor", cfg.branching_factor)
    check_prob("branch_topp", cfg.branch_topp)
    check_prob("selection_conf_alpha", cfg.selection_conf_alpha)


def rows(cfg) -> int:
    """Branch slots of one request: the anchor and k lookaheads for k >= 2, else the anchor alone."""
    k = cfg.branching_factor
    return k + 1 if k >= 2 else 1


def eval_rows(block_size: int, gen_len: int) -> dict[str, dict]:
    """The eval's rows: k in {2, 4, 8} with D2F's eval knobs, branch_topp 1 and alpha 0 (the spec defaults)."""
    return {f"lopa-k{k}": dict(strategy="lopa", branching_factor=k, **eval_knobs(block_size)) for k in (2, 4, 8)}


def driver(model, prompt, cfg, cache=None):
    """The per-request driver of the one loop (lopa_fast.decode.batch): the round with k + 1 branches (branch
    statistics on)."""
    return round_driver(model, prompt, cfg, cfg.branching_factor, "lopa", cache, branch_stats=True)


SPEC = register(Strategy(
    name="lopa", summary="LoPA: anchor + k lookahead branches verified in one forward per round",
    reference="lopa_fast.reference.lopa:generate", fast=SOLO,
    validate=check_strict_length, check_values=check_values, length_unit=block_size, rows=rows, driver=driver,
    cache_rows=cache_rows, compile=True, compile_batches=True, distributed=True, eval_rows=eval_rows,
))  # fmt: skip
