"""`lopa_fast.generate`: validate the knobs and the prompt, pick strategy + backend, run, return stats.

Every strategy implementation, reference or fast, has one signature:

    fn(model, prompt_ids: LongTensor [P] (on model.device), cfg: GenerateConfig (bound)) -> GenerateOutput

The reference ones live in `REFERENCE_STRATEGIES` (lopa_fast.reference.*); the fast ones in
`lopa_fast.decode.FAST_STRATEGIES` (imported lazily: the fast decoder is optional). All validation
happens here, before any forward: implementations may assume a bound, valid config and a clean prompt.
"""
from __future__ import annotations

import importlib

import torch

from lopa_fast.config import GenerateConfig
from lopa_fast.output import GenerateOutput


def _reference_strategy(strategy: str):
    """The reference implementation `lopa_fast.reference.<strategy>.generate` (imported on first use)."""
    return importlib.import_module(f"lopa_fast.reference.{strategy}").generate


def _fast_strategies() -> dict:
    try:
        mod = importlib.import_module("lopa_fast.decode")
    except ModuleNotFoundError as e:  # the fast decoder is not installed / not written yet
        if e.name not in ("lopa_fast.decode",):
            raise
        return {}
    return dict(getattr(mod, "FAST_STRATEGIES", {}))


def prepare_prompt(model, input_ids) -> torch.Tensor:
    """Validate the prompt and return it as a LongTensor [P] on model.device.

    Accepts a LongTensor [P] or [1, P] (int64 or int32) on the model's device, or a list of ints.
    """
    device = model.device
    if isinstance(input_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise TypeError("input_ids: a list must hold only ints")
        ids = torch.tensor(list(input_ids), dtype=torch.long, device=device)
    elif isinstance(input_ids, torch.Tensor):
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids.dtype={input_ids.dtype}; allowed: torch.int64 or torch.int32 token ids")
        if input_ids.device != device:
            raise ValueError(
                f"input_ids.device={input_ids.device} but the model is on {device}; move the ids to the model's device"
            )
        ids = input_ids
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"input_ids has batch size {ids.shape[0]} (shape {tuple(ids.shape)}); allowed: batch 1 "
                    "([P] or [1, P]); call generate once per prompt"
                )
            ids = ids[0]
        elif ids.dim() != 1:
            raise ValueError(f"input_ids has shape {tuple(ids.shape)}; allowed: [P] or [1, P]")
        ids = ids.to(torch.long)
    else:
        raise TypeError(f"input_ids: {type(input_ids).__name__}; allowed: a LongTensor [P] / [1, P] or a list of ints")
    if ids.numel() == 0:
        raise ValueError("input_ids is empty (P=0); allowed: a prompt of at least one token")
    return ids.contiguous()


def check_prompt(model, ids: torch.Tensor, cfg: GenerateConfig) -> None:
    """Checks that need both the prompt and the bound config (mask id in prompt, length, id range)."""
    vocab = model.config.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"input_ids contains token id {bad}; allowed: ids in [0, vocab_size={vocab})")
    if bool((ids == cfg.mask_token_id).any()):
        pos = int((ids == cfg.mask_token_id).nonzero()[0, 0])
        raise ValueError(
            f"input_ids contains the mask token id {cfg.mask_token_id} (first at position {pos}); "
            "a prompt must not contain masks"
        )
    P = ids.numel()
    limit = model.config.max_position_embeddings
    total = P + cfg.max_new_tokens
    if total > limit:
        raise ValueError(
            f"prompt length {P} + max_new_tokens {cfg.max_new_tokens} = {total} exceeds the model's "
            f"max_position_embeddings={limit}"
        )


def resolve_backend(strategy: str, backend: str):
    """Return (callable, backend name that runs)."""
    if backend == "reference":
        return _reference_strategy(strategy), "reference"
    fast = _fast_strategies()
    if strategy in fast:
        return fast[strategy], "fast"
    if backend == "fast":
        covered = ", ".join(sorted(fast)) or "none yet"
        raise ValueError(
            f"backend='fast' does not cover strategy={strategy!r}; the fast backend covers: {covered}. "
            "Use backend='reference' or backend='auto' (fast where available, else reference)"
        )
    return _reference_strategy(strategy), "reference"


def generate(
    model,
    input_ids,
    strategy: str = "lopa",
    backend: str = "reference",
    *,
    max_new_tokens: int = 512,
    block_size: int = 32,
    block_add_threshold: float = 0.1,
    decoded_token_threshold: float = 0.95,
    skip_threshold: float = 0.9,
    sampling_strategy: str = "neg_entropy",
    branching_factor: int = 4,
    branch_topp: float = 1.0,
    selection_conf_alpha: float = 0.0,
    use_full_attention: bool = True,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    mask_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int | None = None,
    return_trace: bool = False,
    max_rounds: int | None = None,
    on_round_cap: str = "warn",
    suppress_mask_token: bool = False,
    **strategy_specific,
) -> GenerateOutput:
    """Decode `max_new_tokens` positions after the prompt with a diffusion LM.

    model:      a DecoderLM from `lopa_fast.load_model` (Dream / D2F / DiffuCoder / LLaDA family).
    input_ids:  LongTensor [P] or [1, P] on the model's device, or list[int]; batch 1.
    strategy:   "vanilla" | "threshold" | "d2f" | "lopa" (docs/decoding.md describes each and its knobs).
    backend:    "reference" (per-branch Python, the semantics oracle) | "fast" (batched decoder;
                raises for strategies it does not cover) | "auto" (fast where available, else reference).
    D2F/LoPA knobs keep upstream names (block_size, block_add_threshold, decoded_token_threshold,
    skip_threshold, sampling_strategy, branching_factor, branch_topp, selection_conf_alpha,
    use_full_attention). branching_factor=1 is plain D2F; k >= 2 verifies k+1 sequences per round.
    max_rounds / on_round_cap: the loop cap (default 2 * max_new_tokens + 64) and what happens when it is
    hit ("warn": stats["hit_round_cap"] = True + RuntimeWarning; "error": RoundCapError).
    suppress_mask_token: exclude the mask id from predictions (upstream does not; default False).
    strategy_specific: vanilla (LLaDA: steps, block_length, remasking, cfg_scale, logits_eos_inf,
    confidence_eos_eot_inf; Dream: steps, alg, alg_temp, eps) and threshold (block_length, steps,
    exactly one of threshold / factor / entropy_threshold, cache None|"prefix"|"dual", count_noop_forward).

    Returns GenerateOutput(generated_ids: list[int] of every generated position, stats, trace).
    """
    from lopa_fast.config import ALL_SPECIFIC_KNOBS

    unknown = sorted(set(strategy_specific) - set(ALL_SPECIFIC_KNOBS))
    if unknown:
        raise TypeError(
            f"generate() got unknown keyword argument(s) {unknown}; strategy-specific knobs are: "
            f"{', '.join(ALL_SPECIFIC_KNOBS)}"
        )
    cfg = GenerateConfig(
        strategy=strategy,
        backend=backend,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        block_add_threshold=block_add_threshold,
        decoded_token_threshold=decoded_token_threshold,
        skip_threshold=skip_threshold,
        sampling_strategy=sampling_strategy,
        branching_factor=branching_factor,
        branch_topp=branch_topp,
        selection_conf_alpha=selection_conf_alpha,
        use_full_attention=use_full_attention,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        mask_token_id=mask_token_id,
        eos_token_id=eos_token_id,
        seed=seed,
        return_trace=return_trace,
        max_rounds=max_rounds,
        on_round_cap=on_round_cap,
        suppress_mask_token=suppress_mask_token,
        **strategy_specific,
    )
    return generate_with_config(model, input_ids, cfg)


def generate_with_config(model, input_ids, cfg: GenerateConfig) -> GenerateOutput:
    """`generate` with a prepared GenerateConfig (validated and bound to the model here)."""
    if not isinstance(cfg, GenerateConfig):
        raise TypeError(f"cfg: {type(cfg).__name__}; expected a lopa_fast.GenerateConfig")
    cfg.validate()
    ids = prepare_prompt(model, input_ids)
    cfg = cfg.bind(model)
    check_prompt(model, ids, cfg)
    fn, ran = resolve_backend(cfg.strategy, cfg.backend)
    with torch.inference_mode():
        out = fn(model, ids, cfg)
    out.stats.setdefault("strategy", cfg.strategy)
    out.stats.setdefault("backend", ran)  # a fast entry point that fell back says "reference" itself
    return out
