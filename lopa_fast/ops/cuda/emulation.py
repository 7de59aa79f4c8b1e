"""Host emulation of the CUDA kernels, for tests on machines without a GPU.

The exact .cu source is compiled by the host C++ compiler against kernels/cuda/host_emu.cuh (one std::thread
per CUDA thread, warp shuffles and mma fragments exchanged between barriers, misaligned vector accesses
counted) into a shared library (built at install by setup.py, else at first use into a cache by source hash:
lopa_fast.ops.cuda.emu_build), and driven through the same launch code as the
GPU (lopa_fast.ops.cuda.launch). It checks index arithmetic, masks and reductions; it is slow.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from lopa_fast.ops.cuda.cache_dir import cache_dir
from lopa_fast.ops.cuda import emu_build
from lopa_fast.ops.cuda.constants import OPS
from lopa_fast.ops.cuda.launch import run_branch_attention, run_confidence, run_head_confidence, run_select_round
from lopa_fast.sampling import Confidence

# "t": the pointers as one by-value struct { long long p[n]; } (same bytes as an array of n int64)
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float,
           "t": lambda v: (ctypes.c_int64 * len(v))(*v)}


class EmuLauncher:
    """A `launch.Launch` over the entry points of one host-compiled .cu library (CPU tensors)."""

    num_sms = 4  # small, so the split paths run on tiny shapes

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        lib.emu_misaligned_take.restype = ctypes.c_long

    def __call__(self, name, grid, block, smem, args):
        vals = [_CTYPES[k](v) for k, v in args]
        argv = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        dims = (ctypes.c_uint * 6)(*grid, *block)
        getattr(self._lib, f"emu_launch_{name}")(dims, ctypes.c_size_t(smem), argv)
        bad = self._lib.emu_misaligned_take()
        if bad:  # a fault on the GPU; silent on the CPU, so the emulation counts them (common.cuh: vptr)
            raise RuntimeError(f"{name}: {bad} misaligned vector accesses (grid {grid}, block {block})")


class Emulated:
    """The CUDA ops on CPU tensors, with the public ops' signatures (inputs already checked)."""

    def __init__(self, libs: dict[str, ctypes.CDLL]):
        self._l = {op: EmuLauncher(lib) for op, lib in libs.items()}

    def branch_attention(self, q, k_cache, v_cache, cache_len, k_win, v_win, win_lens=None, block_ids=None,
                         mode="full", scale=None, return_lse=False, *, cache_index=None):
        L = self._l["branch_attention"]
        o, lse = run_branch_attention(L, L.num_sms, q, k_cache, v_cache, cache_len, k_win, v_win, win_lens,
                                      block_ids, mode, scale, cache_index)
        return (o, lse) if return_lse else o

    def confidence(self, logits, suppress_token=None, eps=1e-10, split=True):
        """split=False: one CTA per row whatever N (the GPU picks by N; here both paths are testable)."""
        L = self._l["confidence"]
        return Confidence(*run_confidence(L, logits, suppress_token, eps, L.num_sms if split else None))

    def head_confidence(self, hidden, weight, suppress_token=None, eps=1e-10, entropy=True, keep_logits=False):
        L = self._l["head_confidence"]
        out = run_head_confidence(L, hidden, weight, suppress_token, eps, entropy, L.num_sms, keep_logits)
        return out if entropy else out._replace(neg_entropy=None)

    def select_round(self, *args, bs, mask_id, eos_id, n_look, shift, blend, score_all):
        """ops.select_round's arguments (checked) -> the SelectRound fields (a list of fresh tensors)."""
        from lopa_fast.ops.select_round_outputs import outputs as _outputs  # noqa: PLC0415 - the op's one output layout

        outs = _outputs(args, split=False)
        ins = [t.contiguous() for t in args]
        run_select_round(self._l["select_round"], ins, outs, bs, mask_id, eos_id, n_look, shift, blend, score_all)
        return outs


def host_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def _installed(op: str, key: str) -> ctypes.CDLL | None:
    """op's library as setup.py built it, if present and built from this very source (its emu_source_key)."""
    path = emu_build.installed_path(op)
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    fn = getattr(lib, "emu_source_key", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return lib if fn().decode() == key else None


def _cached(op: str, key: str) -> ctypes.CDLL:
    """op's library from the on-disk cache, compiled on a miss (key: the source key and the compiler)."""
    cxx = host_compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++/clang++) for the CUDA emulation, and no library built at "
                           "install for this source")
    digest = hashlib.sha256(f"{cxx}\0{key}".encode()).hexdigest()[:20]
    so = cache_dir("cuda") / f"emu_{op}_{digest}.so"
    if not so.exists():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / so.name
            emu_build.compile_lib(op, cxx, out, Path(tmp))
            shutil.move(str(out), so)
    return ctypes.CDLL(str(so))


@functools.cache
def emulator(ops: tuple[str, ...] = OPS) -> Emulated:
    """The host emulation of `ops`: the libraries setup.py built at install (lopa_fast/_emu/) when they match the
    current source, else built once per source into the on-disk cache (needs g++ >= 12: C++20 <barrier>, _Float16).
    Raises RuntimeError with the compiler output on failure."""
    libs = {}
    for op in ops:
        key = emu_build.unit(op)[1]
        libs[op] = _installed(op, key) or _cached(op, key)
    return Emulated(libs)
