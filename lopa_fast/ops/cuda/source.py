"""kernels/cuda/*.cu sources, their NVRTC compile and the on-disk cubin cache.

On the first call of an op its .cu is compiled by NVRTC (through CuPy) for the device's sm_XY with the
defines of lopa_fast.ops.cuda.constants, and the cubin is cached under $LOPA_FAST_CACHE_DIR/cuda (default
~/.cache/lopa_fast/cuda), keyed by a hash of the exact source text, headers, options and NVRTC version.
Nothing is compiled at install time: a torch-header CUDA build costs minutes of GPU-machine time.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from lopa_fast.ops.cuda.cache_dir import cache_dir
from lopa_fast.kernels import CUDA_DIR
from lopa_fast.ops.cuda.constants import DTYPE_NAMES, HEAD_DIMS, OPS, define_flags

log = logging.getLogger("lopa_fast.ops.cuda")

KERNEL_DIR = CUDA_DIR  # kernels/cuda at the repository root, lopa_fast/kernels/cuda in a wheel

HEADERS = ("common.cuh", "vocab_stats.cuh")


def kernel_source(op: str) -> tuple[str, dict[str, str]]:
    """(source text of kernels/cuda/<op>.cu, {header name: text}) exactly as NVRTC receives them."""
    if op not in OPS:
        raise ValueError(f"kernel_source: op={op!r}; allowed: {OPS}")
    src = (KERNEL_DIR / f"{op}.cu").read_text()
    return src, {h: (KERNEL_DIR / h).read_text() for h in HEADERS}


def nvrtc_options(arch: int) -> list[str]:
    """NVRTC options for compute capability `arch` (90 = sm_90). No fast-math: parity with the fp32
    reference needs IEEE expf/logf (the kernels use exp2f on pre-scaled scores where speed matters)."""
    return [f"-arch=sm_{arch}", "-std=c++17", "-lineinfo", *define_flags()]


def entry_names(op: str) -> list[str]:
    """The extern "C" entry points of <op>.cu the launchers call."""
    if op == "branch_attention":
        return [
            f"branch_attention_{part}_{t}_d{d}"
            for part in ("partial", "pooled_partial", "combine")
            for t in DTYPE_NAMES.values()
            for d in HEAD_DIMS
        ]
    if op == "head_confidence":
        return [f"head_confidence_{p}_{t}" for p in ("stats", "entropy") for t in DTYPE_NAMES.values()] + [
            "head_confidence_merge", "head_confidence_finalize"]
    if op == "select_round":
        return ["select_round_kernel"]
    parts = ("", "_split_stats", "_split_entropy")
    return [f"confidence{p}_{t}" for p in parts for t in DTYPE_NAMES.values()] + ["confidence_split_finalize"]


def nvrtc():
    """cupy's NVRTC bindings (ImportError without cupy)."""
    from cupy.cuda import nvrtc as _nvrtc  # noqa: PLC0415 - optional dependency

    return _nvrtc


def compile_cubin(op: str, arch: int) -> bytes:
    """Compile kernels/cuda/<op>.cu with NVRTC for sm_<arch>; needs cupy + the NVRTC library, no device.
    Raises RuntimeError with NVRTC's log on a compile error."""
    lib = nvrtc()
    src, headers = kernel_source(op)
    prog = lib.createProgram(src, f"{op}.cu", [h.encode() for h in headers.values()], [n.encode() for n in headers])
    try:
        try:
            lib.compileProgram(prog, nvrtc_options(arch))
        except Exception as e:  # noqa: BLE001 - NVRTCError; re-raised with the compiler's log
            raise RuntimeError(f"NVRTC failed on {op}.cu for sm_{arch}: {e}\n{lib.getProgramLog(prog)}") from e
        warnings = lib.getProgramLog(prog).strip()
        if warnings:
            log.warning("NVRTC warnings for %s.cu: %s", op, warnings)
        return lib.getCUBIN(prog)
    finally:
        lib.destroyProgram(prog)


def cached_cubin(op: str, arch: int) -> Path:
    """Path of the cubin for (op, arch), compiling it on a cache miss (key: source + headers + options)."""
    src, headers = kernel_source(op)
    key = hashlib.sha256(
        "\0".join([src, *headers.values(), *nvrtc_options(arch), str(nvrtc().getVersion())]).encode()
    ).hexdigest()[:20]
    path = cache_dir("cuda") / f"{op}_sm{arch}_{key}.cubin"
    if not path.exists():
        cubin = compile_cubin(op, arch)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        tmp.replace(path)  # atomic: concurrent processes never read a half-written cubin
    return path
