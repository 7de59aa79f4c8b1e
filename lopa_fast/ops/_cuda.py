"""CUDA kernels of `kernels/cuda/*.cu`: compiled at first use with NVRTC (through CuPy), launched on torch tensors.

The hook of lopa_fast.ops._backend: `available(op)` and one function per op with the public op's signature
(`branch_attention`, `confidence`, `select_round`). Nothing is compiled at install time (a torch-header CUDA
build costs minutes of GPU time): on the first call the op's .cu source is compiled by NVRTC for the device's
sm_XY, the cubin cached under $LOPA_FAST_CACHE_DIR (default ~/.cache/lopa_fast/cuda) keyed by a hash of the
exact source text and options, loaded with cupy.RawModule and launched on the tensors' data pointers on
torch's current stream. Without a CUDA device or CuPy, `available()` is False and `why_unavailable()` says
why (logged once at INFO on logger "lopa_fast.ops.cuda"); the dispatch then picks triton / torch.

The GPU entry points are also registered as torch custom ops (`lopa_fast::cuda_branch_attention`,
`lopa_fast::cuda_confidence`, `lopa_fast::cuda_select_round`) with fake implementations, so a
torch.compile'd / CUDA-graph-captured round treats them as opaque ops.

The same launch code runs on CPU tensors through `emulator()`: the .cu compiled by the host C++ compiler
against kernels/cuda/host_emu.cuh (one std::thread per CUDA thread). That is how CI checks the kernels'
index arithmetic, masks and reductions without a GPU; it is slow and for tests only.
"""

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from lopa_fast.reference import ops as ref

log = logging.getLogger("lopa_fast.ops.cuda")

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"
if not (KERNEL_DIR / "common.cuh").exists():  # installed (non-editable): lopa_fast/kernels/cuda
    import lopa_fast.kernels as _k

    KERNEL_DIR = Path(_k.__file__).resolve().parent / "cuda"

OPS = ("branch_attention", "confidence", "select_round")
HEADERS = ("common.cuh",)
HEAD_DIMS = (64, 128)
_DTYPE_NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
MODES = {"full": 0, "block_causal": 1, "causal": 2}

# Tile constants shared with branch_attention.cu: attn:: (SIMT, fp32) kRows, kKeys, kThreads, kWarps,
# kRowsPerWarp; attn::mma:: (tensor cores, bf16/fp16) 64 rows and 64 keys per CTA, V staged transposed.
ATTN_ROWS, ATTN_KEYS, ATTN_THREADS, ATTN_WARPS, ATTN_ROWS_PER_WARP = 32, 32, 128, 4, 8
MMA_ROWS, MMA_KEYS = 64, 64
CONF_THREADS = 256
SEL_MAX_WARPS, SEL_MAX_N = 8, 1024  # select_round.cu: kMaxWarps; a 32-bit pick mask per lane
COMPARATORS = {"gt": 0, "ge": 1, "le": 2}


# ---------------------------------------------------------------------------------------------- sources
def kernel_source(op: str) -> tuple[str, dict[str, str]]:
    """(source text of kernels/cuda/<op>.cu, {header name: text}) exactly as NVRTC receives them."""
    if op not in OPS:
        raise ValueError(f"kernel_source: op={op!r}; allowed: {OPS}")
    src = (KERNEL_DIR / f"{op}.cu").read_text()
    return src, {h: (KERNEL_DIR / h).read_text() for h in HEADERS}


def nvrtc_options(arch: int) -> list[str]:
    """NVRTC options for compute capability `arch` (90 = sm_90). No fast-math: parity with the fp32
    reference needs IEEE expf/logf (the kernels use exp2f on pre-scaled scores where speed matters)."""
    return [f"-arch=sm_{arch}", "-std=c++17", "-lineinfo"]


def entry_names(op: str) -> list[str]:
    if op == "branch_attention":
        return [
            f"branch_attention_{part}_{t}_d{d}"
            for part in ("partial", "combine")
            for t in _DTYPE_NAME.values()
            for d in HEAD_DIMS
        ]
    if op == "select_round":
        return ["select_round_f32"]
    parts = ("", "_split_stats", "_split_entropy")
    return [f"confidence{p}_{t}" for p in parts for t in _DTYPE_NAME.values()] + ["confidence_split_finalize"]


def _nvrtc():
    from cupy.cuda import nvrtc  # noqa: PLC0415 - optional dependency

    return nvrtc


def compile_cubin(op: str, arch: int) -> bytes:
    """Compile kernels/cuda/<op>.cu with NVRTC for sm_<arch>; needs cupy + the NVRTC library, no device.
    Raises RuntimeError with NVRTC's log on a compile error."""
    nvrtc = _nvrtc()
    src, headers = kernel_source(op)
    prog = nvrtc.createProgram(src, f"{op}.cu", [h.encode() for h in headers.values()], [n.encode() for n in headers])
    try:
        try:
            nvrtc.compileProgram(prog, nvrtc_options(arch))
        except Exception as e:  # noqa: BLE001 - NVRTCError; re-raised with the compiler's log
            raise RuntimeError(f"NVRTC failed on {op}.cu for sm_{arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        warnings = nvrtc.getProgramLog(prog).strip()
        if warnings:
            log.warning("NVRTC warnings for %s.cu: %s", op, warnings)
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _cache_dir() -> Path:
    d = Path(os.environ.get("LOPA_FAST_CACHE_DIR", Path.home() / ".cache" / "lopa_fast")) / "cuda"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_cubin(op: str, arch: int) -> Path:
    """Path of the cubin for (op, arch), compiling it on a cache miss (key: source + headers + options)."""
    src, headers = kernel_source(op)
    key = hashlib.sha256(
        "\0".join([src, *headers.values(), *nvrtc_options(arch), str(_nvrtc().getVersion())]).encode()
    ).hexdigest()[:20]
    path = _cache_dir() / f"{op}_sm{arch}_{key}.cubin"
    if not path.exists():
        cubin = compile_cubin(op, arch)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        tmp.replace(path)  # atomic: concurrent processes never read a half-written cubin
    return path


# --------------------------------------------------------------------------------------- availability
@functools.cache
def _probe() -> str | None:
    """None when the CUDA path can run, else the reason (computed once, logged once)."""
    reason = None
    if os.environ.get("LOPA_FAST_DISABLE_CUDA", "0") not in ("", "0"):
        reason = "disabled by LOPA_FAST_DISABLE_CUDA"
    elif not torch.cuda.is_available():
        reason = f"torch.cuda.is_available() is False (torch {torch.__version__}, no CUDA device or a CPU build)"
    else:
        try:
            import cupy  # noqa: PLC0415

            cupy.cuda.runtime.getDeviceCount()
            _nvrtc().getVersion()
        except Exception as e:  # noqa: BLE001 - ImportError, missing libnvrtc, driver mismatch, ...
            reason = f"cupy/NVRTC unusable ({type(e).__name__}: {e}); install cupy-cuda13x (or the build for this CUDA)"
    if reason is not None:
        log.info("CUDA kernels unavailable: %s; ops fall back to triton/torch", reason)
    return reason


def available(op: str | None = None) -> bool:
    """True when the CUDA kernels can run here (and `op`, if given, has one)."""
    return (op is None or op in OPS) and _probe() is None


def why_unavailable() -> str | None:
    """The reason `available()` is False, or None."""
    return _probe()


# --------------------------------------------------------------------------------------------- launchers
# A launch is (entry name, grid, block, dynamic smem bytes, args); each arg is (kind, value) with kind
# "p" pointer, "i" int32, "q" int64, "f" float32 - the C types of the extern "C" entry points.
Launch = Callable[[str, tuple, tuple, int, list], None]


class _CupyLauncher:
    """Launches on the current torch stream of the tensors' device through cupy.RawModule."""

    def __init__(self, op: str, device: torch.device):
        import cupy  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415

        self._cupy, self._np = cupy, np
        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        with cupy.cuda.Device(device.index):
            self._mod = cupy.RawModule(path=str(cached_cubin(op, major * 10 + minor)))
        self._fns: dict = {}
        self._streams: dict = {}
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def __call__(self, name, grid, block, smem, args):
        np = self._np
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self._mod.get_function(name)
        if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
        conv = {"p": np.uint64, "i": np.int32, "q": np.int64, "f": np.float32}
        cargs = tuple(conv[k](v) for k, v in args)
        ptr = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:  # one wrapper per torch stream, not one per launch
            stream = self._streams[ptr] = self._cupy.cuda.ExternalStream(ptr, self.device.index)
        with self._cupy.cuda.Device(self.device.index), stream:
            fn(grid, block, cargs, shared_mem=smem)


@functools.cache
def _launcher(op: str, device_index: int) -> _CupyLauncher:
    return _CupyLauncher(op, torch.device("cuda", device_index))


class _EmuLauncher:
    """Runs the entry points of a host-compiled build of the .cu (see `emulator()`) on CPU tensors."""

    num_sms = 4

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        lib.emu_misaligned_take.restype = ctypes.c_long

    def __call__(self, name, grid, block, smem, args):
        ctor = {"p": ctypes.c_void_p, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float}
        vals = [ctor[k](v) for k, v in args]
        argv = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        dims = (ctypes.c_uint * 6)(*grid, *block)
        getattr(self._lib, f"emu_launch_{name}")(dims, ctypes.c_size_t(smem), argv)
        bad = self._lib.emu_misaligned_take()
        if bad:  # a fault on the GPU; silent on the CPU, so the emulation counts them (common.cuh: vptr)
            raise RuntimeError(f"{name}: {bad} misaligned vector accesses (grid {grid}, block {block})")


# ------------------------------------------------------------------------------------- branch_attention
def attention_rows(dtype: torch.dtype) -> int:
    """Query rows per CTA of branch_attention_partial for `dtype`."""
    return ATTN_ROWS if dtype == torch.float32 else MMA_ROWS


def attention_smem_bytes(dtype: torch.dtype, D: int) -> int:
    """Dynamic shared memory of branch_attention_partial (mirror of attn::Smem / attn::mma::Smem in the .cu)."""
    if dtype != torch.float32:  # K [64][D + 8] + V^T [D][64 + 8], 16-bit
        return MMA_KEYS * (D + 8) * 2 + D * (MMA_KEYS + 8) * 2
    es = torch.empty((), dtype=dtype).element_size()
    return (
        ATTN_ROWS * D * 4
        + ATTN_KEYS * (D + 16 // es) * es
        + ATTN_KEYS * D * es
        + ATTN_WARPS * ATTN_ROWS_PER_WARP * ATTN_KEYS * 4
    )


def attention_splits(B: int, n: int, Hq: int, Hkv: int, cache_len: int, num_sms: int,
                     rows: int = ATTN_ROWS) -> tuple[int, int]:
    """(prefix splits S, keys per split, a multiple of 64). Enough CTAs for ~2 per SM, no split under 128 keys.
    `rows`: query rows per CTA (attention_rows(dtype))."""
    if cache_len == 0:
        return 0, MMA_KEYS
    tiles = math.ceil(B * n * (Hq // Hkv) / rows) * Hkv
    s = max(1, min(math.ceil(2 * num_sms / tiles), math.ceil(cache_len / 128)))
    split_len = math.ceil(math.ceil(cache_len / s) / MMA_KEYS) * MMA_KEYS
    return math.ceil(cache_len / split_len), split_len


def _aligned(t: torch.Tensor, vec: int) -> torch.Tensor:
    """t with a contiguous last dim, 16-byte aligned base and every other stride a multiple of `vec`."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % vec == 0 for s in t.stride()[:-1])
    return t if ok else t.contiguous()


def _pair(a: torch.Tensor, b: torch.Tensor, vec: int) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _aligned(a, vec), _aligned(b, vec)
    if a.stride() != b.stride():  # the kernel indexes K and V with one set of strides
        a, b = a.contiguous(), b.contiguous()
    return a, b


def run_branch_attention(launch, num_sms, q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids,
                         mode, scale, return_lse):
    """Launch branch_attention on any launcher; returns (o [B, n, Hq, D], lse [B, n, Hq] fp32)."""
    B, n, Hq, D = q.shape
    Hkv = k_win.shape[2]
    G = Hq // Hkv
    tname = _DTYPE_NAME[q.dtype]
    vec = 16 // q.element_size()
    cache_len = int(cache_len)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q = _aligned(q, vec)
    k_cache, v_cache = _pair(k_cache, v_cache, vec)
    k_win, v_win = _pair(k_win, v_win, vec)
    wl = None if win_lens is None else win_lens.to(device=q.device, dtype=torch.int64).contiguous()
    bid = None
    if mode == "block_causal":
        bid = block_ids.to(device=q.device, dtype=torch.int64).contiguous()
    R = attention_rows(q.dtype)
    S, split_len = attention_splits(B, n, Hq, Hkv, cache_len, num_sms, R)
    rows = B * n * Hq
    ws_o = torch.empty((S + 1, rows, D), dtype=torch.float32, device=q.device)
    ws_lse = torch.empty((S + 1, rows), dtype=torch.float32, device=q.device)
    grid_x = max(math.ceil(B * n * G / R) if S else 0, B * math.ceil(n * G / R))
    P = lambda t: ("p", 0 if t is None else t.data_ptr())  # noqa: E731
    args = [P(q), P(k_cache), P(v_cache), P(k_win), P(v_win), P(wl), P(bid), P(ws_o), P(ws_lse),
            ("i", B), ("i", n), ("i", Hq), ("i", Hkv), ("i", cache_len), ("i", S), ("i", split_len),
            ("i", MODES[mode]), ("f", scale),
            ("q", q.stride(0)), ("q", q.stride(1)), ("q", q.stride(2)),
            ("q", k_cache.stride(0)), ("q", k_cache.stride(1)),
            ("q", k_win.stride(0)), ("q", k_win.stride(1)), ("q", k_win.stride(2))]  # fmt: skip
    launch(f"branch_attention_partial_{tname}_d{D}", (grid_x, Hkv, S + 1), (ATTN_THREADS, 1, 1),
           attention_smem_bytes(q.dtype, D), args)
    o = torch.empty((B, n, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, n, Hq), dtype=torch.float32, device=q.device)
    launch(f"branch_attention_combine_{tname}_d{D}", (math.ceil(rows / ATTN_WARPS), 1, 1), (ATTN_THREADS, 1, 1), 0,
           [P(ws_o), P(ws_lse), ("i", S + 1), ("q", rows), P(o), P(lse)])
    return o, lse


def confidence_splits(N: int, V: int, num_sms: int) -> tuple[int, int]:
    """(V splits S, columns per split, a multiple of 8). S = 1 (one CTA per row) once N rows fill ~2 CTAs per
    SM; below that the row is cut so that N * S ~ 2 * SMs, never into chunks under 4096 columns."""
    s = max(1, min(math.ceil(2 * num_sms / max(N, 1)), V // 4096))
    chunk = math.ceil(math.ceil(V / s) / 8) * 8
    return math.ceil(V / chunk), chunk


def run_confidence(launch, logits, suppress_token, eps, num_sms=None):
    """Launch confidence on any launcher; returns (token, p_max, margin, neg_entropy, lse).
    num_sms=None: one CTA per row; else the split-V path when rows are few (confidence_splits)."""
    N, V = logits.shape
    tname = _DTYPE_NAME[logits.dtype]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    e = 16 // logits.element_size()
    vec = int(logits.data_ptr() % 16 == 0 and logits.stride(0) % e == 0)
    dev = logits.device
    token = torch.empty(N, dtype=torch.int64, device=dev)
    stats = [torch.empty(N, dtype=torch.float32, device=dev) for _ in range(4)]
    if N == 0:
        return (token, *stats)
    P = lambda t: ("p", t.data_ptr())  # noqa: E731
    sup = -1 if suppress_token is None else int(suppress_token)
    S, chunk = (1, V) if num_sms is None else confidence_splits(N, V, num_sms)
    if S == 1:
        launch(f"confidence_{tname}", (N, 1, 1), (CONF_THREADS, 1, 1), 0,
               [P(logits), ("q", logits.stride(0)), ("i", N), ("i", V), ("i", sup), ("f", float(eps)), ("i", vec),
                P(token), *[P(s) for s in stats]])  # fmt: skip
        return (token, *stats)
    p_max, margin, neg_entropy, lse = stats
    ws_state = torch.empty((N, S, 5), dtype=torch.float32, device=dev)
    ws_ent = torch.empty((N, S), dtype=torch.float32, device=dev)
    head = [P(logits), ("q", logits.stride(0)), ("i", N), ("i", V), ("i", chunk), ("i", sup)]
    launch(f"confidence_split_stats_{tname}", (N, S, 1), (CONF_THREADS, 1, 1), 0,
           [*head, ("i", vec), P(ws_state)])
    launch(f"confidence_split_entropy_{tname}", (N, S, 1), (CONF_THREADS, 1, 1), 0,
           [*head, ("f", float(eps)), ("i", vec), P(ws_state), P(ws_ent), P(token), P(p_max), P(margin), P(lse)])
    launch("confidence_split_finalize", (math.ceil(N / (CONF_THREADS // 32)), 1, 1), (CONF_THREADS, 1, 1), 0,
           [P(ws_ent), ("i", N), ("i", S), P(neg_entropy)])
    return (token, *stats)


_KTAB: dict = {}


def _ktab(n: int, topp: float, device) -> torch.Tensor:
    """lowest_k_table(n, topp) on `device`, cached: no host-to-device copy per round once warm."""
    key = (n, float(topp), str(device))
    t = _KTAB.get(key)
    if t is None:
        t = _KTAB[key] = ref.lowest_k_table(n, topp).to(device)
    return t


def run_select_round(launch, accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp,
                     alpha, creation_conf, branch_active):
    """Launch select_round on any launcher; returns (accept bool [B, n], lookahead int64 [B, n_look],
    score fp32 [B], winner int64 0-d)."""
    B, n = conf.shape
    nb = block_complete.shape[1]
    dev = conf.device
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731 - [B, n] rows of a round: a few KB
    u8 = lambda t: t.to(torch.bool).contiguous().view(torch.uint8)  # noqa: E731
    value, c = f32(accept_value), f32(conf)
    m, done = u8(masked), u8(block_complete)
    bid = block_ids.to(torch.int64).contiguous()
    cc = None if creation_conf is None else f32(creation_conf)
    act = None if branch_active is None else u8(branch_active)
    accept = torch.empty((B, n), dtype=torch.bool, device=dev)
    look = torch.empty((B, n_look), dtype=torch.int64, device=dev)
    score = torch.empty(B, dtype=torch.float32, device=dev)
    winner = torch.empty((), dtype=torch.int64, device=dev)
    warps = max(1, min(B, SEL_MAX_WARPS))
    P = lambda t: ("p", 0 if t is None else t.data_ptr())  # noqa: E731
    # tau and alpha rounded to fp32 as the reference's tensor-scalar ops do; 1 - alpha formed in float64 first
    launch("select_round_f32", (1, 1, 1), (32 * warps, 1, 1), warps * n * 4,
           [P(value), P(c), P(m), P(bid), P(done), P(_ktab(n, topp, dev)), P(cc), P(act), P(accept), P(look),
            P(score), P(winner), ("i", B), ("i", n), ("i", nb), ("i", int(n_look)), ("i", COMPARATORS[comparator]),
            ("f", float(tau)), ("f", float(alpha)), ("f", 1.0 - float(alpha))])  # fmt: skip
    return accept, look, score, winner


# --------------------------------------------------------------------------------- torch custom ops (GPU)
@torch.library.custom_op("lopa_fast::cuda_branch_attention", mutates_args=(), device_types="cuda")
def _branch_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    win_lens: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    mode: str,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    L = _launcher("branch_attention", q.device.index if q.device.index is not None else torch.cuda.current_device())
    return run_branch_attention(L, L.num_sms, q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids,
                                mode, scale, True)


@_branch_attention_op.register_fake
def _(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, scale):
    B, n, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, n, Hq), dtype=torch.float32)


@torch.library.custom_op("lopa_fast::cuda_confidence", mutates_args=(), device_types="cuda")
def _confidence_op(
    logits: torch.Tensor, suppress_token: int | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    L = _launcher("confidence", dev)
    return run_confidence(L, logits, suppress_token, eps, L.num_sms)


@_confidence_op.register_fake
def _(logits, suppress_token, eps):
    N = logits.shape[0]
    return (logits.new_empty(N, dtype=torch.int64), *[logits.new_empty(N, dtype=torch.float32) for _ in range(4)])


@torch.library.custom_op("lopa_fast::cuda_select_round", mutates_args=(), device_types="cuda")
def _select_round_op(
    accept_value: torch.Tensor,
    conf: torch.Tensor,
    masked: torch.Tensor,
    block_ids: torch.Tensor,
    block_complete: torch.Tensor,
    tau: float,
    comparator: str,
    n_look: int,
    topp: float,
    alpha: float,
    creation_conf: torch.Tensor | None,
    branch_active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = conf.device.index if conf.device.index is not None else torch.cuda.current_device()
    return run_select_round(_launcher("select_round", dev), accept_value, conf, masked, block_ids, block_complete,
                            tau, comparator, n_look, topp, alpha, creation_conf, branch_active)


@_select_round_op.register_fake
def _(accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp, alpha, creation_conf,
      branch_active):
    B, n = conf.shape
    return (conf.new_empty((B, n), dtype=torch.bool), conf.new_empty((B, n_look), dtype=torch.int64),
            conf.new_empty(B, dtype=torch.float32), conf.new_empty((), dtype=torch.int64))


# ------------------------------------------------------------------------------ public-signature hooks
_warned: set = set()


def _fallback(op: str, why: str):
    if op not in _warned:
        _warned.add(op)
        log.warning("cuda %s: %s; running the reference op instead", op, why)


def branch_attention(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens=None, block_ids=None, mode="full",
                     scale=None, return_lse=False):
    """lopa_fast.ops.branch_attention on the CUDA kernels (inputs already checked by the public op).
    Head dims other than 64/128 and non-CUDA tensors run the reference (logged once)."""
    D = q.shape[-1]
    if D not in HEAD_DIMS or q.dtype not in _DTYPE_NAME or not q.is_cuda:
        _fallback("branch_attention", f"D={D}, dtype={q.dtype}, device={q.device} has no kernel (D in {HEAD_DIMS})")
        return ref.branch_attention(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, scale,
                                    return_lse)
    o, lse = _branch_attention_op(q, k_cache, v_cache, int(cache_len), k_win, v_win, win_lens, block_ids, mode,
                                  None if scale is None else float(scale))
    return (o, lse) if return_lse else o


def confidence(logits, suppress_token=None, eps=1e-10):
    """lopa_fast.ops.confidence on the CUDA kernel; returns the 5 fields of reference.ops.Confidence."""
    if logits.dtype not in _DTYPE_NAME or not logits.is_cuda:
        _fallback("confidence", f"dtype={logits.dtype}, device={logits.device} has no kernel")
        return tuple(ref.confidence(logits, suppress_token, eps))
    return _confidence_op(logits, suppress_token, float(eps))


def select_round(accept_value, conf, masked, block_ids, block_complete, tau, comparator="gt", n_look=0, topp=1.0,
                 alpha=0.0, creation_conf=None, branch_active=None):
    """lopa_fast.ops.select_round on the CUDA kernel (one CTA per round); returns the 4 RoundSelection fields.
    Windows longer than 1024 positions and non-CUDA tensors run the reference (logged once)."""
    args = (accept_value, conf, masked, block_ids, block_complete, tau, comparator, n_look, topp, alpha,
            creation_conf, branch_active)
    if conf.shape[1] > SEL_MAX_N or not conf.is_cuda:
        _fallback("select_round", f"n={conf.shape[1]} (max {SEL_MAX_N}), device={conf.device}")
        return tuple(ref.select_round(*args))
    return _select_round_op(accept_value, conf, masked, block_ids, block_complete, float(tau), comparator,
                            int(n_look), float(topp), float(alpha), creation_conf, branch_active)


# ----------------------------------------------------------------------------------- CPU emulation (tests)
class Emulated:
    """The CUDA ops run on CPU tensors through a host build of the .cu sources (see module docstring)."""

    def __init__(self, libs: dict[str, ctypes.CDLL]):
        self._l = {op: _EmuLauncher(lib) for op, lib in libs.items()}

    def branch_attention(self, q, k_cache, v_cache, cache_len, k_win, v_win, win_lens=None, block_ids=None,
                         mode="full", scale=None, return_lse=False):
        L = self._l["branch_attention"]
        o, lse = run_branch_attention(L, L.num_sms, q, k_cache, v_cache, cache_len, k_win, v_win, win_lens,
                                      block_ids, mode, scale, return_lse)
        return (o, lse) if return_lse else o

    def confidence(self, logits, suppress_token=None, eps=1e-10, split=True):
        L = self._l["confidence"]
        return ref.Confidence(*run_confidence(L, logits, suppress_token, eps, L.num_sms if split else None))

    def select_round(self, accept_value, conf, masked, block_ids, block_complete, tau, comparator="gt", n_look=0,
                     topp=1.0, alpha=0.0, creation_conf=None, branch_active=None):
        return ref.RoundSelection(*run_select_round(self._l["select_round"], accept_value, conf, masked, block_ids,
                                                    block_complete, tau, comparator, n_look, topp, alpha,
                                                    creation_conf, branch_active))


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
    for op in ops:
        src, headers = kernel_source(op)
        body = f'#include "{op}.cu"\n' + "".join(f"LOPA_EMU_EXPORT({e})\n" for e in entry_names(op))
        key = hashlib.sha256("\0".join([cxx, body, src, emu_text, *headers.values()]).encode()).hexdigest()[:20]
        so = _cache_dir() / f"emu_{op}_{key}.so"
        if not so.exists():
            with tempfile.TemporaryDirectory() as tmp:
                cpp = Path(tmp) / f"emu_{op}.cpp"
                cpp.write_text(body)
                out = Path(tmp) / so.name
                cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w", f"-I{KERNEL_DIR}", str(cpp),
                       "-o", str(out)]  # fmt: skip
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"host build of {op}.cu failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
                shutil.move(str(out), so)
        libs[op] = ctypes.CDLL(str(so))
    return Emulated(libs)
