"""Vanilla's knobs (LLaDA's `generate`, Dream's `diffusion_generate`): the fields this folder adds to GenerateConfig
(the registry composes every strategy's knob dataclass into it; lopa_fast.config). steps / block_length are read by
threshold too (its spec lists them); None: the model family's default (spec.py's resolve)."""
from __future__ import annotations

from dataclasses import dataclass

from lopa_fast.request.knobs import knob

REMASKING = ("low_confidence", "random")
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclass(frozen=True)
class VanillaKnobs:
    steps: int | None = knob(None, "vanilla: denoising steps; threshold: only checked to divide into the blocks",
                             unset="max_new_tokens (vanilla), the number of blocks (threshold)")
    block_length: int | None = knob(None, "semi-autoregressive block length (LLaDA vanilla, threshold)",
                                    unset="max_new_tokens (LLaDA vanilla), block_size (threshold)")
    remasking: str | None = knob(None, "LLaDA vanilla: which masked positions each step reveals", choices=REMASKING,
                                 unset="low_confidence")
    cfg_scale: float | None = knob(None, "LLaDA vanilla: unsupervised classifier-free guidance scale",
                                   unset="0 (off)")
    logits_eos_inf: bool | None = knob(None, "LLaDA vanilla: set the EOS logit to -inf", unset="off")
    confidence_eos_eot_inf: bool | None = knob(None, "LLaDA vanilla: set the EOS / EOT confidence to -inf",
                                               unset="off")
    alg: str | None = knob(None, "Dream vanilla: the order in which positions are revealed", choices=DREAM_ALGS,
                           unset="origin")
    alg_temp: float | None = knob(None, "Dream vanilla: temperature of the confidence-ordered reveal",
                                  unset="0 (deterministic top-k)")
    eps: float | None = knob(None, "Dream vanilla: the last time step of the noise schedule", unset="1e-3")
