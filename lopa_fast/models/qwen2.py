"""Qwen2 family: Dream, DiffuCoder, D2F-* (LoRA merged at load) and Qwen2.5 causal AR.

Parameter names are exactly the HF checkpoint names (`model.layers.N.self_attn.q_proj.weight`, ...),
so a checkpoint's state dict loads as is. Attention and logit alignment follow `config.kind`:
"dream" = bidirectional + shifted logits, "qwen2" = causal + shifted logits.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lopa_fast.models.config import ModelConfig
from lopa_fast.models.transformer import DecoderLM, LayerWeights


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=True)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=True)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741 (I: MLP width)
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp = _MLP(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(cfg.hidden_size))


class Qwen2Model(DecoderLM):
    rope_in_fp32 = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kind not in ("dream", "qwen2"):
            raise ValueError(f"Qwen2Model: config kind {cfg.kind!r} is not in the Qwen2 family")
        self.config = cfg
        self.model = _Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed_weight(self):
        return self.model.embed_tokens.weight

    def head_weight(self):
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def final_norm_weight(self):
        return self.model.norm.weight

    def layer(self, i: int) -> LayerWeights:
        m = self.model.layers[i]
        a, f = m.self_attn, m.mlp
        return LayerWeights(
            m.input_layernorm.weight, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
            m.post_attention_layernorm.weight, f.gate_proj, f.up_proj, f.down_proj,
        )
