"""Memory estimates of requests: `request_bytes` (one request's peak, the server's budget unit) and
`check_request_memory` (refuse a request whose estimate exceeds the device's memory)."""
from __future__ import annotations

from lopa_fast import strategies
from lopa_fast.config import GenerateConfig


def _first_param(model):
    """A tensor of the model's weights (its device, dtype and element size), or None: a DecoderLM's embedding weight
    (its parameters() generator left after one item is closed by a GeneratorExit raised through ~4 nested module
    generators: ~20 us of a tiny request, 4 reads a request), else the first of its parameters."""
    embed = getattr(model, "embed_weight", None)
    if callable(embed):
        return embed()
    params = getattr(model, "parameters", None)
    return next(iter(params()), None) if callable(params) else None


def device_of(model):
    """The device of the model's weights (the CPU for a model without parameters)."""
    p = _first_param(model)
    return p.device if p is not None else "cpu"


def _dims(model) -> tuple:
    """(element bytes of the weights, layers, kv heads, head dim, hidden, heads, intermediate, vocab) of a model."""
    c = model.config
    p = _first_param(model)
    n_heads = getattr(c, "num_heads", None) or getattr(c, "num_attention_heads", 0)
    return (p.element_size() if p is not None else 4, getattr(c, "num_layers", 0), getattr(c, "num_kv_heads", 0),
            getattr(c, "head_dim", 0), getattr(c, "hidden_size", 0), n_heads, getattr(c, "intermediate_size", 0),
            c.vocab_size)


def cache_bytes(model, total: int) -> int:
    """The static K/V cache of a request of `total` positions, every layer, in the weights' dtype, as big as its
    batch KV-pool slot (lopa_fast.decode.kv_pool): its buffer rounded up to the length quantum plus the trash row
    (lopa_fast.strategies.lopa.round), rounded up to the quantum again (slot lengths are multiples of it)."""
    from lopa_fast.decode.shapes import quantized_length

    e, n_layers, n_kv, d = _dims(model)[:4]
    return 2 * n_layers * quantized_length(quantized_length(total) + 1) * n_kv * d * e


def _forward_bytes(model, total: int, tokens: int, head_rows: int | None = None) -> int:
    """The peak of one forward of `tokens` tokens over `total` positions whose LM head runs on `head_rows` of them
    (None: every token), times the allocator's slack (see request_bytes)."""
    from lopa_fast.sampling import chunk_rows

    e, n_layers, n_kv, d, hidden, n_heads, inter, vocab = _dims(model)
    f = 4  # float32: logits, scores, softmax
    head_rows = tokens if head_rows is None else min(tokens, head_rows)
    per_token = (e * (6 * hidden + 2 * (n_heads + 2 * n_kv) * d + 4 * inter)  # one layer's transients
                 + 2 * f * n_heads * total  # attention scores and their softmax
                 + 2 * n_layers * n_kv * d * e  # the window's K / V, every layer
                 + 8 * 8)  # the round's long / bool tables
    # the LM head: its logits rows, and the statistics' softmax / entropy temporaries of one row chunk
    # (lopa_fast.sampling.STATS_CHUNK: the fast rounds' statistics never hold more than a chunk's)
    head = f * vocab * (head_rows + 5 * min(head_rows, chunk_rows(vocab)))
    slack = 3 / 2  # the allocator's: temporaries that overlap, fragmentation (measured peaks: 0.5-0.95 of this)
    return int((tokens * per_token + head) * slack)


def _tables(total: int, cfg: GenerateConfig) -> int:
    """The fast backend's [L, L / block_size] round tables (long)."""
    return 0 if cfg.backend == "reference" else total * (-(-total // max(1, cfg.block_size or 1))) * 8


def lane_bytes(model, total: int, cfg: GenerateConfig, verifier=None, spec=None) -> int:
    """One compiled-batch lane of a request (lopa_fast.decode.compiled_batch: a clone of its state and tables): its
    caches (the drafter's; APD: the verifier's too), its tables and its per-position state (tokens, positions,
    masks of every branch row; measured: the caches are 95% of a LoPA lane)."""
    from lopa_fast.decode.shapes import quantized_length

    rows = max(1, (spec or strategies.get(cfg.strategy)).rows(cfg))
    state = 16 * (rows + 8) * (quantized_length(total) + 1)
    vcache = cache_bytes(verifier, total) + 4 * verifier.config.vocab_size if verifier is not None else 0
    return cache_bytes(model, total) + vcache + _tables(total, cfg) + state


def compiles(model, cfg: GenerateConfig) -> bool:
    """Whether a request of this bound config runs compiled / captured steps (lopa_fast.decode.compiled)."""
    from lopa_fast.decode.compiled import compile_wanted

    return cfg.backend != "reference" and compile_wanted(cfg, device_of(model))


def resident_bytes(model, total: int, cfg: GenerateConfig, verifier=None, spec=None) -> int:
    """The part of `request_bytes` that the batch engine may hold beyond the request's own forward: its KV-pool
    slot (the cache term) and, for a compiled request, two compiled-batch lanes (a group of n requests runs padded
    to a power-of-two bucket of fewer than 2n lanes). lopa_fast.decode.batch.BatchEngine reports what its pools and
    lanes hold beyond the live requests' shares (the server's budget counts it)."""
    lanes = 2 * lane_bytes(model, total, cfg, verifier, spec) if compiles(model, cfg) else 0
    return cache_bytes(model, total) + lanes


def request_bytes(model, total: int, cfg: GenerateConfig, prompt_len: int | None = None, verifier=None,
                  spec=None) -> int:
    """An upper estimate of one request's peak memory (bytes) for `total` positions (prompt + generated blocks):

    * the static KV cache of the prefix (weights' dtype; `cache_bytes`);
    * one forward's tokens: every branch row (`strategies.get(cfg.strategy).rows(cfg)`; LoPA: k + 1) times its
      window (a prefix-cached fast decoder, `spec.cache_rows > 1`: the undecoded blocks, `total - prompt_len +`
      its length unit; otherwise every position), or the prompt alone (the prefill), whichever is more;
    * per forward token: one layer's transients (hidden states, q / k / v / attention output, the MLP's gate / up /
      product in the weights' dtype; the attention scores and their softmax against every position in float32),
      the window's K / V of every layer (kept until the round commits) and the round's long / bool tables over the
      buffer;
    * the LM head: float32 logits of its rows (the fast paths: only rows that predict an undecoded position, at
      most the new tokens + 1 per branch row; the reference: every token) and the softmax / entropy temporaries of
      one statistics chunk (`lopa_fast.sampling.STATS_CHUNK`);
    * the fast backend's [L, L / block_size] round tables;
    * APD with a verifier (`verifier`, the AR model; the strategy's `uses_verifier`): the verifier's own cache of
      `total` positions and its forward over the whole draft (its first step: every position), its logits included;
    * a compiled / captured request (`compiles`): two compiled-batch lanes (`lane_bytes`, `resident_bytes`).

    Measured against the allocator on CPU (tests/test_server_limits.py: peak RSS growth of a capped subprocess) it
    bounds the real peak, within about 2x, for large branching factors; on CUDA the same terms hold (activations in
    the weights' dtype, logits in float32; `stats["peak_memory_bytes"]` reports the real one). spec: the strategy's
    (the plan's; else looked up), as for every function here."""
    spec = spec or strategies.get(cfg.strategy)
    rows = max(1, spec.rows(cfg))
    P = total if prompt_len is None else max(1, min(prompt_len, total))
    # a prefix-cached fast decoder (its batch pool slot holds more than one cache row) forwards the undecoded
    # part and a block; a cache-free one (vanilla, threshold without cache) and the reference every position
    cache_rows = getattr(spec, "cache_rows", None)
    cached = cfg.backend != "reference" and cache_rows is not None and cache_rows(P, cfg) > 1
    window = min(total, total - P + max(1, spec.length_unit(cfg))) if cached else total
    tokens = max(P, rows * window)
    # the fast paths run the LM head on the rows that predict an undecoded position only: per branch row at most
    # the new tokens (+ 1: Dream's shifted row of the last cached position); the reference on every position
    head_rows = tokens if cfg.backend == "reference" else min(tokens, max(P, rows * (total - P + 1)))
    verifier = verifier if verifier is not None and spec.uses_verifier(cfg) else None
    verify = cache_bytes(verifier, total) + _forward_bytes(verifier, total, total) if verifier is not None else 0
    return (resident_bytes(model, total, cfg, verifier, spec) + _forward_bytes(model, total, tokens, head_rows)
            + _tables(total, cfg) + verify)


def check_request_memory(model, total: int, cfg: GenerateConfig, prompt_len: int | None = None,
                         verifier=None, spec=None) -> None:
    """Refuse (MemoryBudgetError naming max_new_tokens) a request whose estimate (`request_bytes`, APD's verifier
    included) exceeds the device's memory."""
    from lopa_fast.models.loading import check_memory

    check_memory(request_bytes(model, total, cfg, prompt_len, verifier, spec), device_of(model),
                 f"generate(max_new_tokens={cfg.max_new_tokens}, branching_factor={cfg.branching_factor}, "
                 f"backend={cfg.backend!r}): the cache, logits and tables of {total} positions")
