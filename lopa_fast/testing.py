"""Tiny random models and checkpoints for tests and benchmarks (no network, no real weights).

`tiny_hf_config` (lopa_fast.models.tiny) returns a config.json dict in the real checkpoints' format (Dream / qwen2 /
llada); `random_model` builds a seeded random model from it. Random tiny models have near-uniform softmax, so only
decoding fallbacks would ever run: `sharpen` scales the output head so that confident predictions (p_max > 0.9) occur,
which makes threshold accepts, multi-token rounds and lookahead wins reachable.
"""
from __future__ import annotations

import torch

from lopa_fast.models.config import parse_config
from lopa_fast.models.loading import build_model
from lopa_fast.models.tiny import tiny_hf_config  # noqa: F401  (re-exported: tests import it from here)
from lopa_fast.models.transformer import DecoderLM


def random_model(
    hf_config: dict,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    sharpen: float = 1.0,
    zero_mask_row: bool = True,
    std: float = 0.2,
) -> DecoderLM:
    """A seeded random model for `hf_config` (eval mode, no grad).

    sharpen: multiplies the output head (logit temperature 1/sharpen); 4-10 gives peaked softmaxes.
    zero_mask_row: zero the head row of the mask token (so argmax never emits the mask id); note the
    embedding row stays random so masks still carry information.
    """
    cfg = parse_config(hf_config)
    g = torch.Generator().manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_f." in name or name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        head = model.head_weight()
        if not cfg.tie_word_embeddings:
            head.mul_(sharpen)
            if zero_mask_row and cfg.mask_token_id is not None and cfg.mask_token_id < cfg.vocab_size:
                head[cfg.mask_token_id].zero_()
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model


def model_from_spec(hf: dict, random: dict) -> DecoderLM:
    """`random_model(tiny_hf_config(**hf), **random)` where hf holds "kind": the spec form the golden files
    (tests/golden/*.json "models") record."""
    hf = dict(hf)
    return random_model(tiny_hf_config(hf.pop("kind"), **hf), **random)


def weights_fingerprint(model) -> str:
    """16 hex digits of a SHA-256 over the fp32 weights in state_dict key order (golden files record it, so a
    change of `random_model` is detected instead of silently replaying other weights)."""
    import hashlib

    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def sdpa_forward(model, input_ids: torch.Tensor, past_layers: list, start: int, attn_mask=None):
    """A tiny model run the way upstream's HF modules run it (the golden makers' adapters): positions
    start..start+n, each layer's SDPA over [past K ; new K] (GQA by repeat_interleave), the plain layer's
    formulas otherwise. input_ids [1, n]; past_layers: per layer (K, V) [1, Hkv, start, D] or [] when empty;
    attn_mask: SDPA's mask over the start + n keys, passed as given (None = full). Returns (logits [1, n, V], the
    per-layer (K, V) [1, Hkv, start + n, D])."""
    import torch.nn.functional as F

    from lopa_fast.models.transformer import rms_norm

    cfg = model.config
    n = input_ids.shape[1]
    cos, sin = model.rope_tables(torch.arange(start, start + n))
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = F.embedding(input_ids, model.embed_weight())
    layers = []
    for i in range(cfg.num_layers):
        w = model.layer(i)
        x = rms_norm(h, w.attn_norm, cfg.rms_norm_eps)
        q = model._apply_rope(w.q(x).view(1, n, Hq, D), cos, sin).transpose(1, 2)
        k = model._apply_rope(w.k(x).view(1, n, Hkv, D), cos, sin).transpose(1, 2)
        v = w.v(x).view(1, n, Hkv, D).transpose(1, 2)
        if past_layers:
            pk, pv = past_layers[i]
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        layers.append((k, v))
        rep = Hq // Hkv
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=attn_mask)
        h = h + w.o(a.transpose(1, 2).reshape(1, n, Hq * D))
        x = rms_norm(h, w.mlp_norm, cfg.rms_norm_eps)
        h = h + w.down(F.silu(w.gate(x)) * w.up(x))
    h = rms_norm(h, model.final_norm_weight(), cfg.rms_norm_eps)
    return F.linear(h, model.head_weight()), layers


def peak_tensor_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """(the peak of live CPU tensor bytes allocated during `fn(*args, **kwargs)`, its result).

    Replays the allocator's own records (torch.profiler with profile_memory): every allocation and free in order, so
    the peak is deterministic. A sampled RSS growth is not: a 1 ms sampler on a busy 2-core CI machine saw +70 MiB
    of a 170 MiB peak, and glibc keeps freed pages, so a request's growth depends on the one before it.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, result
