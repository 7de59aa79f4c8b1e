"""Fast decoders: the step / round on the device, one host read per step / round.

Each strategy's spec (lopa_fast.strategies) names its per-request driver (`driver.py`: the protocol) and, as its
fast decoder, `batch.run_solo(model, prompt_ids [P], cfg, verifier=None, on_round=None) -> GenerateOutput`: the
request as a batch of one through the one loop (`batch.Scheduler.step`, which also runs batched and served
requests). `lopa_fast.strategies.fast_not_covered` names a knob no fast decoder covers.
"""
from lopa_fast.decode.syncs import count_host_syncs


__all__ = ["count_host_syncs"]
