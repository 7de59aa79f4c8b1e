"""CPU C++ ops of csrc/ (TORCH_LIBRARY `lopa_fast_cpp`), JIT-built with torch.utils.cpp_extension.load only
when asked: `build()` (or LOPA_FAST_CPP=1 at first use of `confidence`). Nothing builds at import or install.

Measured side by side (bench/results/cuda_cpp_confidence.md): the C++ confidence is 1.2-2.6x faster than the
vectorised torch path at the Dream vocabulary on 2 cores, so it is kept. Build: ~15-35 s (per-op ATen headers),
cached under $LOPA_FAST_CACHE_DIR/cpp.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("lopa_fast.ops.cpp")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("confidence_cpu.cpp",)


@functools.cache
def build() -> None:
    """Compile and load csrc/*.cpp (registers torch.ops.lopa_fast_cpp.*). Raises RuntimeError when the
    sources are absent (a non-editable install ships no csrc/) or the build fails."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 - heavy import, only when asked

    missing = [s for s in SOURCES if not (CSRC / s).exists()]
    if missing:
        raise RuntimeError(f"lopa_fast C++ ops: sources {missing} not found under {CSRC}")
    cache = Path(os.environ.get("LOPA_FAST_CACHE_DIR", Path.home() / ".cache" / "lopa_fast")) / "cpp"
    cache.mkdir(parents=True, exist_ok=True)
    load(name="lopa_fast_cpp", sources=[str(CSRC / s) for s in SOURCES], extra_cflags=["-O3"],
         build_directory=str(cache), is_python_module=False, verbose=False)  # fmt: skip
    log.info("lopa_fast C++ ops loaded from %s", cache)


def loaded() -> bool:
    return hasattr(torch.ops, "lopa_fast_cpp") and hasattr(torch.ops.lopa_fast_cpp, "confidence")


def wanted() -> bool:
    """LOPA_FAST_CPP=1 asks the CPU paths to build and use the C++ ops."""
    return os.environ.get("LOPA_FAST_CPP", "0") not in ("", "0")


def confidence(logits: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10):
    """lopa_fast.reference.ops.confidence on the C++ op (CPU tensors, fp32/fp16/bf16 in, fp32 out;
    fp64 runs the reference).
    Returns reference.ops.Confidence."""
    from lopa_fast.reference import ops as ref  # noqa: PLC0415

    if logits.dtype == torch.float64:  # the contract computes fp64 input in fp64; the C++ op is fp32 inside
        return ref.confidence(logits, suppress_token, eps)
    if not loaded():
        build()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.ops.lopa_fast_cpp.confidence(logits, -1 if suppress_token is None else int(suppress_token),
                                             float(eps))
    return ref.Confidence(*out)
