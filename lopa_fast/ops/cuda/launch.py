"""Launch maths of the CUDA kernels: grids, splits, shared memory, workspaces and argument packing.

Every `run_*` takes a launcher: a callable (entry name, grid, block, dynamic smem bytes, args) -> None, where
each arg is (kind, value) with kind "p" pointer, "i" int32, "q" int64, "f" float32, "t" a tuple of n pointers
passed by value as one struct parameter `{ long long p[n]; }` (the C types of the extern "C" entry points; "t" is
packed on the host into the launch's parameter buffer: no device table, no host-to-device copy, capturable).
The GPU launcher is lopa_fast.ops.cuda.device.CupyLauncher, the CPU one the host emulation's
(lopa_fast.ops.cuda.emulation), so both run exactly this code.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from lopa_fast.reference.attention_modes import MODE_CODES
from lopa_fast.sampling import head_confidence_outputs
from lopa_fast.ops.cuda.constants import (
    ATTN_KEYS,
    ATTN_ROWS,
    ATTN_ROWS_PER_WARP,
    ATTN_THREADS,
    ATTN_WARPS,
    CONF_THREADS,
    DTYPE_NAMES,
    HC_ROWS,
    HC_THREADS,
    MMA_KEYS,
    MMA_ROWS,
    MMA_THREADS,
    VOCAB_WS_WORDS,
)

Launch = Callable[[str, tuple, tuple, int, list], None]


def _ptr(t: torch.Tensor | None) -> tuple[str, int]:
    return ("p", 0 if t is None else t.data_ptr())


# ------------------------------------------------------------------------------------- branch_attention
def attention_rows(dtype: torch.dtype) -> int:
    """Query rows per CTA of branch_attention_partial for `dtype` (fp32: SIMT kernel, else tensor cores)."""
    return ATTN_ROWS if dtype == torch.float32 else MMA_ROWS


def attention_threads(dtype: torch.dtype) -> int:
    """Threads per CTA of branch_attention_partial for `dtype`."""
    return ATTN_THREADS if dtype == torch.float32 else MMA_THREADS


def attention_smem_bytes(dtype: torch.dtype, D: int) -> int:
    """Dynamic shared memory of branch_attention_partial (attn::Smem / attn::mma::Smem in the .cu)."""
    if dtype != torch.float32:  # K [keys][D + 8] + V^T [D][keys + 8], 16-bit
        return MMA_KEYS * (D + 8) * 2 + D * (MMA_KEYS + 8) * 2
    es = torch.empty((), dtype=dtype).element_size()
    return (
        ATTN_ROWS * D * 4  # Q, fp32, pre-scaled
        + ATTN_KEYS * (D + 16 // es) * es  # K, padded by 16 bytes per key
        + ATTN_KEYS * D * es  # V
        + ATTN_WARPS * ATTN_ROWS_PER_WARP * ATTN_KEYS * 4  # per-warp probabilities
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


def aligned(t: torch.Tensor, vec: int) -> torch.Tensor:
    """t with a contiguous last dim, 16-byte aligned base and every other stride a multiple of `vec`."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % vec == 0 for s in t.stride()[:-1])
    return t if ok else t.contiguous()


def _pair(a: torch.Tensor, b: torch.Tensor, vec: int) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = aligned(a, vec), aligned(b, vec)
    if a.stride() != b.stride():  # the kernel indexes K and V with one set of strides
        a, b = a.contiguous(), b.contiguous()
    return a, b


def run_branch_attention(launch: Launch, num_sms, q, k_cache, v_cache, cache_len, k_win, v_win, win_lens,
                         block_ids, mode, scale, cache_index=None):
    """Launch branch_attention (shapes: lopa_fast.reference.ops.branch_attention); returns o [B, n, Hq, D] in
    q.dtype and lse [B, n, Hq] fp32 (the combine kernel writes both). cache_len: an int, or a 0-d / [1] int
    tensor on q's device that the kernel reads (grid, splits and workspace then sized for Lmax =
    k_cache.shape[0]: nothing depends on its value, so a CUDA graph can capture the launch).
    cache_index [B] int (pooled form): k/v_cache a pool [S, Lmax, Hkv, D], cache_len the [S] slot lengths on the
    device; prefix CTAs take one branch's rows and the splits are those of B = 1 (a row's sums are its own)."""
    B, n, Hq, D = q.shape
    Hkv = k_win.shape[2]
    G = Hq // Hkv
    tname = DTYPE_NAMES[q.dtype]
    vec = 16 // q.element_size()
    cl_dev = ci = None
    if cache_index is not None:  # per-slot lengths and each row's slot: read by the kernel (graph-safe)
        cl_dev = cache_len.to(device=q.device, dtype=torch.int64).contiguous()
        ci = cache_index.to(device=q.device, dtype=torch.int64).contiguous()
        cache_len = k_cache.shape[1]
    elif isinstance(cache_len, torch.Tensor):  # device length (graph-safe): splits sized for Lmax, no host read
        cl_dev = cache_len.reshape(1).to(device=q.device, dtype=torch.int64)
        cache_len = k_cache.shape[0]
    else:
        cache_len = int(cache_len)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q = aligned(q, vec)
    k_cache, v_cache = _pair(k_cache, v_cache, vec)
    k_win, v_win = _pair(k_win, v_win, vec)
    wl = None if win_lens is None else win_lens.to(device=q.device, dtype=torch.int64).contiguous()
    bid = None
    if mode == "block_causal":
        bid = block_ids.to(device=q.device, dtype=torch.int64).contiguous()
    R = attention_rows(q.dtype)
    S, split_len = attention_splits(1 if ci is not None else B, n, Hq, Hkv, cache_len, num_sms, R)
    rows = B * n * Hq
    ws_o = torch.empty((S + 1, rows, D), dtype=torch.float32, device=q.device)
    ws_lse = torch.empty((S + 1, rows), dtype=torch.float32, device=q.device)
    grid_x = max(math.ceil(B * n * G / R) if S else 0, B * math.ceil(n * G / R))  # pooled: the second term
    P = _ptr
    args = [P(q), P(k_cache), P(v_cache), P(k_win), P(v_win), P(wl), P(bid), P(cl_dev), P(ws_o), P(ws_lse),
            ("i", B), ("i", n), ("i", Hq), ("i", Hkv), ("i", cache_len), ("i", S), ("i", split_len),
            ("i", MODE_CODES[mode]), ("f", scale),
            ("q", q.stride(0)), ("q", q.stride(1)), ("q", q.stride(2)),
            ("q", k_cache.stride(-3)), ("q", k_cache.stride(-2)),
            ("q", k_win.stride(0)), ("q", k_win.stride(1)), ("q", k_win.stride(2)),
            P(ci), ("q", k_cache.stride(0) if ci is not None else 0)]
    part = "pooled_partial" if ci is not None else "partial"  # pooled: its own entry (registers: see the .cu)
    launch(f"branch_attention_{part}_{tname}_d{D}", (grid_x, Hkv, S + 1), (attention_threads(q.dtype), 1, 1),
           attention_smem_bytes(q.dtype, D), args)
    o = torch.empty((B, n, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, n, Hq), dtype=torch.float32, device=q.device)
    # combine: one warp per output row, ATTN_WARPS rows per CTA
    launch(f"branch_attention_combine_{tname}_d{D}", (math.ceil(rows / ATTN_WARPS), 1, 1), (ATTN_THREADS, 1, 1), 0,
           [P(ws_o), P(ws_lse), ("i", S + 1), ("q", rows), P(o), P(lse)])
    return o, lse


# ------------------------------------------------------------------------------------------- confidence
def confidence_splits(N: int, V: int, num_sms: int) -> tuple[int, int]:
    """(V splits S, columns per split, a multiple of 8). S = 1 (one CTA per row) once N rows fill ~2 CTAs per
    SM; below that the row is cut so that N * S ~ 2 * SMs, never into chunks under 4096 columns."""
    s = max(1, min(math.ceil(2 * num_sms / max(N, 1)), V // 4096))
    chunk = math.ceil(math.ceil(V / s) / 8) * 8
    return math.ceil(V / chunk), chunk


def run_confidence(launch: Launch, logits, suppress_token, eps, num_sms=None):
    """Launch confidence on logits [N, V]; returns (token int64 [N], p_max, margin, neg_entropy, lse fp32 [N]).
    num_sms=None: one CTA per row; else the split-V path when rows are few (confidence_splits)."""
    N, V = logits.shape
    tname = DTYPE_NAMES[logits.dtype]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    e = 16 // logits.element_size()
    vec = int(logits.data_ptr() % 16 == 0 and logits.stride(0) % e == 0)
    dev = logits.device
    token = torch.empty(N, dtype=torch.int64, device=dev)
    stats = [torch.empty(N, dtype=torch.float32, device=dev) for _ in range(4)]
    if N == 0:
        return (token, *stats)
    P = _ptr
    sup = -1 if suppress_token is None else int(suppress_token)
    S, chunk = (1, V) if num_sms is None else confidence_splits(N, V, num_sms)
    block = (CONF_THREADS, 1, 1)
    if S == 1:
        launch(f"confidence_{tname}", (N, 1, 1), block, 0,
               [P(logits), ("q", logits.stride(0)), ("i", N), ("i", V), ("i", sup), ("f", float(eps)), ("i", vec),
                P(token), *[P(s) for s in stats]])
        return (token, *stats)
    p_max, margin, neg_entropy, lse = stats
    ws_state = torch.empty((N, S, VOCAB_WS_WORDS), dtype=torch.float32, device=dev)
    ws_ent = torch.empty((N, S), dtype=torch.float32, device=dev)
    head = [P(logits), ("q", logits.stride(0)), ("i", N), ("i", V), ("i", chunk), ("i", sup)]
    launch(f"confidence_split_stats_{tname}", (N, S, 1), block, 0, [*head, ("i", vec), P(ws_state)])
    launch(f"confidence_split_entropy_{tname}", (N, S, 1), block, 0,
           [*head, ("f", float(eps)), ("i", vec), P(ws_state), P(ws_ent), P(token), P(p_max), P(margin), P(lse)])
    launch("confidence_split_finalize", (math.ceil(N / (CONF_THREADS // 32)), 1, 1), block, 0,
           [P(ws_ent), ("i", N), ("i", S), P(neg_entropy)])
    return (token, *stats)


# -------------------------------------------------------------------------------------- head_confidence
def head_confidence_splits(R: int, V: int, num_sms: int) -> tuple[int, int]:
    """(vocabulary splits S, columns per split, a multiple of HC_THREADS): about 2 CTAs per SM over (row tiles x
    splits), no split under 4 column tiles."""
    tiles = math.ceil(R / HC_ROWS)
    s = max(1, min(math.ceil(2 * num_sms / max(tiles, 1)), math.ceil(V / (4 * HC_THREADS))))
    chunk = math.ceil(math.ceil(V / s) / HC_THREADS) * HC_THREADS
    return math.ceil(V / chunk), chunk


def run_head_confidence(launch: Launch, hidden, weight, suppress_token, eps, entropy, num_sms, keep_logits=False):
    """Launch head_confidence on hidden [R, H], weight [V, H] (one dtype); returns HeadConfidence(token int64 [R],
    p_max, margin, neg_entropy (zeros without entropy), lse fp32 [R], finite bool [R], logits: the raw logits
    [R, V] in hidden.dtype with keep_logits, else None)."""
    R, H = hidden.shape
    V = weight.shape[0]
    tname = DTYPE_NAMES[hidden.dtype]
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    dev = hidden.device
    out = head_confidence_outputs(R, dev)
    token, p_max, margin, neg_entropy, lse, finite, _ = out
    # the logits the stats pass writes (storage dtype): the entropy pass reads them back instead of recomputing
    # them from the weight, and / or the caller keeps them
    logits = torch.empty((R, V), dtype=hidden.dtype, device=dev) if entropy or keep_logits else None
    if R == 0:
        return out._replace(logits=logits if keep_logits else None)
    P = _ptr
    sup = -1 if suppress_token is None else int(suppress_token)
    S, chunk = head_confidence_splits(R, V, num_sms)
    ws_state = torch.empty((R, S, VOCAB_WS_WORDS + 1), dtype=torch.float32, device=dev)  # + non-finite count
    grid = (math.ceil(R / HC_ROWS), S, 1)
    block = (HC_THREADS, 1, 1)
    head = [P(hidden), ("q", hidden.stride(0)), P(weight), ("q", weight.stride(0)), ("i", R), ("i", V), ("i", H),
            ("i", chunk), ("i", sup)]
    launch(f"head_confidence_stats_{tname}", grid, block, 0, [*head, P(ws_state), P(logits)])
    rows_grid = (math.ceil(R / HC_THREADS), 1, 1)
    launch("head_confidence_merge", rows_grid, block, 0,
           [P(ws_state), ("i", R), ("i", S), P(token), P(p_max), P(margin), P(lse), P(finite)])
    if entropy:
        ws_ent = torch.empty((R, S), dtype=torch.float32, device=dev)
        launch(f"head_confidence_entropy_{tname}", grid, block, 0,
               [P(logits), ("i", R), ("i", V), ("i", chunk), ("i", sup), ("f", float(eps)), P(lse), P(ws_ent)])
        launch("head_confidence_finalize", rows_grid, block, 0, [P(ws_ent), ("i", R), ("i", S), P(neg_entropy)])
    return out._replace(logits=logits if keep_logits else None)


# ------------------------------------------------------------------------------------- select_round
def select_round_ws_bytes(NB: int, Lb1: int, G1: int, Nb: int) -> int:
    """Scratch bytes of select_round_kernel: the regions of sr::carve in select_round.cu, each rounded up to 8
    bytes, in its order (value-independent: a captured graph keeps one buffer)."""
    r8 = lambda n: (n + 7) // 8 * 8  # noqa: E731
    regions = [8 * NB * Nb, 8 * NB * Nb, 8 * Lb1, 8 * Lb1, 8 * NB * G1, 8 * NB, 8 * NB,  # int64 / double
               4 * NB * Nb, 4 * Nb, 4 * Nb, 4 * Nb, 4 * Nb,  # rows, cW, pW, keyl (float), order (int32)
               NB * Nb, Nb, Nb, Nb, Nb, G1, NB * G1]  # # bool flags
    return sum(r8(n) for n in regions)


def run_select_round(launch: Launch, args: list, outs: list, bs: int, mask_id: int, eos_id: int, n_look: int,
                     shift: bool, blend: bool, score_all: bool) -> None:
    """One launch of select_round_kernel (one CTA) on contiguous `args` (the op's 35 tensors, reference order)
    writing the 28 fresh `outs` (SelectRound's fields). The 63 data pointers go by value as one struct parameter
    (kind "t", 504 bytes: CUDA's limit is 4 KB), so a launch copies nothing host-to-device and a CUDA graph
    captures it; the scratch is a byte tensor sized by select_round_ws_bytes."""
    from lopa_fast.ops.cuda.constants import SR_PTRS, SR_THREADS  # noqa: PLC0415

    x = args[3]
    NB, Lb1 = x.shape
    G1, Nb = args[5].shape[0], args[21].shape[0]
    if len(args) + len(outs) != SR_PTRS:
        raise ValueError(f"select_round_kernel takes {SR_PTRS} tensors (inputs + outputs), got "
                         f"{len(args)} + {len(outs)}")
    table = tuple(t.data_ptr() for t in (*args, *outs))
    ws = torch.empty(select_round_ws_bytes(NB, Lb1, G1, Nb), dtype=torch.uint8, device=x.device)
    flags = int(shift) | int(blend) << 1 | int(score_all) << 2
    launch("select_round_kernel", (1, 1, 1), (SR_THREADS, 1, 1), 0,
           [("t", table), _ptr(ws), ("q", NB), ("q", Lb1), ("q", G1), ("q", Nb), ("q", bs), ("q", mask_id),
            ("q", eos_id), ("q", n_look), ("i", flags)])
