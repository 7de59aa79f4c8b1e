"""Fast decoders: the step / round on the device, one host read per step / round.

Each strategy's spec (lopa_fast.strategies) names its fast decoder, `fn(model, prompt_ids [P], cfg, on_round=None)
-> GenerateOutput` (apd's takes `verifier=` too), and, where requests can share a forward, its per-request driver
for the batch scheduler (`batch.py`). `lopa_fast.strategies.fast_not_covered` names a knob no fast decoder covers.
"""
from lopa_fast.decode.syncs import count_host_syncs


__all__ = ["count_host_syncs"]
