"""Token statistics of logits rows: the one formula for the token choice and its confidence.

Used by the reference decoders and by the torch backend of the fast path (a neutral module: the fast
decoder and the kernels never import lopa_fast.reference).

Formulas (lopa_fast.ops.confidence and its kernels match these):

    probs       = softmax(processed logits) in float32 (float32 logits stay float32; bf16/fp16 are upcast,
                  where upstream runs the softmax in bf16 -- see docs/decoding.md, quirk table)
    processed   = logits (mask id set to -inf first when suppress_mask_token), then / T if T > 0, then the
                  top-p filter if top_p < 1 (removed entries -> float32 min), then the top-k filter
    x0, p       = argmax / max of probs at T = 0 (first index on ties); at T > 0 x0 ~ Categorical(probs)
                  and p = probs[x0]: drawn with the keyed sampler when `keys` is given
                  (lopa_fast.keyed.categorical: a pure function of the keys, no host read), else with
                  torch.multinomial on `generator` (upstream's draw order, sampler="upstream")
    conf        default:     p
                margin:      p_top1 - p_top2           (sorted probs)
                neg_entropy: sum_v p_v * log(p_v + 1e-10)   (<= 0; higher = more confident)
"""
from __future__ import annotations

from collections import namedtuple

import torch

from lopa_fast import keyed
from lopa_fast.request.knobs import SAMPLING_STRATEGIES

NEG_ENTROPY_EPS = 1e-10
# The fast rounds' torch statistics of LM-head rows run in row chunks of at most this many logits (fp32: 32 MiB):
# their softmax and entropy temporaries are a chunk's, not [R, V]'s (issue 43: LoPA k = 16 at a 131,072-id
# vocabulary peaked at +2.4 GiB, ~5 [R, V] fp32 tensors at once; now +0.55 GiB). Rows are independent, so the values
# are the unchunked ones, bit for bit. lopa_fast.memory counts one chunk's working set.
STATS_CHUNK = 1 << 23
ENTROPY_EPS = 1e-12  # Fast-dLLM / dParallel's entropy (float64, nats)

# ops.confidence: the token statistics of logits rows [R, V], each field [R] (every backend returns these fields)
Confidence = namedtuple("Confidence", ["token", "p_max", "margin", "neg_entropy", "lse"])
# ops.head_confidence: Confidence's fields of the logits rows hidden @ weight.T (never materialised) plus
# finite [R] bool: every raw logit of the row is finite (the round's numerics guard; a False row's statistics
# are meaningless and must not be decoded). neg_entropy is None when the op was asked for no entropy pass; logits
# [R, V] (hidden.dtype: the raw head values, before the suppression) when it was asked to keep them, else None.
HeadConfidence = namedtuple("HeadConfidence", ["token", "p_max", "margin", "neg_entropy", "lse", "finite", "logits"],
                            defaults=(None,))


def chunk_rows(V: int) -> int:
    """Rows per statistics chunk at a V-id vocabulary (`STATS_CHUNK`; at least one)."""
    return max(1, STATS_CHUNK // max(1, V))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter [N, V]: keep the smallest prefix of the sorted vocabulary whose cumulative probability
    exceeds top_p (the first token is always kept); the rest get the dtype's min (upstream: not -inf)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove_sorted = cum > top_p
    remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k logits per row (ties at the k-th value are kept); the rest get the dtype's min."""
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def token_stats(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    sampling_strategy: str = "default",
    suppress_token: int | None = None,
    generator: torch.Generator | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row token choice and confidence, as upstream LoPA's `sample_tokens`.

    logits: [N, V] (any float dtype). Returns (conf [N] float32, x0 [N] int64, p [N] float32), where p is
    the probability that the D2F/LoPA skip threshold tests (p_max at T = 0, p(x0) at T > 0) and conf the
    `sampling_strategy` confidence (fallback choice, lookahead ranking, branch score).
    keys: [N] int64 keyed-sampler keys (lopa_fast.keyed.key) of the rows; used at T > 0 instead of `generator`.
    temperature, top_p: floats, or 0-d float64 tensors (a compiled step's runtime inputs, lopa_fast.decode.shapes.knob:
    a tensor means T > 0 / the filter on, which the step's compile key says; the value is not a graph constant).
    """
    x = logits.float()
    if suppress_token is not None:
        x = x.clone()
        x[..., suppress_token] = float("-inf")
    sampling = is_on(temperature)
    if sampling:
        x = x / temperature
    if top_p is not None and (isinstance(top_p, torch.Tensor) or top_p < 1):
        x = top_p_filter(x, top_p)
    if top_k is not None:
        x = top_k_filter(x, top_k)
    if sampling_strategy not in SAMPLING_STRATEGIES:
        raise ValueError(f"sampling_strategy={sampling_strategy!r}; allowed: {SAMPLING_STRATEGIES}")
    probs = torch.softmax(x, dim=-1)
    if sampling:
        if keys is not None:
            x0 = keyed.categorical(probs, keys)
        else:
            x0 = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        p = probs.gather(-1, x0[:, None]).squeeze(-1)
    else:
        p, x0 = probs.max(dim=-1)
    if sampling_strategy == "margin":
        conf = prob_margin(probs)
    elif sampling_strategy == "neg_entropy":
        conf = prob_neg_entropy(probs)
    else:
        conf = p.clone()
    return conf, x0, p


def prob_margin(probs: torch.Tensor) -> torch.Tensor:
    """p_top1 - p_top2 per row of probs [N, V] -> [N] (top-2 of the multiset: an exact tie gives 0)."""
    top2 = torch.topk(probs, 2, dim=-1).values  # the same two values as upstream's full descending sort
    return top2[..., 0] - top2[..., 1]


def prob_neg_entropy(probs: torch.Tensor, eps: float = NEG_ENTROPY_EPS) -> torch.Tensor:
    """sum_v p_v * log(p_v + eps) per row of probs [N, V] -> [N] (<= 0; higher = more confident)."""
    return torch.sum(probs * torch.log(probs + eps), dim=-1)


def softmax_stats(x: torch.Tensor, eps: float = NEG_ENTROPY_EPS):
    """The temperature-0 statistics of `token_stats` for every strategy at once, on rows x [N, V] already in
    the compute dtype (suppressed ids already -inf): (token int64 [N], p_max [N], margin [N], neg_entropy [N]).
    The one formula behind `token_stats` and `lopa_fast.reference.ops.confidence` (kernels match it within
    the tests' tolerance rule)."""
    probs = torch.softmax(x, dim=-1)
    p_max, token = probs.max(dim=-1)
    return token, p_max, prob_margin(probs), prob_neg_entropy(probs, eps)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """bool [...]: every entry along the last dim of x [..., V] (a float tensor) is finite. x * 0 is +-0 for a finite
    entry and NaN for +-inf / NaN, and a sum of zeros is exactly 0: three plain ops where isfinite(x).all(-1) is a
    composite (~6 vs ~12 us on a tiny CPU round; the numerics guards' test)."""
    return (x * 0).sum(-1) == 0


def is_on(temperature) -> bool:
    """Whether a temperature samples: a float > 0, or a 0-d tensor (a runtime knob, passed only when T > 0: being
    on is part of the compile key, the value is not)."""
    return isinstance(temperature, torch.Tensor) or temperature > 0


def gumbel_argmax(logits: torch.Tensor, temperature, generator=None, keys=None) -> torch.Tensor:
    """LLaDA's sampler: argmax(exp(l) / (-log U)^T) in float64 (T = 0: plain argmax of the logits); U keyed
    (lopa_fast.keyed.gumbel_argmax) when `keys` [N] is given, else drawn from `generator`. temperature: a float or
    a 0-d tensor (`is_on`)."""
    if not is_on(temperature):
        return torch.argmax(logits, dim=-1)
    if keys is not None:
        return keyed.gumbel_argmax(logits, temperature, keys)
    l64 = logits.to(torch.float64)
    u = torch.rand(l64.shape, dtype=torch.float64, device=l64.device, generator=generator)
    return torch.argmax(l64.exp() / (-torch.log(u)) ** temperature, dim=-1)


def threshold_stats(
    logits: torch.Tensor, *, stats_in_float64: bool, temperature: float, top_p=None, top_k=None, suppress_token=None,
    generator=None, keys=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row statistics of a threshold (Fast-dLLM / dParallel) step, logits [n, V] already aligned:
    (x0 [n] int64, conf [n], entropy [n] float64 = -sum p log(p + 1e-12) of the float64 softmax).

    stats_in_float64 (LLaDA family, ModelConfig.stats_in_float64): x0 = argmax (LLaDA's float64 Gumbel-max at
    T > 0), conf = float64 softmax[x0] (Fast-dLLM).
    Else (Dream family): Dream's sampler (`token_stats`: temperature, top-p, top-k, fp32 softmax), conf = p(x0) in
    float32 (upstream compares the fp32 tensor with tau, which rounds to fp32).
    Used by lopa_fast.strategies.threshold.reference and lopa_fast.strategies.threshold.step alike."""
    if suppress_token is not None:
        logits = logits.clone()
        logits[:, suppress_token] = float("-inf")
    p64 = torch.softmax(logits.to(torch.float64), dim=-1)
    ent = -(p64 * torch.log(p64 + ENTROPY_EPS)).sum(-1)
    if stats_in_float64:
        x0 = gumbel_argmax(logits, temperature, generator, keys)
        conf = p64.gather(-1, x0[:, None]).squeeze(-1)
    else:
        conf, x0, _ = token_stats(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator,
                                  keys=keys)
    return x0, conf, ent


def head_confidence_outputs(R: int, device) -> HeadConfidence:
    """A head_confidence kernel's fresh outputs (the Triton and CUDA launchers'): token int64 [R]; p_max, margin,
    lse fp32 [R]; neg_entropy fp32 zeros [R] (the entropy pass, when asked, fills it); finite bool [R]."""
    f32 = [torch.empty(R, dtype=torch.float32, device=device) for _ in range(3)]
    return HeadConfidence(torch.empty(R, dtype=torch.int64, device=device), f32[0], f32[1],
                          torch.zeros(R, dtype=torch.float32, device=device), f32[2],
                          torch.empty(R, dtype=torch.bool, device=device))


def head_confidence_op_outputs(out: HeadConfidence, hidden: torch.Tensor, V: int, keep_logits: bool) -> tuple:
    """The 7 plain tensors a head_confidence custom op returns (the Triton and CUDA ops): a launcher's
    HeadConfidence with `logits` an empty [0, V] unless kept (an op cannot return None)."""
    return (*out[:6], out.logits if keep_logits else hidden.new_empty(0, V))


def head_confidence_fake(hidden, weight, suppress_token, eps, entropy, keep_logits) -> tuple:
    """The head_confidence custom ops' fake implementation: `head_confidence_op_outputs`' shapes and dtypes."""
    R = hidden.shape[0]
    f = [hidden.new_empty(R, dtype=torch.float32) for _ in range(4)]
    return (hidden.new_empty(R, dtype=torch.int64), *f, hidden.new_empty(R, dtype=torch.bool),
            hidden.new_empty(R if keep_logits else 0, weight.shape[0]))
