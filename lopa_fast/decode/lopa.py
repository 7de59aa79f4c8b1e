"""Fast LoPA (docs/semantics.md section 3): anchor + k lookahead branches verified in one forward."""
from lopa_fast.decode.d2f import run_fast


def generate(model, prompt, cfg, on_round=None):
    """LoPA; branching_factor k >= 2 verifies k+1 sequences per round (k = 1 is plain D2F).
    Token-for-token equal to lopa_fast.reference.lopa at temperature 0."""
    return run_fast(model, prompt, cfg, branching_factor=cfg.branching_factor, name="lopa", on_round=on_round,
                    branch_stats=True)
