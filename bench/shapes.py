"""Benchmark shapes, named after the model and decoding configuration they come from.

Dream-7B (Qwen2.5-7B geometry, docs/semantics.md section 1): 28 query heads, 4 KV heads, head_dim 128,
vocab 152,064, bf16. LoPA rounds verify 1, 3, 5, 9 (and up to 16) branch windows of 32-128 positions
(block 32, 1-4 active blocks) over a committed prefix of 512-2048 tokens.
H200 ceilings measured on the device machine (docs/toolchain.md section 7): ~4.3 TB/s copy, ~790 TFLOP/s bf16 GEMM.
"""
from __future__ import annotations

DREAM_7B = dict(num_heads=28, num_kv_heads=4, head_dim=128, vocab_size=152064)

# ---- the models users run, at full width (issue 33): `lopa_fast.testing.tiny_hf_config` arguments, num_layers the
# real depth (benchmarks build them at reduced depth and scale the per-layer counts; bench/bench_real_shapes.py).
# Values: the public config.json files (docs/checkpoints.md; Qwen2.5 geometry for the Dream family).
REAL_SHAPES = {
    # Dream-v0-7B, D2F-Dream (Dream + merged LoRA), DiffuCoder-7B: Qwen2.5-7B geometry, untied head
    "dream7b": dict(kind="dream", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                    num_heads=28, num_kv_heads=4, max_position_embeddings=4096, rope_theta=1e6),
    # LLaDA-8B (Base / Instruct / 1.5, dParallel-LLaDA): MHA, SwiGLU FFN 12288, untied head, no logits shift
    "llada8b": dict(kind="llada", vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_layers=32,
                    num_heads=32, num_kv_heads=32, max_position_embeddings=4096, rope_theta=5e5),
    # Qwen2.5-0.5B: APD's causal verifier, tied embedding / head
    "qwen25_05b": dict(kind="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                       num_heads=14, num_kv_heads=2, max_position_embeddings=4096, rope_theta=1e6,
                       tie_word_embeddings=True),
}


def streamed_params(shape: dict) -> int:
    """Weights one forward streams (every layer's projections + the LM head; the embedding is only gathered)."""
    H, I, L = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    D = H // shape["num_heads"]
    q = H * shape["num_heads"] * D
    kv = 2 * H * shape["num_kv_heads"] * D
    per_layer = 2 * q + kv + 3 * H * I  # q and o, k and v, gate / up / down
    return L * per_layer + shape["vocab_size"] * H


def kv_bytes_per_token(shape: dict, elt: int = 2) -> int:
    return shape["num_layers"] * 2 * shape["num_kv_heads"] * (shape["hidden_size"] // shape["num_heads"]) * elt
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
