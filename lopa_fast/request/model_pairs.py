"""Checks of a (drafter, verifier) model pair, before any forward: APD's (strategy="apd"). The strategy's spec
(lopa_fast.strategies.apd: `check_models`) and its reference decoder (lopa_fast.strategies.apd.reference) both run them, so the
oracle takes them from here and imports nothing of the fast side. No torch, no lopa_fast import: models and configs
are read by attribute."""
from __future__ import annotations


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
