"""Triton `branch_attention`: B branch windows over one shared prefix KV cache (Hydragen/cascade style).

Two launches, merged by log-sum-exp (one when the prefix fits one split, below):
  1. `_prefix_kernel`: the prefix part as one dense problem. The queries of all branches and all query
     heads of a GQA group are stacked into R = B * n * G rows per kv head, so each prefix K/V tile is
     read once per (kv head, row tile, split) instead of once per branch and head. The prefix is cut
     into `num_splits` chunks (flash-decoding) so that B=1, n=32 (224 rows, 4 kv heads = 16 row tiles)
     still fills the GPU; each split writes a normalised partial o [R, D] and its lse (fp32).
     Pooled form (cache_index [B]: k/v_cache a pool [S, Lmax, Hkv, D], cache_len [S] on the device): a row
     tile holds rows of ONE branch, whose base pointer is its slot's and whose length is loaded per tile;
     splits and tiles are those of a B = 1 call, so each row is bitwise that call (the rows' own keys only).
  2. `_window_kernel`: per (branch, kv head, row tile) the window part under the structural mask
     (full | block_causal | causal, from block_ids / win_lens; padded keys masked), then merges the
     prefix partials by LSE and writes o in q.dtype (+ lse).
One launch (`launch_plan`: the prefix fits ONE split, i.e. <= 4 key tiles or enough row tiles to fill the GPU
without splitting): the window kernel walks the prefix itself (PREFIX_IN), then its window, with one running
softmax: no partials written and read, one graph node less a layer (24 at Qwen2.5-0.5B: ~10 % of a captured round
of short prompts). A split kernel there would run the same serial key loop per row tile, plus its launch.
Bytes (prefix 2048, B 16, n 32, bf16, Dream-7B): prefix K/V 4 MB read once per row tile;
partials 2 * splits * R * D * 4 B. Softmax runs in base 2 (exp2) with scale * log2(e) folded in.
Matches lopa_fast.reference.ops.branch_attention.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lopa_fast.reference.attention_modes import MODE_CODES
from lopa_fast.kernels.triton._common import is_interpreter

_LOG2E = 1.4426950408889634
_BLOCK_CAUSAL = tl.constexpr(MODE_CODES["block_causal"])
_CAUSAL = tl.constexpr(MODE_CODES["causal"])


@triton.jit
def _load_q(q_ptr, b, i, h, s_qb, s_qn, s_qh, rmask, D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """The [BLOCK_M, BLOCK_D] query tile of rows (b, i, head h) (zeros where masked; fp32 when UPCAST), with the
    head-dim offsets and their mask."""
    od = tl.arange(0, BLOCK_D)
    dmask = od < D
    q_off = b.to(tl.int64) * s_qb + i.to(tl.int64) * s_qn + h.to(tl.int64) * s_qh
    q = tl.load(q_ptr + q_off[:, None] + od[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q, od, dmask


@triton.jit
def _load_kv(k_base, v_base, offs_n, s_k, s_v, od, kv_mask, UPCAST: tl.constexpr):
    """One [BLOCK_N, BLOCK_D] tile of K and V (rows offs_n, zeros where masked); fp32 when UPCAST."""
    k = tl.load(k_base + offs_n[:, None].to(tl.int64) * s_k + od[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * s_v + od[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """Fold one tile of base-2 scores s [BLOCK_M, BLOCK_N] (-inf = invisible) and its V into the running
    (max m_i, sum l_i, output acc). A row that has seen no visible key yet keeps m = -inf, l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _prefix_keys(q, k_base, v_base, lo, hi, s_kl, s_vl, od, dmask, qk_scale, m_i, l_i, acc,
                 BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold prefix keys [lo, hi) (every one visible to every row) into the running (m_i, l_i, acc): the prefix
    kernel's split, or the whole prefix in the one-launch window kernel."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        k, v = _load_kv(k_base, v_base, offs_n, s_kl, s_vl, od, nmask[:, None] & dmask[None, :], UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, ci_ptr,
    cache_len, Lmax, R, n, chunk, qk_scale, tiles_b,
    s_qb, s_qn, s_qh, s_ks, s_kl, s_kh, s_vs, s_vl, s_vh,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    CL_PTR: tl.constexpr, POOLED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    H = tl.num_programs(1)
    if POOLED:  # tiles_b tiles per branch: a tile's rows share one slot (its K/V base and its length)
        b_tile = pid_m // tiles_b
        local = (pid_m % tiles_b) * BLOCK_M + tl.arange(0, BLOCK_M)  # (i, g) rows of branch b_tile
        rows = b_tile * (n * G) + local
        rmask = local < n * G
        slot = tl.load(ci_ptr + b_tile).to(tl.int64)
        k_base = k_ptr + slot * s_ks + kvh.to(tl.int64) * s_kh
        v_base = v_ptr + slot * s_vs + kvh.to(tl.int64) * s_vh
        cl = tl.minimum(tl.maximum(tl.load(cache_len + slot).to(tl.int32), 0), Lmax)
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # stacked (b, i, g) rows of this kv head
        rmask = rows < R
        k_base = k_ptr + kvh.to(tl.int64) * s_kh
        v_base = v_ptr + kvh.to(tl.int64) * s_vh
        if CL_PTR:  # device prefix length (graph-safe): the grid covers Lmax, splits past it are empty
            cl = tl.minimum(tl.maximum(tl.load(cache_len).to(tl.int32), 0), Lmax)
        else:
            cl = cache_len
    g = rows % G
    bi = rows // G
    b = bi // n
    i = bi % n
    q, od, dmask = _load_q(q_ptr, b, i, kvh * G + g, s_qb, s_qn, s_qh, rmask, D, BLOCK_D, UPCAST)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, cl)
    m_i, l_i, acc = _prefix_keys(q, k_base, v_base, lo, hi, s_kl, s_vl, od, dmask, qk_scale, m_i, l_i, acc,
                                 BLOCK_N, UPCAST, DOT_PREC)
    # an empty split (lo >= cache_len) leaves l_i = 0: lse2 = -inf, o = 0 (weight 0 in the merge)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    part = (split * H + kvh).to(tl.int64) * R + rows
    tl.store(o_ptr + part[:, None] * BLOCK_D + od[None, :], out, mask=rmask[:, None])
    tl.store(lse_ptr + part, lse2, mask=rmask)


@triton.jit
def _window_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, po_ptr, plse_ptr, wl_ptr, blk_ptr, kc_ptr, vc_ptr, ci_ptr, cache_len,
    n, R, num_splits, qk_scale, Lmax,
    s_qb, s_qn, s_qh, s_kb, s_kn, s_kh, s_vb, s_vn, s_vh, s_ob, s_on, s_oh, s_blk,
    s_ks, s_kl, s_kh_c, s_vs, s_vl, s_vh_c,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, HAS_WL: tl.constexpr,
    RETURN_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    PREFIX_IN: tl.constexpr, CL_PTR: tl.constexpr, POOLED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    H = tl.num_programs(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (i, g) rows of branch b, kv head kvh
    g = rows % G
    i = rows // G
    rmask = i < n
    q, od, dmask = _load_q(q_ptr, b, i, kvh * G + g, s_qb, s_qn, s_qh, rmask, D, BLOCK_D, UPCAST)
    if HAS_WL:
        wl = tl.minimum(tl.load(wl_ptr + b).to(tl.int32), n)  # never read past the window, whatever the caller
    else:
        wl = n
    if MODE == _BLOCK_CAUSAL:
        bq = tl.load(blk_ptr + b.to(tl.int64) * s_blk + i, mask=rmask, other=0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if PREFIX_IN:  # the committed prefix first (every key visible to every window row), as the prefix kernel reads it
        if POOLED:  # this program's rows are branch b's: its slot's cache and length
            slot = tl.load(ci_ptr + b).to(tl.int64)
            kc_base = kc_ptr + slot * s_ks + kvh.to(tl.int64) * s_kh_c
            vc_base = vc_ptr + slot * s_vs + kvh.to(tl.int64) * s_vh_c
            cl = tl.minimum(tl.maximum(tl.load(cache_len + slot).to(tl.int32), 0), Lmax)
        else:
            kc_base = kc_ptr + kvh.to(tl.int64) * s_kh_c
            vc_base = vc_ptr + kvh.to(tl.int64) * s_vh_c
            if CL_PTR:
                cl = tl.minimum(tl.maximum(tl.load(cache_len).to(tl.int32), 0), Lmax)
            else:
                cl = cache_len
        m_i, l_i, acc = _prefix_keys(q, kc_base, vc_base, 0, cl, s_kl, s_vl, od, dmask, qk_scale, m_i, l_i, acc,
                                     BLOCK_N, UPCAST, DOT_PREC)
    k_base = k_ptr + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh
    v_base = v_ptr + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh
    for start in range(0, wl, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < wl
        k, v = _load_kv(k_base, v_base, offs_n, s_kn, s_vn, od, nmask[:, None] & dmask[None, :], UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        vis = nmask[None, :] & rmask[:, None]
        if MODE == _BLOCK_CAUSAL:
            bk = tl.load(blk_ptr + b.to(tl.int64) * s_blk + offs_n, mask=nmask, other=0)
            vis = vis & (bk[None, :] <= bq[:, None])
        elif MODE == _CAUSAL:
            vis = vis & (offs_n[None, :] <= i[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_PREC)
    # merge the prefix partials (normalised o_s, base-2 lse_s) by log-sum-exp
    prow = (b * n + i) * G + g  # this row's index in the stacked prefix layout
    for sp in range(num_splits):
        part = (sp * H + kvh).to(tl.int64) * R + prow
        lse_s = tl.load(plse_ptr + part, mask=rmask, other=float("-inf"))
        o_s = tl.load(po_ptr + part[:, None] * BLOCK_D + od[None, :], mask=rmask[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(lse_s - m_safe)
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    out = acc / l_i[:, None]
    o_off = b.to(tl.int64) * s_ob + i.to(tl.int64) * s_on + (kvh * G + g).to(tl.int64) * s_oh
    tl.store(o_ptr + o_off[:, None] + od[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])
    if RETURN_LSE:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
        tl.store(lse_ptr + (b * n + i) * (H * G) + kvh * G + g, lse, mask=rmask)


def default_num_splits(rows_tiles: int, cache_len: int, block_n: int, n_sm: int = 132) -> int:
    """Prefix splits so that row tiles x kv heads x splits covers ~2 waves of 132 SMs (H200), each split
    keeping >= 4 key tiles (shorter splits cost more in partial traffic than they win in parallelism)."""
    if cache_len <= 0:
        return 0
    max_splits = max(1, triton.cdiv(cache_len, 4 * block_n))
    return max(1, min(max_splits, triton.cdiv(2 * n_sm, max(1, rows_tiles))))


def launch_plan(tiles: int, cache_len: int, block_n: int, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, chunk) of a call: `tiles` row tiles x kv heads of ONE branch group (pooled: one branch), the
    static prefix length (an int, or Lmax for a device length), num_splits None = `default_num_splits`. 0 splits:
    no prefix; 1: one launch (the window kernel reads the prefix itself); more: the prefix kernel's chunks of `chunk`
    keys, merged by the window kernel."""
    if cache_len <= 0:
        return 0, 0
    if num_splits is None:  # pooled: the split of a B = 1 call, so a row's sums do not depend on its neighbours
        num_splits = default_num_splits(tiles, cache_len, block_n)
    num_splits = max(1, min(num_splits, triton.cdiv(cache_len, block_n)))
    chunk = triton.cdiv(triton.cdiv(cache_len, num_splits), block_n) * block_n
    return triton.cdiv(cache_len, chunk), chunk


def block_sizes(dtype: torch.dtype, gpu: bool = False):
    """(BLOCK_M, BLOCK_N, num_warps). D=128 fp16/bf16: 64x64 tiles, 4 warps, 2 stages: 80 KB smem, <= 248
    registers, no spills on sm_90. fp32 runs exact IEEE dots (no TF32) on FMA units: 64x64x4 warps spilled
    77 KB and 32x32x4 warps 2 KB; 32x32 with 8 warps does not spill in either kernel
    (bench/results/kernel_resources.md). gpu: the GPU's tiles even under the interpreter (bench/roundcount's plan)."""
    if is_interpreter() and not gpu:
        return 32, 32, 4
    return (32, 32, 8) if dtype == torch.float32 else (64, 64, 4)


def one_launch(num_splits: int, dtype: torch.dtype) -> bool:
    """Whether the window kernel reads the prefix itself (`launch_plan`'s one split). Not for float32 on a GPU: its
    IEEE dots on the FMA units spilled in the two-loop window kernel at every tile tried on sm_90 (8-692 B at 16-32 x
    16-32, 1-2 stages, 4-8 warps), and float32 there is the parity dtype, not the fast one; the interpreter runs it
    (the CPU tests' path)."""
    return num_splits == 1 and (dtype != torch.float32 or is_interpreter())


def branch_attention(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens=None, block_ids=None, mode="full",
                     scale=None, return_lse=False, num_splits=None, *, cache_index=None):
    """Shapes as lopa_fast.reference.ops.branch_attention; inputs need a contiguous last dim.
    cache_len: an int (grid and prefix splits sized to it) or a 0-d / [1] int tensor on q's device (read by the
    prefix kernel; grid and splits sized to Lmax = k_cache.shape[0], so a captured CUDA graph replays any
    prefix length; values are clamped to [0, Lmax]).
    cache_index [B] int (pooled form): k/v_cache [S, Lmax, Hkv, D], cache_len [S] int on q's device, read per
    row tile; tiles and splits (num_splits=None) as for one branch alone, whatever B."""
    B, n, Hq, D = q.shape
    Hkv = k_win.shape[2]
    G = Hq // Hkv
    pooled = cache_index is not None
    Lmax = k_cache.shape[-3]
    cl_ptr = isinstance(cache_len, torch.Tensor)
    if pooled:  # per-slot lengths and slot indices: read by the kernel, nothing here depends on their values
        cl_arg = cache_len.contiguous()
        ci_arg = cache_index.contiguous()
        cache_len = Lmax
    elif cl_ptr:  # a 0-d device tensor: nothing below depends on its value (no host read, CUDA-graph safe)
        cl_arg = cache_len.reshape(1)
        cache_len = Lmax  # grid, splits and workspaces sized for the static buffer
    else:
        cache_len = cl_arg = int(cache_len)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qk_scale = scale * _LOG2E
    dev = q.device
    BLOCK_D = max(16, triton.next_power_of_2(D))  # tl.dot needs K >= 16
    BLOCK_M, BLOCK_N, warps = block_sizes(q.dtype)
    upcast = is_interpreter() and q.dtype == torch.bfloat16  # the interpreter's bf16 dot is garbage
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: no silent TF32 rounding
    o = torch.empty_like(q)
    lse = torch.empty(B, n, Hq, dtype=torch.float32, device=dev) if return_lse else o
    if q.numel() == 0:
        return (o, lse) if return_lse else o
    R = B * n * G
    m_tiles = triton.cdiv(R, BLOCK_M)
    tiles_b = triton.cdiv(n * G, BLOCK_M)  # pooled: row tiles per branch (a tile never mixes two slots)
    if pooled:
        m_tiles = tiles_b * B
    num_splits, chunk = launch_plan(tiles_b * Hkv if pooled else m_tiles * Hkv, cache_len, BLOCK_N, num_splits)
    prefix_in = one_launch(num_splits, q.dtype)  # one launch: the window kernel walks the prefix itself
    if num_splits > 0 and not prefix_in:
        part_o = torch.empty(num_splits, Hkv, R, BLOCK_D, dtype=torch.float32, device=dev)
        part_lse = torch.empty(num_splits, Hkv, R, dtype=torch.float32, device=dev)
        _prefix_kernel[(m_tiles, Hkv, num_splits)](
            q, k_cache, v_cache, part_o, part_lse, ci_arg if pooled else part_lse,
            cl_arg, Lmax, R, n, chunk, qk_scale, tiles_b,
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0) if pooled else 0, k_cache.stride(-3),
            k_cache.stride(-2), v_cache.stride(0) if pooled else 0, v_cache.stride(-3), v_cache.stride(-2),
            G=G, D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=upcast, DOT_PREC=prec,
            CL_PTR=cl_ptr or pooled, POOLED=pooled, num_warps=warps, num_stages=2,
        )
    else:
        part_o = part_lse = torch.empty(1, dtype=torch.float32, device=dev)
    wl = win_lens if win_lens is not None else part_lse
    blk = block_ids if block_ids is not None else part_lse
    s_blk = block_ids.stride(0) if block_ids is not None else 0
    _window_kernel[(triton.cdiv(n * G, BLOCK_M), B, Hkv)](
        q, k_win, v_win, o, lse, part_o, part_lse, wl, blk, k_cache, v_cache, ci_arg if pooled else part_lse, cl_arg,
        n, R, 0 if prefix_in else num_splits, qk_scale, Lmax,
        q.stride(0), q.stride(1), q.stride(2), k_win.stride(0), k_win.stride(1), k_win.stride(2),
        v_win.stride(0), v_win.stride(1), v_win.stride(2), o.stride(0), o.stride(1), o.stride(2), s_blk,
        k_cache.stride(0) if pooled else 0, k_cache.stride(-3), k_cache.stride(-2),
        v_cache.stride(0) if pooled else 0, v_cache.stride(-3), v_cache.stride(-2),
        G=G, D=D, BLOCK_D=BLOCK_D, MODE=MODE_CODES[mode], HAS_WL=win_lens is not None, RETURN_LSE=return_lse,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=upcast, DOT_PREC=prec, PREFIX_IN=prefix_in,
        CL_PTR=cl_ptr or pooled, POOLED=pooled, num_warps=warps, num_stages=2,
    )
    return (o, lse) if return_lse else o
