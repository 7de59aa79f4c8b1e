"""Shared pieces of the reference decoders: token statistics (confidence), logit shift, round cap, clock.

Confidence formulas (the kernels in lopa_fast.ops match these exactly):

    probs       = softmax(processed logits) in float32 (float32 logits stay float32; bf16/fp16 are upcast,
                  where upstream runs the softmax in bf16 -- see docs/decoding.md, quirk table)
    processed   = logits (mask id set to -inf first when suppress_mask_token), then / T if T > 0, then the
                  top-p filter if top_p < 1 (removed entries -> float32 min), then the top-k filter
    x0, p       = argmax / max of probs at T = 0 (first index on ties); at T > 0 x0 ~ Categorical(probs)
                  and p = probs[x0]
    conf        default:     p
                margin:      p_top1 - p_top2           (sorted probs)
                neg_entropy: sum_v p_v * log(p_v + 1e-10)   (<= 0; higher = more confident)
"""
from __future__ import annotations

import time
import warnings

import torch

from lopa_fast.config import RoundCapError

NEG_ENTROPY_EPS = 1e-10


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row token choice and confidence, as upstream LoPA's `sample_tokens`.

    logits: [N, V] (any float dtype). Returns (conf [N] float32, x0 [N] int64, p [N] float32), where p is
    the probability that the D2F/LoPA skip threshold tests (p_max at T = 0, p(x0) at T > 0) and conf the
    `sampling_strategy` confidence (fallback choice, lookahead ranking, branch score).
    """
    x = logits.float()
    if suppress_token is not None:
        x = x.clone()
        x[..., suppress_token] = float("-inf")
    if temperature > 0:
        x = x / temperature
    if top_p is not None and top_p < 1:
        x = top_p_filter(x, top_p)
    if top_k is not None:
        x = top_k_filter(x, top_k)
    probs = torch.softmax(x, dim=-1)
    if temperature > 0:
        x0 = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        p = probs.gather(-1, x0[:, None]).squeeze(-1)
    else:
        p, x0 = probs.max(dim=-1)
    if sampling_strategy == "margin":
        top2 = torch.sort(probs, dim=-1, descending=True).values[..., :2]
        conf = top2[..., 0] - top2[..., 1]
    elif sampling_strategy == "neg_entropy":
        conf = torch.sum(probs * torch.log(probs + NEG_ENTROPY_EPS), dim=-1)
    elif sampling_strategy == "default":
        conf = p.clone()
    else:
        raise ValueError(f"sampling_strategy={sampling_strategy!r}; allowed: 'default', 'margin', 'neg_entropy'")
    return conf, x0, p


def shift_logits(raw: torch.Tensor, last_logit: torch.Tensor | None) -> torch.Tensor:
    """Dream alignment for one window: raw [n, V] (raw[i] predicts window position i+1) -> shifted [n, V]
    with shifted[i] predicting window position i. shifted[0] = last_logit (the stale raw logit saved when
    the previous span was cached) or the constant 1.0 when there is none (upstream; never read in practice).
    """
    out = torch.empty_like(raw)
    out[1:] = raw[:-1]
    if last_logit is not None:
        out[0] = last_logit
    else:
        out[0] = 1.0
    return out


def make_generator(cfg, device) -> torch.Generator | None:
    """A seeded generator when cfg.seed is set (T > 0 sampling, random remasking), else None (global RNG)."""
    if cfg.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(cfg.seed))
    return g


def round_cap_hit(cfg, stats: dict, where: str) -> None:
    """Record that a loop stopped at cfg.max_rounds; warn, or raise RoundCapError if asked."""
    stats["hit_round_cap"] = True
    msg = (
        f"{where}: stopped at the round cap max_rounds={cfg.max_rounds} before decoding finished; "
        "unfilled positions keep the mask id (stats['masks_left']). Raise max_rounds, or pass "
        "suppress_mask_token=True if the model keeps predicting the mask token"
    )
    if cfg.on_round_cap == "error":
        raise RoundCapError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def record_step(trace: list | None, round_: int, before: torch.Tensor, x: torch.Tensor, P: int, **extra) -> None:
    """Append a trace entry {round, accepted: [[position - P, token], ...], **extra} for the positions that
    left the mask state between `before` and `x` (vanilla / threshold; a position "filled" with the mask id
    itself stays masked and is not listed)."""
    if trace is None:
        return
    mask_id = extra.pop("mask_id")
    pos = ((before == mask_id) & (x != mask_id)).nonzero(as_tuple=True)[0]
    trace.append({"round": round_, "accepted": [[int(q) - P, int(x[q])] for q in pos], **extra})


class Clock:
    """Wall time of a decoding loop (synchronizes the device at both ends)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self._sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.t0
        return False
