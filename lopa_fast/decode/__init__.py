"""Fast decoders: the step / round on the device, one host read per step / round.

`FAST_STRATEGIES` maps a strategy name to `fn(model, prompt_ids [P], cfg, on_round=None) -> GenerateOutput`
(looked up by lopa_fast.api for backend="fast" / "auto"; apd's takes `verifier=` too). Covered: vanilla,
threshold, d2f, lopa, apd at any temperature (keyed sampler); `fast_not_covered` names what
is not.
"""
from lopa_fast.decode.apd import generate as _apd
from lopa_fast.decode.d2f import generate as _d2f
from lopa_fast.decode.lopa import generate as _lopa
from lopa_fast.decode.syncs import count_host_syncs
from lopa_fast.decode.threshold import generate as _threshold
from lopa_fast.decode.vanilla import generate as _vanilla
from lopa_fast.keyed import needs_draws

FAST_STRATEGIES = {"vanilla": _vanilla, "threshold": _threshold, "d2f": _d2f, "lopa": _lopa, "apd": _apd}



def fast_not_covered(cfg) -> str | None:
    """Why the fast backend cannot run this validated config (a phrase naming the knob), or None.

    Random draws run on the keyed sampler (lopa_fast.keyed: a pure function of seed, step and position, so a
    batched step draws what the reference draws); upstream's draw-for-draw order (sampler="upstream") exists
    only on the per-step reference (APD's default, for exactness with upstream at T > 0: pass sampler='keyed'
    for its fast path)."""
    if getattr(cfg, "sampler", "keyed") == "upstream" and needs_draws(cfg):
        fast = ("for apd's fast path pass sampler='keyed' (apd's default at T > 0 is upstream's order, for "
                "exactness with upstream)" if cfg.strategy == "apd"
                else "the fast backend draws with sampler='keyed' (the default)")  # fmt: skip
        return f"sampler='upstream' (upstream's draw order from one generator) runs on the per-step reference only; {fast}"
    return None


__all__ = ["FAST_STRATEGIES", "count_host_syncs", "fast_not_covered"]
