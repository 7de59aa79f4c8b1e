"""vanilla: one-token-per-step style dLLM decoding as the model family's own sampler runs it (LLaDA: low-confidence
/ random remasking over semi-autoregressive blocks; Dream: `steps` steps over the whole generation with its
`alg`). docs/semantics.md section 4.1."""
from __future__ import annotations

import warnings

from lopa_fast.errors import KnobError
from lopa_fast.request.knobs import check_choice, check_number
from lopa_fast.strategies import blocks
from lopa_fast.strategies.registry import SOLO, Strategy, register
from lopa_fast.strategies.vanilla.knobs import DREAM_ALGS, REMASKING, VanillaKnobs

LLADA_KNOBS = ("steps", "block_length", "remasking", "cfg_scale", "logits_eos_inf", "confidence_eos_eot_inf")
DREAM_KNOBS = ("steps", "alg", "alg_temp", "eps")
# the confidence (lopa_fast.sampling's sampling_strategy) each Dream alg but "origin" ranks its masks by
DREAM_CONFIDENCE = {"maskgit_plus": "default", "topk_margin": "margin", "entropy": "neg_entropy"}


def transfer_schedule(n_masks: int, n_steps: int) -> list[int]:
    """LLaDA `get_num_transfer_tokens` for one block: floor(n/S) per step, +1 for the first n mod S (the reference
    and the fast driver both read it)."""
    base, rem = divmod(n_masks, n_steps)
    return [base + (1 if i < rem else 0) for i in range(n_steps)]


def validate(cfg) -> None:
    blocks.check_steps_and_block_length(cfg)
    if cfg.remasking is not None:
        check_choice("remasking", cfg.remasking, REMASKING)
    check_number("cfg_scale", cfg.cfg_scale, allow_none=True)
    if cfg.cfg_scale is not None and cfg.cfg_scale < 0:
        raise ValueError(f"cfg_scale={cfg.cfg_scale!r}; allowed: >= 0 (0 = off)")
    blocks.check_flags(cfg, ("logits_eos_inf", "confidence_eos_eot_inf"))
    if cfg.alg is not None:
        check_choice("alg", cfg.alg, DREAM_ALGS)
    check_number("alg_temp", cfg.alg_temp, allow_none=True)
    if cfg.alg_temp is not None and cfg.alg_temp < 0:
        raise ValueError(f"alg_temp={cfg.alg_temp!r}; allowed: >= 0 (None or 0 = deterministic top-k)")
    check_number("eps", cfg.eps, allow_none=True)
    if cfg.eps is not None and not 0.0 <= cfg.eps < 1.0:
        raise ValueError(f"eps={cfg.eps!r}; allowed: a number in [0, 1)")
    blocks.check_blocks(cfg)


def steps_for(cfg) -> int:
    """Vanilla's steps (default max_new_tokens). More steps than positions only adds forwards that transfer
    nothing (upstream runs them): capped at max_new_tokens with a RuntimeWarning, or refused with
    on_round_cap="error" (the round-cap policy; a documented deviation, docs/decoding.md)."""
    if cfg.steps is None or cfg.steps <= cfg.max_new_tokens:
        return cfg.steps if cfg.steps is not None else cfg.max_new_tokens
    msg = (f"steps={cfg.steps} exceeds max_new_tokens={cfg.max_new_tokens} (at least one position per step); "
           "the extra steps would only repeat forwards")
    if cfg.on_round_cap == "error":
        raise KnobError(msg + "; pass steps <= max_new_tokens", knob="steps", value=cfg.steps)
    warnings.warn(msg + f"; capped at steps={cfg.max_new_tokens}", RuntimeWarning, stacklevel=5)
    return cfg.max_new_tokens


def resolve(cfg, model):
    """The family's knobs: LLaDA (block_length default max_new_tokens, low_confidence, cfg_scale 0) or Dream
    (alg origin, eps 1e-3); a knob of the other family is refused naming both lists."""
    if model.config.vanilla_commit == "block_topk":
        bad = [k for k in ("alg", "alg_temp", "eps") if getattr(cfg, k) is not None]
        if bad:
            raise ValueError(f"{bad[0]}={getattr(cfg, bad[0])!r} is a Dream vanilla knob, but the model is LLaDA; "
                             f"LLaDA vanilla knobs: {', '.join(LLADA_KNOBS)}")
        if cfg.top_p is not None or cfg.top_k is not None:
            raise ValueError(f"top_p={cfg.top_p!r} / top_k={cfg.top_k!r}: LLaDA vanilla sampling is Gumbel-max on raw "
                             "logits (no top-p/top-k); leave them None")
        out = cfg.replace(
            block_length=cfg.block_length if cfg.block_length is not None else cfg.max_new_tokens,
            steps=steps_for(cfg), remasking=cfg.remasking or "low_confidence",
            cfg_scale=cfg.cfg_scale if cfg.cfg_scale is not None else 0.0,
            logits_eos_inf=bool(cfg.logits_eos_inf), confidence_eos_eot_inf=bool(cfg.confidence_eos_eot_inf),
        )
    else:
        bad = [k for k in LLADA_KNOBS if k != "steps" and getattr(cfg, k) is not None]
        if bad:
            raise ValueError(f"{bad[0]}={getattr(cfg, bad[0])!r} is a LLaDA vanilla knob, but the model is "
                             f"Dream-family; Dream vanilla knobs: {', '.join(DREAM_KNOBS)}")
        out = cfg.replace(steps=steps_for(cfg), alg=cfg.alg or "origin", eps=cfg.eps if cfg.eps is not None else 1e-3)
    blocks.check_blocks(out)  # the resolved block_length and steps
    return out


def length_unit(cfg) -> int:
    return cfg.block_length if cfg.block_length is not None else 1


def rows(cfg) -> int:
    return 2 if cfg.cfg_scale else 1  # cfg_scale > 0: the conditional and the unconditional row in one forward


def eval_rows(block_size: int, gen_len: int) -> dict[str, dict]:
    """The eval's row: one token per forward (steps = gen_len), alg="entropy" (Dream's own evaluation setting;
    the default alg "origin" reveals positions at random)."""
    return {"vanilla": dict(strategy="vanilla", block_size=block_size, steps=gen_len, alg="entropy")}


SPEC = register(Strategy(
    name="vanilla", summary="the model family's own sampler (LLaDA low-confidence remasking, Dream's algs)",
    reference="lopa_fast.strategies.vanilla.reference:generate", fast=SOLO,
    knobs=tuple(dict.fromkeys(LLADA_KNOBS + DREAM_KNOBS)), knob_class=VanillaKnobs, validate=validate, resolve=resolve,
    length_unit=length_unit, rows=rows, driver="lopa_fast.strategies.vanilla.driver:VanillaDriver", compile=True,
    compile_batches=True, eval_rows=eval_rows,
))
