"""Fast decoders: all branches of a round in one batched forward, round state on the device.

`FAST_STRATEGIES` maps a strategy name to `fn(model, prompt_ids [P], cfg) -> GenerateOutput`
(looked up by lopa_fast.api for backend="fast" / "auto"). Covered: d2f, lopa (temperature 0).
"""
from lopa_fast.decode.d2f import generate as _d2f
from lopa_fast.decode.lopa import generate as _lopa
from lopa_fast.decode.syncs import count_host_syncs

FAST_STRATEGIES = {"d2f": _d2f, "lopa": _lopa}

__all__ = ["FAST_STRATEGIES", "count_host_syncs"]
