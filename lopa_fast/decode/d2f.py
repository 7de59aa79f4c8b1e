"""Fast D2F (docs/semantics.md section 2): the batched engine with one branch (no lookahead)."""
from lopa_fast.decode.engine import run_fast


def generate(model, prompt, cfg, on_round=None):
    """D2F pipelined block decoding; token-for-token equal to lopa_fast.reference.d2f at temperature 0."""
    return run_fast(model, prompt, cfg, branching_factor=1, name="d2f", on_round=on_round)
