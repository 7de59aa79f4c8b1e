"""Compile-time constants of kernels/cuda/*.cu, defined here once.

The .cu sources read every tile size and code below as a preprocessor define (`defines()`, passed as -D flags
to NVRTC, nvcc and the host emulation's g++), and the launch maths (lopa_fast.ops.cuda.launch) reads the same
names, so the host and the kernels cannot drift apart.
"""
from __future__ import annotations

import torch

from lopa_fast.reference.attention_modes import code_defines

OPS = ("branch_attention", "confidence", "head_confidence", "select_round")
# the .cu entry points are instantiated for these storage dtypes (name suffix) and attention head dims
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
HEAD_DIMS = (64, 128)

# branch_attention, SIMT kernel (fp32): kWarps warps x kRowsPerWarp query rows per CTA, 32-key tiles (a key per lane)
ATTN_WARPS, ATTN_ROWS_PER_WARP, ATTN_KEYS = 4, 8, 32
ATTN_ROWS = ATTN_WARPS * ATTN_ROWS_PER_WARP
ATTN_THREADS = 32 * ATTN_WARPS
# branch_attention, tensor-core kernel (bf16/fp16): one m16 row block per warp, 64-key tiles
MMA_WARPS, MMA_KEYS = 4, 64
MMA_ROWS = 16 * MMA_WARPS
MMA_THREADS = 32 * MMA_WARPS
# confidence: threads per CTA (one CTA per row or per (row, V split))
CONF_THREADS = 256
# head_confidence: threads per CTA (one vocabulary column each per tile) and hidden rows per CTA
# (HC_ROWS * 32 == HC_THREADS: the staged hidden tile is one element per thread)
HC_THREADS, HC_ROWS = 256, 8
# confidence / head_confidence split workspaces: floats per (row, split) state (vocab_stats.cuh `Stats`: m, s, t1, t2,
# i1); head_confidence appends one more (the split's non-finite count)
VOCAB_WS_WORDS = 5
# select_round: threads of its one CTA (element-wise phases spread over them; thread 0 runs the ordered steps)
SR_THREADS = 128
# select_round: its tensors (the op's inputs, reference order, then SelectRound's fields), whose data pointers the
# kernel takes by value as one struct parameter of SR_INPUTS + SR_OUTPUTS pointers (504 bytes; CUDA's limit: 4 KB)
SR_INPUTS, SR_OUTPUTS = 35, 28
SR_PTRS = SR_INPUTS + SR_OUTPUTS


def defines() -> dict[str, int]:
    """Every macro the .cu sources read: the mode codes of lopa_fast.reference.attention_modes plus the tiles."""
    return {
        **code_defines(),
        "LOPA_ATTN_WARPS": ATTN_WARPS,
        "LOPA_ATTN_ROWS_PER_WARP": ATTN_ROWS_PER_WARP,
        "LOPA_ATTN_KEYS": ATTN_KEYS,
        "LOPA_MMA_WARPS": MMA_WARPS,
        "LOPA_MMA_KEYS": MMA_KEYS,
        "LOPA_CONF_THREADS": CONF_THREADS,
        "LOPA_HC_THREADS": HC_THREADS,
        "LOPA_HC_ROWS": HC_ROWS,
        "LOPA_VOCAB_WS_WORDS": VOCAB_WS_WORDS,
        "LOPA_SR_THREADS": SR_THREADS,
        "LOPA_SR_INPUTS": SR_INPUTS,
        "LOPA_SR_OUTPUTS": SR_OUTPUTS,
    }


def define_flags() -> list[str]:
    """`defines()` as compiler flags ["-DNAME=VALUE", ...] (sorted: part of the cubin cache key)."""
    return [f"-D{k}={v}" for k, v in sorted(defines().items())]
