"""Fast decoders: all branches of a round in one batched forward, round state on the device.

`FAST_STRATEGIES` maps a strategy name to `fn(model, prompt_ids [P], cfg) -> GenerateOutput`
(looked up by lopa_fast.api for backend="fast" / "auto"; apd's takes `verifier=` too). Covered: d2f, lopa,
apd (temperature 0).
"""
from lopa_fast.decode.apd import generate as _apd
from lopa_fast.decode.d2f import generate as _d2f
from lopa_fast.decode.lopa import generate as _lopa
from lopa_fast.decode.syncs import count_host_syncs

FAST_STRATEGIES = {"d2f": _d2f, "lopa": _lopa, "apd": _apd}



def fast_not_covered(cfg) -> str | None:
    """Why the fast backend cannot run this validated config (a phrase naming the knob), or None.

    Sampling at T > 0 draws random numbers per block / per branch in the reference's order, which a
    batched round cannot reproduce, so T > 0 runs on the reference (lopa_fast.api decides)."""
    if cfg.temperature != 0:
        return f"covers temperature=0 only (greedy, upstream's setting); got temperature={cfg.temperature!r}"
    return None


__all__ = ["FAST_STRATEGIES", "count_host_syncs", "fast_not_covered"]
