"""The one loop (batch.py: `Scheduler.step`, `run_solo`, `run_batch`, `BatchEngine`), the compile layer (compiled.py,
compiled_batch.py), the KV pool and the driver protocol (driver.py). It knows no strategy: the request's plan hands
it the strategy's spec (its `driver`, `rows`, `cache_rows`, ...; lopa_fast.strategies), and a strategy's spec names
`batch.run_solo` as its fast decoder (the registry binds the spec into it): the request as a batch of one.
"""
from lopa_fast.decode.syncs import count_host_syncs


__all__ = ["count_host_syncs"]
