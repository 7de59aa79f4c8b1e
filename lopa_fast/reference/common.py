"""Shared pieces of the reference decoders: logit shift, the draws' keys, trace records, the numerics guard.

Token statistics live in `lopa_fast.sampling` (shared with the fast path), the clock and the round-cap
rule in `lopa_fast.output`, the request's noise (`request_noise`: KeyedNoise under sampler="keyed", upstream's
torch.Generator / None under sampler="upstream") in `lopa_fast.keyed`; they are re-exported here for the reference
decoders.
"""
from __future__ import annotations

import torch

from lopa_fast.keyed import TOKEN, KeyedNoise, request_noise  # noqa: F401  (request_noise: re-exported)
from lopa_fast.output import Clock, round_cap_hit  # noqa: F401  (re-exported)
from lopa_fast.sampling import token_stats, top_k_filter, top_p_filter  # noqa: F401


def shift_logits(raw: torch.Tensor, last_logit: torch.Tensor | None) -> torch.Tensor:
    """Dream alignment for one window: raw [n, V] (raw[i] predicts window position i+1) -> shifted [n, V]
    with shifted[i] predicting window position i. shifted[0] = last_logit (the stale raw logit saved when
    the previous span was cached) or the constant 1.0 when there is none (upstream; never read in practice).
    """
    out = torch.empty_like(raw)
    out[1:] = raw[:-1]
    out[0] = last_logit if last_logit is not None else 1.0
    return out


def draw_kw(noise, cfg, stream: int, step: int, branch: int, pos) -> dict:
    """`generator=` / `keys=` for one draw site: keyed keys at (stream, step, branch, pos) when `noise` is
    KeyedNoise and the site draws (T > 0 for the token stream), else the upstream generator."""
    if isinstance(noise, KeyedNoise):
        draws = stream != TOKEN or cfg.temperature > 0
        return {"generator": None, "keys": noise.keys(stream, step, branch, pos) if draws else None}
    return {"generator": noise, "keys": None}


def record_step(trace: list | None, round_: int, before: torch.Tensor, x: torch.Tensor, P: int, **extra) -> None:
    """Append a trace entry {round, accepted: [[position - P, token], ...], **extra} for the positions that
    left the mask state between `before` and `x` (vanilla / threshold; a position "filled" with the mask id
    itself stays masked and is not listed)."""
    if trace is None:
        return
    mask_id = extra.pop("mask_id")
    pos = ((before == mask_id) & (x != mask_id)).nonzero(as_tuple=True)[0]
    trace.append({"round": round_, "accepted": [[int(q) - P, int(x[q])] for q in pos], **extra})


def check_finite(rows: torch.Tensor, positions, cfg, round_: int, strategy: str | None = None) -> None:
    """The numerics guard: raise NonFiniteLogitsError when a raw logits row a strategy reads (rows [N, V], before
    any deliberate -inf) holds NaN / inf, naming the strategy, the round and the sequence position
    (`positions`: [N] absolute positions, or the first position of a contiguous run). At T > 0 the rows scaled
    by 1 / T are checked too (a tiny temperature overflows finite logits), so torch.multinomial never sees NaN.
    Reads nothing when the rows are finite beyond one reduction (no token changes)."""
    x = rows.float()
    ok = torch.isfinite(x).all(dim=-1)
    if cfg.temperature > 0 and bool(ok.all()):
        ok = torch.isfinite(x / cfg.temperature).all(dim=-1)
    if bool(ok.all()):
        return
    from lopa_fast.errors import NonFiniteLogitsError

    r = int((~ok).nonzero()[0, 0]) if ok.dim() else 0
    row = x[r] if x.dim() > 1 else x
    bad = row[~torch.isfinite(row)]
    value = float(bad[0]) if bad.numel() else f"{float(row.abs().max())} / temperature {cfg.temperature}"
    pos = positions + r if isinstance(positions, int) else int(positions[r])
    raise NonFiniteLogitsError(strategy=strategy or getattr(cfg, "strategy", "?"), round=round_, position=pos,
                               value=value)
