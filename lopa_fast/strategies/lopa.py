"""lopa: Lookahead Parallel Decoding (docs/semantics.md section 3): D2F's round with an anchor and k lookahead
branches verified in one forward; branching_factor=1 is plain D2F."""
from __future__ import annotations

from lopa_fast.strategies.d2f import block_size, cache_rows, check_strict_length, round_driver
from lopa_fast.strategies.registry import SOLO, Strategy, register


def rows(cfg) -> int:
    """Branch slots of one request: the anchor and k lookaheads for k >= 2, else the anchor alone."""
    k = cfg.branching_factor
    return k + 1 if k >= 2 else 1


def driver(model, prompt, cfg, cache=None):
    """The per-request driver of the one loop (lopa_fast.decode.batch): the round with k + 1 branches (branch
    statistics on)."""
    return round_driver(model, prompt, cfg, cfg.branching_factor, "lopa", cache, branch_stats=True)


SPEC = register(Strategy(
    name="lopa", summary="LoPA: anchor + k lookahead branches verified in one forward per round",
    reference="lopa_fast.reference.lopa:generate", fast=SOLO,
    validate=check_strict_length, length_unit=block_size, rows=rows, driver=driver, cache_rows=cache_rows,
    compile=True, compile_batches=True, distributed=True,
))  # fmt: skip
