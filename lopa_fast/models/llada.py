"""LLaDA family (LLaDA-8B-{Base,Instruct}, LLaDA-1.5, dParallel-LLaDA): bidirectional, unshifted logits.

Parameter names are the checkpoint's (`model.transformer.blocks.N.q_proj.weight`, ...). From the
public modeling_llada.py (LLaDALlamaBlock): x = x + attn_out(attn(attn_norm(x))); then
x = x + ff_out(silu(ff_proj(ff_norm(x))) * up_proj(ff_norm(x))) -- ff_proj is the gate, up_proj the up.
RoPE is rotate-half, applied in full precision (`rope_full_precision=True`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lopa_fast.models.config import ModelConfig
from lopa_fast.models.transformer import DecoderLM, LayerWeights


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size  # noqa: E741 (I: MLP width)
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=bias)
        self.attn_out = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.ff_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.ff_out = nn.Linear(I, H, bias=False)
        self.attn_norm = _Norm(H)
        self.ff_norm = _Norm(H)


class _Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = _Norm(cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.ff_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class _Wrapper(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.transformer = _Transformer(cfg)


class LLaDAModel(DecoderLM):
    rope_in_fp32 = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kind != "llada":
            raise ValueError(f"LLaDAModel: config kind {cfg.kind!r} is not 'llada'")
        self.config = cfg
        self.model = _Wrapper(cfg)

    def embed_weight(self):
        return self.model.transformer.wte.weight

    def head_weight(self):
        t = self.model.transformer
        return t.wte.weight if self.config.tie_word_embeddings else t.ff_out.weight

    def final_norm_weight(self):
        return self.model.transformer.ln_f.weight

    def layer(self, i: int) -> LayerWeights:
        b = self.model.transformer.blocks[i]
        return LayerWeights(
            b.attn_norm.weight, b.q_proj, b.k_proj, b.v_proj, b.attn_out,
            b.ff_norm.weight, b.ff_proj, b.up_proj, b.ff_out,
        )
