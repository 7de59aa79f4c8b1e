"""Triton `norm_linear`: a decoder layer's pre-norm GEMM with the residual add and RMSNorm as its prologue and
SwiGLU or RoPE as its epilogue (one launch where the layer ran three).

    s   = x + residual                      (when a residual is given; written once, by the programs of column tile 0)
    h   = rms_norm(s, norm_weight, eps)     (when a norm weight is given)
    y   = h @ W^T + bias                    (fp32 accumulators, rounded to the storage dtype as F.linear returns y)
    out = silu(y[:, :F]) * y[:, F:]         epilogue "swiglu": W = the merged gate/up weight [2F, K]
    out = rope(y) on its first rot_heads    epilogue "rope":   W = the merged q/k/v weight [(Hq + 2 Hkv) D, K]
          heads of D columns, the rest as y

Every program owns two column sets of equal width (two `tl.dot`s per K step, as SwiGLU's gate and up): "swiglu"
columns j and F + j, "rope" columns j and D/2 + j of one head (the rotate-half pairs), so each epilogue is
elementwise over the two accumulators. Grid (row tiles, column tiles), row tiles fastest: the programs that share a
weight tile run side by side and read it from L2. The prologue reads the program's rows twice (a first pass for the
sum of squares: a row is K <= 4,096 values, from L2) and recomputes the norm per column tile, so the normed
activations are never written: at Qwen2.5-0.5B a D2F layer's 9 kernels become 6 (the pre-norm and the add + norm
ride in the two GEMMs, RoPE in the QKV GEMM's epilogue).
Rounding follows the references (kernels/triton/rms_norm.py, rope.py, silu_mul.py): the add, the normalised row and
its product with the weight each rounded to the storage dtype; launched with enable_fp_fusion=False so the RoPE
products are rounded where the reference rounds them. The only differences to lopa_fast.reference.ops.norm_linear:
the order of the fp32 sum of squares and of the GEMM's sums (as a GEMM library's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lopa_fast.kernels.triton._common import is_interpreter

EPILOGUES = ("swiglu", "rope")  # the constexpr EPI is the index
# warps per epilogue: RoPE holds six [BLOCK_M, BLOCK_N] fp32 tiles at its end (two accumulators, cos / sin halves),
# which spilled 32 B at 4 warps with 64 x 64 bf16 tiles on sm_90 (255 registers); 8 warps halve that per thread
NUM_WARPS = {"swiglu": 4, "rope": 8}
_ROPE = tl.constexpr(1)


@triton.jit
def _load_rows(x_ptr, r_ptr, rm64, kk, ok, stride_x, stride_r, HAS_RES: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile of s = x (+ residual, one rounding to the storage dtype)."""
    a = tl.load(x_ptr + rm64[:, None] * stride_x + kk[None, :], mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rm64[:, None] * stride_r + kk[None, :], mask=ok, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)
    return a


@triton.jit
def _norm_linear_kernel(
    x_ptr, r_ptr, s_ptr, nw_ptr, w_ptr, b_ptr, o_ptr, cos_ptr, sin_ptr,
    M, K, HALF, col_tiles, out_cols, stride_x, stride_r, stride_w, n_tok, scb, sct, rot_heads, eps,
    HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, EPI: tl.constexpr,
    ROPE_FP32: tl.constexpr, ROPE_POS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(1)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    rm64 = rm.to(tl.int64)
    if EPI == _ROPE:  # a column tile of one head: j and D/2 + j (D = 2 HALF)
        head = pid_n // col_tiles
        j = (pid_n % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_a = head * 2 * HALF + j
    else:  # gate column j and up column F + j (F = HALF)
        j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_a = j
    jmask = j < HALF
    col_b = col_a + HALF
    ca64 = col_a.to(tl.int64)
    cb64 = col_b.to(tl.int64)
    if HAS_NORM:  # the rows' sums of squares first (s is re-formed below, bit for bit the same values)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = _load_rows(x_ptr, r_ptr, rm64, kk, mmask[:, None] & (kk < K)[None, :], stride_x, stride_r, HAS_RES)
            af = a.to(tl.float32)
            ss += tl.sum(af * af, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        ok = mmask[:, None] & kmask[None, :]
        a = _load_rows(x_ptr, r_ptr, rm64, kk, ok, stride_x, stride_r, HAS_RES)
        if HAS_RES:  # column tile 0 writes s (every row tile has one)
            tl.store(s_ptr + rm64[:, None] * K + kk[None, :], a, mask=ok & (pid_n == 0))
        if HAS_NORM:
            dt = a.dtype
            a = (a.to(tl.float32) * rstd[:, None]).to(dt)
            g = tl.load(nw_ptr + kk, mask=kmask, other=0.0)
            a = (a.to(tl.float32) * g.to(tl.float32)[None, :]).to(dt)
        wmask = kmask[:, None] & jmask[None, :]
        wa = tl.load(w_ptr + ca64[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wb = tl.load(w_ptr + cb64[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
        acc_a = tl.dot(a, wa, acc_a, input_precision=DOT_PREC)
        acc_b = tl.dot(a, wb, acc_b, input_precision=DOT_PREC)
    dt = o_ptr.dtype.element_ty
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + col_a, mask=jmask, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(b_ptr + col_b, mask=jmask, other=0.0).to(tl.float32)[None, :]
    ya = acc_a.to(dt).to(tl.float32)  # the projection's values, as F.linear rounds them
    yb = acc_b.to(dt).to(tl.float32)
    omask = mmask[:, None] & jmask[None, :]
    if EPI == _ROPE:
        # row m is token (m // n_tok, m % n_tok) of the [B, n] window
        crow = (rm // n_tok).to(tl.int64) * scb + (rm % n_tok).to(tl.int64) * sct
        if ROPE_POS:  # cos_ptr: its positions, sin_ptr: the inverse frequencies [HALF]; the angle as rope_tables forms
            pos = tl.load(cos_ptr + crow, mask=mmask, other=0).to(tl.float32)  # it (one fp32 product), both halves
            ang = pos[:, None] * tl.load(sin_ptr + j, mask=jmask, other=0.0)[None, :]  # alike (emb = cat(f, f))
            c1 = tl.cos(ang)
            s1 = tl.sin(ang)
            c2 = c1
            s2 = s1
        else:  # its cos / sin table row holds D = 2 HALF values
            c_off = crow[:, None] + j[None, :]
            c1 = tl.load(cos_ptr + c_off, mask=omask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + c_off + HALF, mask=omask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + c_off, mask=omask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + c_off + HALF, mask=omask, other=0.0).to(tl.float32)
        if ROPE_FP32:
            o1 = ya * c1 - yb * s1
            o2 = yb * c2 + ya * s2
        else:  # each product and the sum rounded to the storage dtype, as the reference's elementwise ops
            c1 = c1.to(dt).to(tl.float32)
            c2 = c2.to(dt).to(tl.float32)
            s1 = s1.to(dt).to(tl.float32)
            s2 = s2.to(dt).to(tl.float32)
            o1 = (ya * c1).to(dt).to(tl.float32) - (yb * s1).to(dt).to(tl.float32)
            o2 = (yb * c2).to(dt).to(tl.float32) + (ya * s2).to(dt).to(tl.float32)
        rot = head < rot_heads
        out_a = tl.where(rot, o1, ya).to(dt)
        out_b = tl.where(rot, o2, yb).to(dt)
        tl.store(o_ptr + rm64[:, None] * out_cols + ca64[None, :], out_a, mask=omask)
        tl.store(o_ptr + rm64[:, None] * out_cols + cb64[None, :], out_b, mask=omask)
    else:
        act = (ya / (1.0 + tl.exp(-ya))).to(dt)
        out = (act.to(tl.float32) * yb).to(dt)
        tl.store(o_ptr + rm64[:, None] * out_cols + ca64[None, :], out, mask=omask)


def tiles_for(M: int, half: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). GPU: 16-64 rows (a round's M is 32-300), 64 x 64 weight tiles per column set,
    narrower when a RoPE half-head is (Qwen2.5-0.5B: D = 64, 32 columns); fp32 32 x 32 (its IEEE dot on the FMA
    units spills wider on sm_90). Interpreter (CPU tests): wide tiles, each step a numpy matmul."""
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    cap = 64 if is_interpreter() or dtype != torch.float32 else 32
    block_n = max(16, min(cap, triton.next_power_of_2(half)))  # tl.dot needs N >= 16
    return block_m, block_n, cap


def norm_linear(x: torch.Tensor, weight: torch.Tensor, epilogue: str, norm_weight=None, residual=None,
                eps: float = 1e-6, bias=None, cos=None, sin=None, rot_heads: int = 0, rope_fp32: bool = False,
                positions=None, inv_freq=None, tiles=None):
    """x [..., K] (residual the same shape; "rope": [..., n, K], cos / sin fp32 [n, D] or [..., n, D] with one
    stride set, or instead positions int [n] or [B, n] and inv_freq fp32 [D / 2]), weight [N, K], norm_weight [K],
    bias [N] (one dtype, last dims contiguous) -> (out, s): out contiguous [..., N // 2] ("swiglu") or [..., N]
    ("rope"), s = x + residual contiguous [..., K] or None.
    tiles (BLOCK_M, BLOCK_N, BLOCK_K): None = the launcher's choice (tests force them)."""
    K = x.shape[-1]
    N = weight.shape[0]
    epi = EPILOGUES.index(epilogue)
    rope = epilogue == "rope"
    by_pos = rope and positions is not None  # the kernel forms cos / sin from positions x inv_freq
    half = (inv_freq.shape[0] if by_pos else cos.shape[-1] // 2) if rope else N // 2
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    r2 = residual.reshape(-1, K) if residual is not None else x2
    if r2.stride(1) != 1:
        r2 = r2.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    M = x2.shape[0]
    out_cols = N if rope else half
    out = torch.empty((*x.shape[:-1], out_cols), dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if M == 0 or out_cols == 0:
        return out, s
    BM, BN, BK = tiles or tiles_for(M, half, x.dtype)
    col_tiles = triton.cdiv(half, BN)
    n_col = col_tiles * (N // (2 * half)) if rope else col_tiles
    if by_pos:
        cos, sin = positions, inv_freq.contiguous()
        n_tok, scb, sct = x.shape[-2], (positions.stride(0) if positions.dim() == 2 else 0), positions.stride(-1)
    elif rope:
        if cos.stride() != sin.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        n_tok, scb, sct = x.shape[-2], (cos.stride(0) if cos.dim() == 3 else 0), cos.stride(-2)
    else:
        cos = sin = x2
        n_tok, scb, sct = 1, 0, 0
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: IEEE, not TF32 (parity with F.linear)
    _norm_linear_kernel[(triton.cdiv(M, BM), n_col)](
        x2, r2, s if s is not None else out, norm_weight if norm_weight is not None else x2, weight,
        bias if bias is not None else x2, out, cos, sin,
        M, K, half, col_tiles, out_cols, x2.stride(0), r2.stride(0), weight.stride(0), n_tok, scb, sct,
        int(rot_heads), float(eps),
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None, EPI=epi,
        ROPE_FP32=bool(rope_fp32), ROPE_POS=by_pos, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, DOT_PREC=prec,
        num_warps=NUM_WARPS[epilogue], num_stages=3, enable_fp_fusion=False,
    )
    return out, s
