"""The CPU C++ ops of csrc/ (TORCH_LIBRARY `lopa_fast_cpp`): the fast round's bookkeeping `round_prepare` /
`round_update` (csrc/round_cpu.cpp, the C++ twin of lopa_fast/decode/round.py), JIT-built with
torch.utils.cpp_extension.load on first use: `build()`; the fast decoder on CPU asks for them through
`round_ops()` (LOPA_FAST_CPP=0 turns that off). Nothing builds at import or install. Build: ~20-80 s on the
2-core machine (per-op ATen headers; needs ninja), cached under $LOPA_FAST_CACHE_DIR/cpp.

The earlier C++ `confidence` and `select_round` ops left the package (bench/results/cuda_cpp_ops.md): the
round's CPU bookkeeping is `round_update` (one call per round, superseding `select_round`), and its token
statistics must be bitwise the reference's torch formula, which a C++ softmax is not.
"""
from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path

import torch

from lopa_fast import logs
from lopa_fast.contracts import code_defines, round_defines
from lopa_fast.ops._backend import cache_dir

log = logging.getLogger(__name__)

_PKG = Path(__file__).resolve().parents[1]  # csrc/ ships as lopa_fast/csrc in a wheel; the repo keeps it at the top
CSRC = _PKG / "csrc" if (_PKG / "csrc").is_dir() else _PKG.parent / "csrc"
SOURCES = ("round_cpu.cpp",)


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
    compiles = not _built_before(cache)  # a cached build only loads (~0.1 s): say "building" only when it compiles
    what = (f"building the CPU round ops (csrc/{', '.join(SOURCES)}, first use; ~30 s, cached under {cache})"
            if compiles else f"loading the CPU round ops (cached under {cache})")
    with logs.step(log, what, "built the CPU round ops" if compiles else "loaded the CPU round ops", long=compiles):
        load(name="lopa_fast_cpp", sources=[str(CSRC / s) for s in SOURCES],
             extra_cflags=["-O3", "-ffp-contract=off", *codes], build_directory=str(cache), is_python_module=False,
             verbose=False)  # fmt: skip


def _built_before(cache: Path) -> bool:
    """Whether `cache` holds a build newer than every source (then `load` only loads it; a change of the compile
    flags still rebuilds, and the after-line says so by its seconds)."""
    lib = cache / "lopa_fast_cpp.so"
    if not lib.is_file():
        return False
    newest = max((p.stat().st_mtime for p in CSRC.iterdir() if p.is_file()), default=0.0)
    return lib.stat().st_mtime >= newest


def loaded() -> bool:
    return hasattr(torch.ops, "lopa_fast_cpp") and hasattr(torch.ops.lopa_fast_cpp, "round_update")


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
