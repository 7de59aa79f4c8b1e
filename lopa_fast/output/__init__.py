"""`GenerateOutput`: what every strategy and backend returns.

Its stats keys (forwards: the TPF denominator; model_calls, generated_tokens, tokens_until_eos, tpf, tpf_until_eos,
upstream_steps, seconds, tokens_per_second, hit_round_cap, masks_left, strategy, backend, and each strategy's own
counters) are defined once, in docs/decoding.md "Stats"; tests use the strategy-specific ones as coverage counters.
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
