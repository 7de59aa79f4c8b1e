"""Can the CUDA kernels run here? Computed once per process, the reason logged once."""
from __future__ import annotations

import functools
import logging
import os

import torch

from lopa_fast.ops.cuda.constants import OPS
from lopa_fast.ops.cuda.source import nvrtc

log = logging.getLogger("lopa_fast.ops.cuda")


@functools.cache
def probe() -> str | None:
    """None when the CUDA path can run, else the reason (computed once, logged once at INFO)."""
    reason = None
    if os.environ.get("LOPA_FAST_DISABLE_CUDA", "0") not in ("", "0"):
        reason = "disabled by LOPA_FAST_DISABLE_CUDA"
    elif not torch.cuda.is_available():
        reason = f"torch.cuda.is_available() is False (torch {torch.__version__}, no CUDA device or a CPU build)"
    else:
        try:
            import cupy  # noqa: PLC0415

            cupy.cuda.runtime.getDeviceCount()
            nvrtc().getVersion()
        except Exception as e:  # noqa: BLE001 - ImportError, missing libnvrtc, driver mismatch, ...
            reason = f"cupy/NVRTC unusable ({type(e).__name__}: {e}); install cupy-cuda13x (or the build for this CUDA)"
    if reason is not None:
        log.info("CUDA kernels unavailable: %s; ops fall back to triton/torch", reason)
    return reason


def available(op: str | None = None) -> bool:
    """True when the CUDA kernels can run here (and `op`, if given, has one)."""
    return (op is None or op in OPS) and probe() is None


def why_unavailable() -> str | None:
    """The reason `available()` is False, or None."""
    return probe()
