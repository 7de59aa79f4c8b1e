"""Fast decoders: the step / round on the device, one host read per step / round.

Each strategy's spec (lopa_fast.strategies) names its fast decoder, `fn(model, prompt_ids [P], cfg, on_round=None)
-> GenerateOutput` (apd's takes `verifier=` too), and, where requests can share a forward, its per-request driver
for the batch scheduler (`batch.py`). `fast_not_covered` names a knob no fast decoder covers.
"""
from lopa_fast import strategies
from lopa_fast.decode.syncs import count_host_syncs
from lopa_fast.keyed import needs_draws


def fast_not_covered(cfg) -> str | None:
    """Why the fast backend cannot run this validated config (a phrase naming the knob), or None.

    Random draws run on the keyed sampler (lopa_fast.keyed: a pure function of seed, step and position, so a
    batched step draws what the reference draws); upstream's draw-for-draw order (sampler="upstream") exists
    only on the per-step reference (APD's default, for exactness with upstream at T > 0: pass sampler='keyed'
    for its fast path)."""
    if getattr(cfg, "sampler", "keyed") == "upstream" and needs_draws(cfg):
        if strategies.get(cfg.strategy).default_sampler == "upstream":
            fast = (f"for {cfg.strategy}'s fast path pass sampler='keyed' ({cfg.strategy}'s default at T > 0 is "
                    "upstream's order, for exactness with upstream)")  # fmt: skip
        else:
            fast = "the fast backend draws with sampler='keyed' (the default)"
        return f"sampler='upstream' (upstream's draw order from one generator) runs on the per-step reference only; {fast}"
    return None


__all__ = ["count_host_syncs", "fast_not_covered"]
