"""Memory estimates of requests: `request_bytes` (one request's peak, the server's budget unit) and
`check_request_memory` (refuse a request whose estimate exceeds the device's memory)."""
from __future__ import annotations

from lopa_fast import strategies
from lopa_fast.config import GenerateConfig


def _first_param(model):
    params = getattr(model, "parameters", None)
    return next(iter(params()), None) if callable(params) else None


def request_bytes(model, total: int, cfg: GenerateConfig, prompt_len: int | None = None) -> int:
    """An upper estimate of one request's peak memory (bytes) for `total` positions (prompt + generated blocks):

    * the static KV cache of the prefix (weights' dtype);
    * one forward's tokens: every branch row (`strategies.get(cfg.strategy).rows(cfg)`; LoPA: k + 1) times its
      window (a prefix-cached fast decoder, `spec.cache_rows > 1`: the undecoded blocks, `total - prompt_len +`
      its length unit; otherwise every position), or the prompt alone (the prefill), whichever is more;
    * per forward token: one layer's transients (hidden states, q / k / v / attention output, the MLP's gate / up /
      product in the weights' dtype; the attention scores and their softmax against every position in float32),
      the window's K / V of every layer (kept until the round commits), the float32 logits with their softmax /
      log-softmax / entropy temporaries, and the round's long / bool tables over the buffer;
    * the fast backend's [L, L / block_size] round tables.

    Measured against the allocator on CPU (tests/test_server_limits.py: peak RSS growth of a capped subprocess) it
    bounds the real peak, within about 2x, for large branching factors; on CUDA the same terms hold (activations in
    the weights' dtype, logits in float32; `stats["peak_memory_bytes"]` reports the real one)."""
    c = model.config
    p = _first_param(model)
    e = p.element_size() if p is not None else 4
    f = 4  # float32: logits, scores, softmax
    n_layers, n_kv, d = getattr(c, "num_layers", 0), getattr(c, "num_kv_heads", 0), getattr(c, "head_dim", 0)
    hidden = getattr(c, "hidden_size", 0)
    n_heads = getattr(c, "num_heads", None) or getattr(c, "num_attention_heads", 0)
    inter = getattr(c, "intermediate_size", 0)
    spec = strategies.get(cfg.strategy)
    rows = max(1, spec.rows(cfg))
    P = total if prompt_len is None else max(1, min(prompt_len, total))
    # a prefix-cached fast decoder (its batch pool slot holds more than one cache row) forwards the undecoded
    # part and a block; a cache-free one (vanilla, threshold without cache) and the reference every position
    cache_rows = getattr(spec, "cache_rows", None)
    cached = cfg.backend != "reference" and cache_rows is not None and cache_rows(P, cfg) > 1
    window = min(total, total - P + max(1, spec.length_unit(cfg))) if cached else total
    tokens = max(P, rows * window)
    cache = 2 * n_layers * (total + 1) * n_kv * d * e
    per_token = (e * (6 * hidden + 2 * (n_heads + 2 * n_kv) * d + 4 * inter)  # one layer's transients
                 + 2 * f * n_heads * total  # attention scores and their softmax
                 + 2 * n_layers * n_kv * d * e  # the window's K / V, every layer
                 + 4 * f * c.vocab_size  # logits, softmax, log-softmax, entropy
                 + 8 * 8)  # the round's long / bool tables
    tables = 0 if cfg.backend == "reference" else total * (-(-total // max(1, cfg.block_size or 1))) * 8
    slack = 3 / 2  # the allocator's: temporaries that overlap, fragmentation (measured peaks: 0.65-0.95 of this)
    return cache + int(tokens * per_token * slack) + tables


def check_request_memory(model, total: int, cfg: GenerateConfig, prompt_len: int | None = None) -> None:
    """Refuse (MemoryBudgetError naming max_new_tokens) a request whose estimate exceeds the device's memory."""
    from lopa_fast.models.loading import check_memory

    p = _first_param(model)
    device = p.device if p is not None else "cpu"
    check_memory(request_bytes(model, total, cfg, prompt_len), device,
                 f"generate(max_new_tokens={cfg.max_new_tokens}, branching_factor={cfg.branching_factor}, "
                 f"backend={cfg.backend!r}): the cache, logits and tables of {total} positions")  # fmt: skip
