"""The CPU C++ ops of csrc/ (TORCH_LIBRARY `lopa_fast_cpp`): the fast round's bookkeeping `round_prepare` /
`round_update` (csrc/round_cpu.cpp, the C++ twin of lopa_fast/decode/round.py), JIT-built with
torch.utils.cpp_extension.load on first use: `build()`; the fast decoder on CPU asks for them through
`round_ops()` (LOPA_FAST_CPP=0 turns that off). Nothing builds at import or install. Build: ~20-80 s on the
2-core machine (per-op ATen headers; needs ninja), cached under $LOPA_FAST_CACHE_DIR/cpp/<hash of the sources, flags
and toolchain> (`build_dir`), behind a lock that a killed build cannot leave stale (`_build_lock`: flock, with a
timeout and an error naming it).

The earlier C++ `confidence` and `select_round` ops left the package (bench/results/cuda_cpp_ops.md): the
round's CPU bookkeeping is `round_update` (one call per round, superseding `select_round`), and its token
statistics must be bitwise the reference's torch formula, which a C++ softmax is not.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
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


LOCK_TIMEOUT_ENV = "LOPA_FAST_CPP_LOCK_TIMEOUT"  # seconds to wait for another process's build (default 600)


def _flags() -> list[str]:
    # comparator codes and round-state indices: one definition (lopa_fast.contracts)
    codes = [f"-D{k}={v}" for k, v in sorted({**code_defines(), **round_defines()}.items())]
    # -ffp-contract=off: no fused multiply-adds, so float maths rounds as torch's separate ops do
    return ["-O3", "-ffp-contract=off", *codes]


@functools.cache
def _toolchain() -> str:
    """The compiler's identity (`$CXX --version`, first line), torch's version and ABI, Python's, the machine."""
    import platform
    import subprocess
    import sys

    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        compiler = out[0] if out else cxx
    except (OSError, subprocess.SubprocessError):
        compiler = cxx
    return (f"{compiler}|torch {torch.__version__} cxx11abi={torch._C._GLIBCXX_USE_CXX11_ABI}|"
            f"python {sys.version_info[:2]}|{platform.machine()}")  # fmt: skip


def build_dir() -> Path:
    """The build's cache directory: $LOPA_FAST_CACHE_DIR/cpp/<key>, the key a hash of the sources, the flags and
    the toolchain, so checkouts, installed copies and compilers never share (or overwrite) one build."""
    h = hashlib.sha256()
    for src in sorted(p for p in CSRC.iterdir() if p.is_file()):
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update(" ".join(_flags()).encode() + b"\0" + _toolchain().encode())
    d = cache_dir("cpp") / h.hexdigest()[:16]
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def _build_lock(d: Path, timeout: float):
    """An exclusive flock on d/build.flock (the kernel drops it when its holder dies: a killed build never leaves
    a stale lock behind), waited for at most `timeout` seconds, then RuntimeError naming the lock. Held, it also
    removes torch's own `lock` file, which only a dead build can have left (torch's FileBaton waits forever on it)."""
    import fcntl
    import time

    path = d / "build.flock"
    with open(path, "a+b") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"lopa_fast C++ ops: another process has been building them in {d} for over "
                                       f"{timeout:g} s (it holds {path}); wait for it, or set {LOCK_TIMEOUT_ENV} "
                                       "higher, or LOPA_FAST_CPP=0 to skip the build") from None  # fmt: skip
                time.sleep(0.2)
        try:
            stale = d / "lock"
            if stale.exists():
                log.warning("removing a stale build lock %s (left by a killed build)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@functools.cache
def build() -> None:
    """Compile and load csrc/*.cpp (registers torch.ops.lopa_fast_cpp.*). Raises RuntimeError when the
    sources are absent, the build fails, or another process's build holds the lock past
    $LOPA_FAST_CPP_LOCK_TIMEOUT seconds (default 600)."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 - heavy import, only when asked

    missing = [s for s in SOURCES if not (CSRC / s).exists()]
    if missing:
        raise RuntimeError(f"lopa_fast C++ ops: sources {missing} not found under {CSRC}")
    try:
        timeout = float(os.environ.get(LOCK_TIMEOUT_ENV, "600"))
    except ValueError:
        raise RuntimeError(f"{LOCK_TIMEOUT_ENV}={os.environ[LOCK_TIMEOUT_ENV]!r}; expected seconds") from None
    cache = build_dir()
    with _build_lock(cache, timeout):
        compiles = not _built_before(cache)  # a cached build only loads (~0.1 s): say "building" only when it compiles
        what = (f"building the CPU round ops (csrc/{', '.join(SOURCES)}, first use; ~30 s, cached under {cache})"
                if compiles else f"loading the CPU round ops (cached under {cache})")
        with logs.step(log, what, "built the CPU round ops" if compiles else "loaded the CPU round ops",
                       long=compiles):  # fmt: skip
            load(name="lopa_fast_cpp", sources=[str(CSRC / s) for s in SOURCES], extra_cflags=_flags(),
                 build_directory=str(cache), is_python_module=False, verbose=False)  # fmt: skip


def _built_before(cache: Path) -> bool:
    """Whether `cache` (keyed by the sources' hash: build_dir) holds a finished build (then `load` only loads it)."""
    return (cache / "lopa_fast_cpp.so").is_file()


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
