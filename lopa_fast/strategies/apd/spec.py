"""apd: Adaptive Parallel Decoding (docs/semantics.md "APD"): a Dream-family dLLM drafts, a small causal AR model
(the verifier, `generate(..., verifier=)`) accepts the longest prefix the mixture agrees with; without a verifier
the leftright baseline commits tokens_per_step per step. Its default sampler is upstream's draw order (for
exactness with upstream at T > 0); the fast path draws with sampler='keyed'."""
from __future__ import annotations

from lopa_fast.request.knobs import check_bool, check_number, check_positive_int, check_prob
from lopa_fast.request.model_pairs import check_apd_pair as check_models  # the pair checks, shared with the oracle
from lopa_fast.strategies.apd.knobs import ApdKnobs
from lopa_fast.strategies.registry import SOLO, Strategy, register

KNOBS = ("apd_mixture_weight", "kv_window", "max_lookahead", "tokens_per_step", "single_temperature",
         "coupled_gumbel", "exact_prev_logits")  # R, W, M, the leftright baseline's K, the opt-in fixes of Q1-Q3
FIXES = ("single_temperature", "coupled_gumbel", "exact_prev_logits")


def validate(cfg) -> None:
    check_prob("apd_mixture_weight", cfg.apd_mixture_weight, allow_none=True)
    check_number("kv_window", cfg.kv_window, allow_none=True, integer=True)
    if cfg.kv_window is not None and cfg.kv_window < 0:
        raise ValueError(f"kv_window={cfg.kv_window!r}; allowed: an int >= 0 (recomputed positions) or None (no cache)")
    check_positive_int("max_lookahead", cfg.max_lookahead, allow_none=True)
    check_positive_int("tokens_per_step", cfg.tokens_per_step, allow_none=True)
    for name in FIXES:
        if getattr(cfg, name) is not None:
            check_bool(name, getattr(cfg, name))
    if cfg.apd_mixture_weight is not None and cfg.tokens_per_step is not None:
        raise ValueError(
            f"tokens_per_step={cfg.tokens_per_step!r} applies to the verifier-free leftright baseline "
            f"(apd_mixture_weight=None); with apd_mixture_weight={cfg.apd_mixture_weight!r} the verifier decides "
            "how many tokens each step accepts"
        )
    if cfg.apd_mixture_weight is None:
        for name in ("coupled_gumbel", "exact_prev_logits"):
            if getattr(cfg, name):
                raise ValueError(f"{name}=True applies to APD with a verifier; apd_mixture_weight=None (leftright) has none")
    k = cfg.tokens_per_step or 1
    if cfg.max_lookahead is not None and k > cfg.max_lookahead:
        raise ValueError(
            f"tokens_per_step={k} > max_lookahead={cfg.max_lookahead}: a step cannot commit more tokens than the "
            "lookahead window drafts; allowed: tokens_per_step <= max_lookahead"
        )


def resolve(cfg, model):
    return cfg.replace(**{name: bool(getattr(cfg, name)) for name in FIXES})


# upstream's Pareto presets (R, W, M) for 256 new tokens, plus R = 0.9 at the second preset's (W, M)
UPSTREAM_PRESETS = {"apd-r0.6": (0.6, 32, 200), "apd-r0.7": (0.7, 16, 100), "apd-r0.9": (0.9, 16, 100)}


def eval_rows(block_size: int, gen_len: int) -> dict[str, dict]:
    """The eval's rows: the presets with kv_window W and max_lookahead M scaled by gen_len / 256 (rounded half up:
    12.5 -> 13); block knobs do not apply."""
    scaled = lambda v: int(v * gen_len / 256 + 0.5)  # noqa: E731
    return {name: dict(strategy="apd", apd_mixture_weight=R, kv_window=scaled(W), max_lookahead=scaled(M))
            for name, (R, W, M) in UPSTREAM_PRESETS.items()}


def cache_rows(prompt_len: int, cfg) -> int:
    """The drafter's static cache (kv_window given) or none; the verifier's cache is the request's own."""
    from lopa_fast.strategies.apd.driver import cache_rows as rows

    return rows(prompt_len, cfg)


SPEC = register(Strategy(
    name="apd", summary="APD: a dLLM drafts, a causal AR verifier accepts the agreeing prefix",
    reference="lopa_fast.strategies.apd.reference:generate", fast=SOLO, knobs=KNOBS, knob_class=ApdKnobs,
    validate=validate, resolve=resolve, driver="lopa_fast.strategies.apd.driver:FastApd", cache_rows=cache_rows,
    compile=True, compile_batches=True, default_sampler="upstream", check_models=check_models,
    verifier_knob="apd_mixture_weight", eval_rows=eval_rows,
))  # fmt: skip
