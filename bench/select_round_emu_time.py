"""Per-call time of ops.select_round on CPU: torch reference, cpp kernel, and the CUDA kernel through the host
emulation (one std::thread per CUDA thread: meaningless for GPU speed, recorded for the record only), on rounds
recorded from the parity grid's first 4 CI cases. Usage: PYTHONPATH=. python bench/select_round_emu_time.py"""
import time

import torch

from lopa_fast import ops
from lopa_fast.ops.cuda.emulation import emulator
from tests import test_fast_parity as parity
from tests.test_select_round import _record

torch.set_num_threads(1)
calls = _record(parity.ci_subset()[:4])
emu = emulator(("select_round",))
runs = {"torch": lambda a, k: ops.select_round(*a, **k, backend="torch"),
        "cpp": lambda a, k: ops.select_round(*a, **k, backend="cpp"),
        "cuda (host emulation)": lambda a, k: emu.select_round(*a, **k)}
print(f"{len(calls)} recorded rounds; per-call mean over 3 passes")
for name, f in runs.items():
    for a, k in calls:
        f(a, k)  # warm
    t0 = time.perf_counter()
    for _ in range(3):
        for a, k in calls:
            f(a, k)
    print(f"{name}: {(time.perf_counter() - t0) / (3 * len(calls)) * 1e6:.0f} us/call")
