"""CPU C++ ops of csrc/ (`confidence`, `select_round`, and the fast round's bookkeeping `round_prepare` /
`round_update`; TORCH_LIBRARY `lopa_fast_cpp`), JIT-built with torch.utils.cpp_extension.load on first use:
`build()`; the fast decoder on CPU asks for them through `round_ops()` (LOPA_FAST_CPP=0 turns that off).
Nothing builds at import or install.

Measured side by side (bench/results/cuda_cpp_ops.md), 2-core CPU: confidence 1.2-2.1x faster than the torch
path at the Dream vocabulary, select_round 11-16x (against single-threaded torch; far more against 2 threads
on a loaded machine), so both are kept. Build: ~15-35 s (per-op ATen headers; needs ninja), cached under
$LOPA_FAST_CACHE_DIR/cpp.
"""
from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path

import torch

from lopa_fast.contracts import COMPARATOR_CODES, Confidence, RoundSelection, code_defines, round_defines
from lopa_fast.ops._backend import cache_dir

log = logging.getLogger("lopa_fast.ops.cpp")

_PKG = Path(__file__).resolve().parents[1]  # csrc/ ships as lopa_fast/csrc in a wheel; the repo keeps it at the top
CSRC = _PKG / "csrc" if (_PKG / "csrc").is_dir() else _PKG.parent / "csrc"
SOURCES = ("confidence_cpu.cpp", "select_round_cpu.cpp", "round_cpu.cpp")


@functools.cache
def build() -> None:
    """Compile and load csrc/*.cpp (registers torch.ops.lopa_fast_cpp.*). Raises RuntimeError when the
    sources are absent or the build fails."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 - heavy import, only when asked

    missing = [s for s in SOURCES if not (CSRC / s).exists()]
    if missing:
        raise RuntimeError(f"lopa_fast C++ ops: sources {missing} not found under {CSRC}")
    cache = cache_dir("cpp")
    # comparator codes and round-state indices: one definition (lopa_fast.contracts)
    codes = [f"-D{k}={v}" for k, v in sorted({**code_defines(), **round_defines()}.items())]
    # -ffp-contract=off: no fused multiply-adds, so float maths rounds as torch's separate ops do
    load(name="lopa_fast_cpp", sources=[str(CSRC / s) for s in SOURCES], extra_cflags=["-O3", "-ffp-contract=off", *codes],
         build_directory=str(cache), is_python_module=False, verbose=False)  # fmt: skip
    log.info("lopa_fast C++ ops loaded from %s", cache)


def loaded() -> bool:
    return hasattr(torch.ops, "lopa_fast_cpp") and hasattr(torch.ops.lopa_fast_cpp, "select_round")


def wanted() -> bool:
    """Whether the CPU paths may build and use the C++ ops: yes unless LOPA_FAST_CPP=0."""
    return os.environ.get("LOPA_FAST_CPP", "1") != "0"


def round_ops() -> bool:
    """Whether the fast round's C++ CPU bookkeeping (`round_prepare` / `round_update`, csrc/round_cpu.cpp) is
    used: unless LOPA_FAST_CPP=0 (read per request), built on first use (~20-80 s once, then cached under
    $LOPA_FAST_CACHE_DIR/cpp). A failed build (no C++ compiler or ninja) warns once and the round keeps its
    torch bookkeeping."""
    return wanted() and _round_ops_built()


@functools.cache
def _round_ops_built() -> bool:
    try:
        if not loaded():
            build()
    except Exception as e:  # noqa: BLE001 - any build failure: fall back to the torch round, said once
        warnings.warn(f"lopa_fast: the C++ CPU round ops could not be built ({type(e).__name__}: {e}); the fast "
                      "round keeps its torch bookkeeping (slower on CPU). Set LOPA_FAST_CPP=0 to skip the build.",
                      RuntimeWarning, stacklevel=3)  # fmt: skip
        return False
    return hasattr(torch.ops.lopa_fast_cpp, "round_update")


def confidence(logits: torch.Tensor, suppress_token: int | None = None, eps: float = 1e-10):
    """lopa_fast.reference.ops.confidence on the C++ op (CPU tensors, fp32/fp16/bf16 in, fp32 out;
    fp64 runs the reference). Returns lopa_fast.contracts.Confidence."""
    from lopa_fast.reference import ops as ref  # noqa: PLC0415 - the fp64 contract

    if logits.dtype == torch.float64:  # the contract computes fp64 input in fp64; the C++ op is fp32 inside
        return ref.confidence(logits, suppress_token, eps)
    if not loaded():
        build()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.ops.lopa_fast_cpp.confidence(logits, -1 if suppress_token is None else int(suppress_token),
                                             float(eps))
    return Confidence(*out)


def select_round(accept_value, conf, masked, block_ids, block_complete, tau, comparator="gt", n_look=0, topp=1.0,
                 alpha=0.0, creation_conf=None, branch_active=None):
    """lopa_fast.reference.ops.select_round on the C++ op (CPU tensors); returns lopa_fast.contracts.RoundSelection.
    fp64 conf runs the reference (the contract computes it in fp64)."""
    from lopa_fast.reference import ops as ref  # noqa: PLC0415 - the fp64 contract

    args = (accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp, alpha,
            creation_conf, branch_active)
    if conf.dtype == torch.float64:
        return ref.select_round(*args)
    if not loaded():
        build()
    f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
    b8 = lambda t: None if t is None else t.to(torch.bool).contiguous()  # noqa: E731
    out = torch.ops.lopa_fast_cpp.select_round(
        f32(accept_value), f32(conf), b8(masked), block_ids.to(torch.int64).contiguous(), b8(block_complete),
        float(tau), COMPARATOR_CODES[comparator], int(n_look), float(topp), float(alpha), f32(creation_conf),
        b8(branch_active))
    return RoundSelection(*out)
