"""How a CUDA host-emulation library is built: its translation unit, flags and source key, and where the install
puts the built ones.

One shared library per op: kernels/cuda/<op>.cu compiled by the host C++ compiler against host_emu.cuh
(lopa_fast.ops.cuda.emulation drives it through ctypes). setup.py builds all of them once, at install, into
lopa_fast/_emu/ (`build_all`; a soft failure: the emulation then compiles at first use into the cache, as
before). Each library exports `emu_source_key()`: the hash of everything it was compiled from except the compiler
(source, headers, defines, flags), so a library built from an older .cu is never loaded (an edited kernel in an
editable install falls back to the cache build until the next install).
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from lopa_fast.ops.cuda.constants import OPS, define_flags
from lopa_fast.ops.cuda.source import KERNEL_DIR, entry_names, kernel_source

# -O1: the emulation runs one std::thread per CUDA thread; higher levels only lengthen the build. -std=c++20 (not
# gnu++20): <barrier>, _Float16, and no FMA contraction (ISO mode implies -ffp-contract=off), so floats round as
# on the GPU without fast-math
FLAGS = ("-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w")
INSTALL_SUBDIR = "_emu"  # under the lopa_fast package directory


def flags() -> list[str]:
    return [*FLAGS, *define_flags()]


def unit(op: str) -> tuple[str, str]:
    """(translation unit text, source key) of op's emulation library; the text ends with the key's export."""
    src, headers = kernel_source(op)
    body = f'#include "{op}.cu"\n' + "".join(f"LOPA_EMU_EXPORT({e})\n" for e in entry_names(op))
    emu_text = (KERNEL_DIR / "host_emu.cuh").read_text()
    key = hashlib.sha256("\0".join([*flags(), body, src, emu_text, *headers.values()]).encode()).hexdigest()[:20]
    return body + f'extern "C" const char* emu_source_key() {{ return "{key}"; }}\n', key


def compile_lib(op: str, cxx: str, out: Path, tmp: Path) -> None:
    """Compile op's emulation library to `out` with compiler `cxx` (tmp: a scratch directory). Raises RuntimeError
    with the compiler's output on failure."""
    text, _ = unit(op)
    cpp = tmp / f"emu_{op}.cpp"
    cpp.write_text(text)
    cmd = [cxx, *flags(), f"-I{KERNEL_DIR}", str(cpp), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"host build of {op}.cu failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")


def lib_name(op: str) -> str:
    return f"emu_{op}.so"


def installed_path(op: str) -> Path:
    """Where the install put op's library (it may be absent, or stale: check its emu_source_key)."""
    return Path(__file__).resolve().parents[2] / INSTALL_SUBDIR / lib_name(op)


def build_all(package_dir: Path, cxx: str, tmp: Path) -> list[str]:
    """setup.py's step: every op's library into package_dir/_emu/ (package_dir: the built lopa_fast package).
    Returns the ops built; raises on the first failure (setup.py reports it and installs without them)."""
    out_dir = package_dir / INSTALL_SUBDIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for op in OPS:
        compile_lib(op, cxx, out_dir / lib_name(op), tmp)
    return list(OPS)
