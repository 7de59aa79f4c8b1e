"""Host emulation of the CUDA kernels, for tests on machines without a GPU.

The exact .cu source is compiled by the host C++ compiler against kernels/cuda/host_emu.cuh (one std::thread
per CUDA thread, warp shuffles and mma fragments exchanged between barriers, misaligned vector accesses
counted) into a shared library, cached on disk by source hash, and driven through the same launch code as the
GPU (lopa_fast.ops.cuda.launch). It checks index arithmetic, masks and reductions; it is slow.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from lopa_fast.cache import cache_dir
from lopa_fast.ops.cuda.constants import OPS, define_flags
from lopa_fast.ops.cuda.launch import run_branch_attention, run_confidence, run_head_confidence, run_select_round
from lopa_fast.ops.cuda.source import KERNEL_DIR, entry_names, kernel_source
from lopa_fast.sampling import Confidence, HeadConfidence

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

    def head_confidence(self, hidden, weight, suppress_token=None, eps=1e-10, entropy=True):
        L = self._l["head_confidence"]
        out = run_head_confidence(L, hidden, weight, suppress_token, eps, entropy, L.num_sms)
        return HeadConfidence(*out[:3], out[3] if entropy else None, *out[4:])

    def select_round(self, *args, bs, mask_id, eos_id, n_look, shift, blend, score_all):
        """ops.select_round's arguments (checked) -> the SelectRound fields (a list of fresh tensors)."""
        from lopa_fast.ops.select_round_outputs import outputs as _outputs  # noqa: PLC0415 - the op's one output layout

        outs = _outputs(args, split=False)
        ins = [t.contiguous() for t in args]
        run_select_round(self._l["select_round"], ins, outs, bs, mask_id, eos_id, n_look, shift, blend, score_all)
        return outs


def host_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def emulator(ops: tuple[str, ...] = OPS) -> Emulated:
    """Build (once per process, cached on disk by source hash) the host emulation of `ops`. Needs g++ >= 12
    (C++20 <barrier>, _Float16). Raises RuntimeError with the compiler output on failure."""
    cxx = host_compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++/clang++) for the CUDA emulation")
    libs = {}
    emu_text = (KERNEL_DIR / "host_emu.cuh").read_text()
    flags = ["-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w", *define_flags()]
    for op in ops:
        src, headers = kernel_source(op)
        body = f'#include "{op}.cu"\n' + "".join(f"LOPA_EMU_EXPORT({e})\n" for e in entry_names(op))
        key = hashlib.sha256("\0".join([cxx, *flags, body, src, emu_text, *headers.values()]).encode()).hexdigest()
        so = cache_dir("cuda") / f"emu_{op}_{key[:20]}.so"
        if not so.exists():
            with tempfile.TemporaryDirectory() as tmp:
                cpp = Path(tmp) / f"emu_{op}.cpp"
                cpp.write_text(body)
                out = Path(tmp) / so.name
                cmd = [cxx, *flags, f"-I{KERNEL_DIR}", str(cpp), "-o", str(out)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"host build of {op}.cu failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
                shutil.move(str(out), so)
        libs[op] = ctypes.CDLL(str(so))
    return Emulated(libs)
