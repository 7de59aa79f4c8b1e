"""A model's own knobs: the defaults every route (`generate`, `stream`, the CLI, the server, lm-eval) uses for a knob
the caller does not give, so that `--strategy threshold` on the embedded model runs the model's threshold setting
instead of GenerateConfig's generic one (issue 42, finding 2: block 32 and 128 - P new tokens answered `#### 25`,
the model's block 8 and 32 tokens answer 26).

For the embedded models (lopa_fast/assets) the knobs are the eval row of the requested strategy on the model's task
(lopa_fast.tasks.eval_rows: block 8, the task's max_new_tokens, the strategy's paper settings); other models have no
row here (their generation_config.json supplies max_new_tokens, lopa_fast.request.lengths.default_max_new_tokens). A
knob the caller gives always wins, and defaults tied to it are dropped (`merge`). Light: no torch (the CLI's parser
reads it).
"""
from __future__ import annotations

from pathlib import Path

# embedded model -> (its eval task, the rows that differ from STRATEGY_ROW for it)
EMBEDDED = {
    "d2f-arith": ("arith", {}),
    "d2f-arith-var": ("arith-var", {}),
    "dparallel-arith-var": ("arith-var", {"threshold": "dparallel-h0.45", "lopa": "dparallel-lopa-k4"}),
}
# the eval row that is a strategy's own setting (apd's rows need the verifier model: its knobs are not defaults)
STRATEGY_ROW = {"vanilla": "vanilla", "threshold": "threshold", "d2f": "d2f", "lopa": "lopa-k4"}
DEFAULT_STRATEGY = "lopa"  # GenerateConfig's

# a default dropped when the caller gives one of these knobs (it was derived from them in the row)
_TIED = {
    "block_length": ("block_size", "block_length"),  # threshold's row: block_length = block_size
    "steps": ("max_new_tokens", "steps"),  # vanilla's row: steps = max_new_tokens (one token per forward)
    "threshold": ("threshold", "factor", "entropy_threshold"),  # threshold takes one rule
    "entropy_threshold": ("threshold", "factor", "entropy_threshold"),
}


def embedded_name(path) -> str | None:
    """The embedded model a directory is (a name of EMBEDDED), or None for any other directory or None."""
    if path is None:
        return None
    from lopa_fast.assets import ASSETS_DIR

    try:
        p = Path(path).resolve()
    except (OSError, TypeError, ValueError):
        return None
    return p.name if p.parent == ASSETS_DIR and p.name in EMBEDDED else None


def task_of(path) -> str | None:
    """The eval task of an embedded model directory (None: not one)."""
    name = embedded_name(path)
    return None if name is None else EMBEDDED[name][0]


def model_knobs(path, strategy: str | None = None) -> dict:
    """The knobs a model directory runs `strategy` with (None: the default strategy) when the caller gives none:
    for an embedded model the strategy's eval row on the model's task with the task's max_new_tokens (apd: only the
    length); {} for any other model or an unknown strategy (the caller's checks name it)."""
    name = embedded_name(path)
    if name is None:
        return {}
    from lopa_fast.tasks.eval_rows import BLOCK, eval_task, make_rows

    strategy = strategy or DEFAULT_STRATEGY
    task, own = EMBEDDED[name]
    t = eval_task(task)
    row = own.get(strategy, STRATEGY_ROW.get(strategy))
    rows = make_rows(BLOCK, gen_len=t.gen_len, student=t.student is not None)
    knobs = dict(rows[row]) if row in rows else {"strategy": strategy}
    knobs["max_new_tokens"] = t.gen_len
    return knobs


def merge(defaults: dict, given: dict) -> dict:
    """`given` over `defaults`, less the defaults tied to a given knob (`_TIED`: block_length follows a given
    block_size, vanilla's steps a given max_new_tokens, threshold's rule any given rule)."""
    out = {k: v for k, v in defaults.items() if not any(g in given for g in _TIED.get(k, ()))}
    out.update(given)
    return out


def with_model_knobs(model, given: dict) -> dict:
    """`given` (the knobs a caller passed) over the model's own (`model_knobs` of `model.name_or_path`, which
    lopa_fast.load_model sets), for the strategy given (else the default)."""
    defaults = model_knobs(getattr(model, "name_or_path", None), given.get("strategy"))
    return merge(defaults, given) if defaults else dict(given)
