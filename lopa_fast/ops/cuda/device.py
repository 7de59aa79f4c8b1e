"""The GPU launcher: a compiled cubin (lopa_fast.ops.cuda.source) loaded with cupy.RawModule, launched on the
current torch stream of the tensors' device."""
from __future__ import annotations

import functools

import torch

from lopa_fast.ops.cuda.source import cached_cubin


def _by_value_struct(ptrs: tuple[int, ...]):
    """Launch kind "t": n pointers as one kernel parameter `struct { long long p[n]; }`. CuPy passes a numpy array
    of size one by value (its bytes into the launch's parameter buffer), so nothing is copied to the device."""
    import numpy as np  # noqa: PLC0415

    a = np.zeros(1, dtype=np.dtype([("p", np.int64, (len(ptrs),))]))
    a["p"][0] = ptrs
    return a


class CupyLauncher:
    """A `launch.Launch` for one op's cubin on one CUDA device."""

    def __init__(self, op: str, device: torch.device):
        import cupy  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415

        self._cupy = cupy
        self._conv = {"p": np.uint64, "i": np.int32, "q": np.int64, "f": np.float32, "t": _by_value_struct}
        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        with cupy.cuda.Device(device.index):
            self._mod = cupy.RawModule(path=str(cached_cubin(op, major * 10 + minor)))
        self._fns: dict = {}
        self._streams: dict = {}
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def __call__(self, name, grid, block, smem, args):
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self._mod.get_function(name)
        if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:  # above 48 KiB is an opt-in attribute
            fn.max_dynamic_shared_size_bytes = smem
        cargs = tuple(self._conv[k](v) for k, v in args)  # "t": a size-1 structured array, passed by value
        ptr = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:  # one wrapper per torch stream, not one per launch
            stream = self._streams[ptr] = self._cupy.cuda.ExternalStream(ptr, self.device.index)
        with self._cupy.cuda.Device(self.device.index), stream:
            fn(grid, block, cargs, shared_mem=smem)


@functools.cache
def _launcher(op: str, device_index: int) -> CupyLauncher:
    return CupyLauncher(op, torch.device("cuda", device_index))


def launcher(op: str, t: torch.Tensor) -> CupyLauncher:
    """The (cached) launcher of `op` on the CUDA device of tensor `t`."""
    return _launcher(op, t.device.index if t.device.index is not None else torch.cuda.current_device())
