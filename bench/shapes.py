"""Benchmark shapes, named after the model and decoding configuration they come from.

Dream-7B (Qwen2.5-7B geometry, docs/semantics.md section 1): 28 query heads, 4 KV heads, head_dim 128,
vocab 152,064, bf16. LoPA rounds verify 1, 3, 5, 9 (and up to 16) branch windows of 32-128 positions
(block 32, 1-4 active blocks) over a committed prefix of 512-2048 tokens.
H200 ceilings measured on the device machine (docs/toolchain.md section 7): ~4.3 TB/s copy, ~790 TFLOP/s bf16 GEMM.
"""
from __future__ import annotations

DREAM_7B = dict(num_heads=28, num_kv_heads=4, head_dim=128, vocab_size=152064)
H200_GBPS = 4300.0
H200_TFLOPS_BF16 = 790.0

# name -> (branches B, window n, prefix length L)
ATTENTION = {
    "dream7b_B1_n32_L512": (1, 32, 512),  # plain D2F round, short prompt
    "dream7b_B3_n32_L2048": (3, 32, 2048),  # LoPA branching_factor 2
    "dream7b_B9_n32_L2048": (9, 32, 2048),  # LoPA branching_factor 8
    "dream7b_B16_n32_L2048": (16, 32, 2048),
    "dream7b_B4_n128_L1024": (4, 128, 1024),  # 4 active blocks of 32
    "dream7b_B16_n128_L2048": (16, 128, 2048),
}

# Pooled attention (issue 15's batched round): name -> (requests R, branch rows per request, window n, prefix L).
# Each request owns a slot of one [S = R, L + 256, Hkv, D] pool; its rows attend to its slot only.
ATTENTION_POOLED = {
    "dream7b_R16x1_n32_L1024": (16, 1, 32, 1024),  # 16 D2F requests
    "dream7b_R4x5_n32_L1024": (4, 5, 32, 1024),  # 4 LoPA k=4 requests
    "dream7b_R8x5_n32_L2048": (8, 5, 32, 2048),
}

# name -> (rows N, vocab V): rows = branches x window positions whose logits a round reduces
CONFIDENCE = {
    "dream7b_N32_V152064": (32, 152064),  # one 32-token window
    "dream7b_N288_V152064": (288, 152064),  # 9 branches x 32
    "dream7b_N2048_V152064": (2048, 152064),  # 16 branches x 128
}

# name -> (branches B, window n, active blocks nb, lookahead n_look)
SELECT_ROUND = {
    "lopa_B3_n32": (3, 32, 1, 2),
    "lopa_B9_n64": (9, 64, 2, 8),
    "lopa_B16_n128": (16, 128, 4, 15),
}
