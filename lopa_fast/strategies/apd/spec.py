"""apd: Adaptive Parallel Decoding (docs/semantics.md "APD"): a Dream-family dLLM drafts, a small causal AR model
(the verifier, `generate(..., verifier=)`) accepts the longest prefix the mixture agrees with; without a verifier
the leftright baseline commits tokens_per_step per step. Its default sampler is upstream's draw order (for
exactness with upstream at T > 0); the fast path draws with sampler='keyed'."""
from __future__ import annotations

from lopa_fast.request.knobs import check_bool, check_number, check_positive_int, check_prob
from lopa_fast.strategies.apd.knobs import ApdKnobs
from lopa_fast.strategies.registry import SOLO, Strategy, register

KNOBS = ("apd_mixture_weight", "kv_window", "max_lookahead", "tokens_per_step", "single_temperature",
         "coupled_gumbel", "exact_prev_logits")  # R, W, M, the leftright baseline's K, the opt-in fixes of Q1-Q3
FIXES = ("single_temperature", "coupled_gumbel", "exact_prev_logits")


# the (drafter, verifier) pair checks, before any forward: the spec's `check_models`, and the oracle's (it imports
# them from here: no torch, models and configs read by attribute)
def check_apd_pair(model, verifier, cfg, *, tokenizer=None, verifier_tokenizer=None) -> None:
    """Raise a clear error when the drafter / verifier pair cannot run APD with `cfg` (before any forward).

    The drafter must be Dream-family (bidirectional, shifted logits: upstream's `apd_sample` is Dream's).
    apd_mixture_weight=R needs a verifier; a verifier needs R. The verifier must be a causal qwen2 model
    whose vocabulary is a prefix of the drafter's (Dream = Qwen2.5 + 2 specials): its vocab_size <= the
    drafter's and the drafter's EOS id inside it; with both tokenizers given, the token strings of the
    shared prefix must be equal.
    """
    if not model.config.is_diffusion or not model.logits_shift or model.attention != "full":
        raise ValueError(
            f"strategy='apd' drafts with a Dream-family dLLM (bidirectional, shifted logits); the model is "
            f"model_type {model.config.model_type!r}. Upstream's apd_sample is Dream's (LLaDA has no APD path)"
        )
    R = cfg.apd_mixture_weight
    if verifier is None:
        if R is not None:
            raise ValueError(
                f"apd_mixture_weight={R!r} needs a verifier: pass generate(..., verifier=ar_model) (a causal qwen2 "
                "model whose vocabulary is a prefix of the drafter's, e.g. Qwen2.5-0.5B for Dream, ar-arith for "
                "d2f-arith), or apd_mixture_weight=None for the verifier-free leftright baseline"
            )
        return
    if R is None:
        raise ValueError(
            "verifier= given but apd_mixture_weight=None: pass apd_mixture_weight=R in [0, 1] (upstream presets "
            "0.6 / 0.7), or drop the verifier for the leftright baseline (tokens_per_step per step)"
        )
    vcfg = getattr(verifier, "config", None)
    if vcfg is None or not hasattr(verifier, "forward_window"):
        raise TypeError(f"verifier: {type(verifier).__name__}; expected a model from lopa_fast.load_model")
    if not vcfg.causal_verifier or verifier.attention != "causal":
        raise ValueError(
            f"verifier model_type {vcfg.model_type!r} ({verifier.attention} attention) cannot verify: APD's verifier "
            "is a causal AR qwen2 model (Qwen2.5-0.5B for Dream-v0-7B, ar-arith for d2f-arith)"
        )
    Vd, Vq = model.config.vocab_size, vcfg.vocab_size
    if Vq > Vd:
        raise ValueError(
            f"verifier vocab_size={Vq} > drafter vocab_size={Vd}: the verifier's vocabulary must be a prefix of the "
            "drafter's (APD compares token ids directly and slices the drafter's logits to the verifier's vocab)"
        )
    eos = cfg.eos_token_id
    if eos is not None and eos >= Vq:
        raise ValueError(
            f"the drafter's eos_token_id={eos} is outside the verifier's vocabulary [0, {Vq}): the pair does not "
            "share the vocabulary prefix that holds the stop token"
        )
    if verifier.device != model.device:
        raise ValueError(f"verifier on {verifier.device} but the drafter on {model.device}; put both on one device")
    if tokenizer is not None and verifier_tokenizer is not None:
        n = min(Vq, len(tokenizer), len(verifier_tokenizer))
        a = tokenizer.convert_ids_to_tokens(list(range(n)))
        b = verifier_tokenizer.convert_ids_to_tokens(list(range(n)))
        bad = [i for i in range(n) if a[i] != b[i]]
        if bad:
            i = bad[0]
            raise ValueError(
                f"tokenizers differ on the shared vocabulary prefix: id {i} is {a[i]!r} for the drafter and {b[i]!r} "
                f"for the verifier ({len(bad)} ids differ); APD needs one token table for ids < {Vq}"
            )


check_models = check_apd_pair

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
                raise ValueError(f"{name}=True applies to APD with a verifier; apd_mixture_weight=None (leftright) "
                                 "has none")
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
))
