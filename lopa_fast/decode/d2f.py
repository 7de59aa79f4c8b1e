"""Fast D2F (docs/semantics.md section 2): the batched engine with one branch (no lookahead); `run_fast` is the one
entry of the device-resident round for d2f and lopa (one process, or the round's branch slots over the ranks)."""
from lopa_fast.decode.engine import FastDecoder
from lopa_fast.output import GenerateOutput


def run_fast(model, prompt, cfg, branching_factor: int, name: str, on_round=None,
             branch_stats: bool = False) -> GenerateOutput:
    """Run one request on the fast decoder (cfg bound and covered: lopa_fast.api checked both)."""
    if cfg.distributed:  # the round's branch slots split over the process group's ranks
        from lopa_fast.distributed import run_distributed

        return run_distributed(model, prompt, cfg, branching_factor, name, on_round, branch_stats)
    return FastDecoder(model, prompt, cfg, branching_factor, name, branch_stats=branch_stats).run(on_round)


def generate(model, prompt, cfg, on_round=None):
    """D2F pipelined block decoding; token-for-token equal to lopa_fast.reference.d2f at temperature 0."""
    return run_fast(model, prompt, cfg, branching_factor=1, name="d2f", on_round=on_round)
