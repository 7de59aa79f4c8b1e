"""`GenerateOutput`: what every strategy and backend returns.

Stats keys (docs/architecture.md section 5, docs/decoding.md "Stats"; every backend fills at least the first block):

    forwards          rounds with a verification forward (the paper's TPF denominator; a LoPA round with
                      k+1 branches is ONE forward). Parity checks compare this number.
    model_calls       model forward calls actually issued (reference LoPA: one per branch per round;
                      vanilla with cfg_scale > 0: one batched call per step).
    generated_tokens  len(generated_ids): every generated position, EOS and post-EOS filler included
                      (what upstream Dream/LoPA scripts count).
    tokens_until_eos  generated positions up to and including the first EOS (all of them if no EOS).
    tpf               generated_tokens / forwards (0.0 when forwards == 0).
    tpf_until_eos     tokens_until_eos / forwards.
    upstream_steps    forwards + 1 for d2f / lopa (upstream's `steps_taken` counts the terminating check);
                      forwards for vanilla / threshold (their loops count forwards).
    seconds           wall time of the decoding loop (host clock, after a device synchronize).
    tokens_per_second generated_tokens / seconds.
    hit_round_cap     True when the loop stopped at the round cap (`max_rounds`) before finishing.
    masks_left        mask tokens left in generated_ids (non-zero only when the cap was hit).
    strategy, backend the names that ran.

Strategy-specific keys (e.g. `lookahead_wins`, `accepted_by_threshold`, `fallback_fills`) are documented
in docs/decoding.md; tests use them as coverage counters.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from lopa_fast.errors import RoundCapError


@dataclass
class GenerateOutput:
    """Result of `lopa_fast.generate`.

    generated_ids: list[int], every generated position (upstream returns x[P:]), EOS and post-EOS included.
    stats:         dict (see module docstring).
    trace:         list of per-round dicts when `return_trace=True`, else None. Round dict keys (d2f/lopa):
                   round, window_start, window_len, cached (u), branches (list of per-branch dicts with
                   `score`, `lookahead` position or None, `window_len`), winner (index into branches),
                   accepted (list of [position, token]; positions are relative to the prompt end).
                   vanilla / threshold: one entry per forward with round and accepted.
    text:          the answer's text (ids before the first EOS, decoded, cut before the first text stop) when
                   generate had a tokenizer (`tokenizer=`, or a str prompt / text stop), else None.
    """

    generated_ids: list[int]
    stats: dict = field(default_factory=dict)
    trace: list | None = None
    text: str | None = None

    def __len__(self) -> int:
        return len(self.generated_ids)


def finalize_stats(
    stats: dict,
    generated_ids: list[int],
    eos_token_id: int | None,
    mask_token_id: int | None,
    seconds: float,
    *,
    steps_plus_one: bool,
) -> dict:
    """Fill the derived stats (tokens, tpf, until-EOS counts, speed) from the raw counters.

    stats must already hold `forwards` and `model_calls`.
    """
    fw = int(stats.get("forwards", 0))
    n = len(generated_ids)
    until = generated_ids.index(eos_token_id) + 1 if eos_token_id is not None and eos_token_id in generated_ids else n
    stats["generated_tokens"] = n
    stats["tokens_until_eos"] = until
    stats["tpf"] = n / fw if fw else 0.0
    stats["tpf_until_eos"] = until / fw if fw else 0.0
    stats["upstream_steps"] = fw + 1 if steps_plus_one else fw
    stats["seconds"] = float(seconds)
    stats["tokens_per_second"] = n / seconds if seconds > 0 else 0.0
    stats.setdefault("hit_round_cap", False)
    stats["masks_left"] = sum(1 for t in generated_ids if t == mask_token_id) if mask_token_id is not None else 0
    return stats


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
