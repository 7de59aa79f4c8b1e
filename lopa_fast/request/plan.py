"""Resolve once: a request's arguments turned into ONE validated `Plan` before any forward, in one pass.

    make(model, input_ids, cfg, verifier=, on_round=, streamer=) -> Plan
        the strategy's spec looked up (the one lookup by name) -> a verifier refused where the strategy takes none ->
        the prompt prepared (lopa_fast.request.prompts: a LongTensor [P]) -> ONE call into the config
        (GenerateConfig.bind_prompt): the knobs validated (the shared ones, the spec's own checks), lengths planned,
        model defaults resolved -> the prompt checked against them, and the request's memory -> the backend chosen
        (lopa_fast.request.decoder) -> the (model, verifier) pair checked (lopa_fast.request.verifiers)
    make_batch(model, prompts, cfg, ...) -> BatchPlan: the knobs validated once, before any prompt is touched (a bad
        knob is named before prompt 3's error), then one Plan per prompt, whether they batch

Everything after (lopa_fast.api's run, lopa_fast.request.prompt_batch) reads the plan: no lookup of the spec by name, no
re-validation. Errors name the value and what is allowed; in a batch, a prompt's errors say which prompt.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lopa_fast import strategies
from lopa_fast.request import prompt_batch
from lopa_fast.request.decoder import resolve_backend
from lopa_fast.config import GenerateConfig
from lopa_fast.memory import check_request_memory
from lopa_fast.request.prompts import check_prompt, prepare_prompt
from lopa_fast.request.verifiers import check_pair, check_verifier_taken


@dataclass(frozen=True, eq=False)  # identity: it holds a model and tensors
class Plan:
    """One request, resolved: what runs, on what, and how the output is cut.

    model:    the DecoderLM that decodes.
    cfg:      the bound GenerateConfig (validated; max_new_tokens is the whole-block length decoded; mask / EOS ids,
              sampler, round cap and the strategy's own defaults resolved against the model).
    spec:     the strategy's spec (lopa_fast.strategies.Strategy), looked up once.
    ids:      the prompt, LongTensor [P] on model.device.
    length:   requested (the length the output is cut to), decoded (whole blocks), source, clipped (when a default
              was clipped): GenerateConfig.plan_length's info.
    fn:       the implementation that runs, fn(model, ids, cfg, **plan.extra(on_round)) -> GenerateOutput.
    backend:  "fast" | "reference": the backend that runs (cfg.backend may say "auto").
    fallback: why "auto" runs the reference (stats["fallback"]), else None.
    verifier: the second model (a strategy that takes one: APD), else None.
    on_round: the caller's per-round progress hook, else None.
    streamer: a TextStreamer-style object (lopa_fast.output.text_streamer) the run drives, else None.
    """

    model: Any
    cfg: GenerateConfig
    spec: strategies.Strategy
    ids: torch.Tensor
    length: dict
    fn: Callable
    backend: str
    fallback: str | None = None
    verifier: Any = None
    on_round: Callable | None = None
    streamer: Any = None

    def extra(self, on_round=None) -> dict:
        """The keyword arguments of `fn` besides (model, ids, cfg): verifier= for a strategy that takes one, and
        on_round= when a hook runs (the caller's, or the streamer's around it)."""
        kw = {"verifier": self.verifier} if self.spec.takes_verifier else {}
        if on_round is not None:
            kw["on_round"] = on_round
        return kw


@dataclass(frozen=True, eq=False)  # identity: it holds a model and tensors
class BatchPlan:
    """A list of prompts under one config: a Plan per prompt (in order) and whether they share forwards (every
    prompt on the fast backend of a strategy whose batch driver covers the config: lopa_fast.request.prompt_batch)."""

    plans: tuple[Plan, ...]
    batched: bool


def make(model, input_ids, cfg: GenerateConfig, *, verifier=None, on_round=None, streamer=None) -> Plan:
    """The plan of one prompt (module docstring); a request whose memory estimate exceeds the device's is refused
    (lopa_fast.memory.check_request_memory)."""
    spec = _spec(cfg, verifier)
    return _plan(model, input_ids, cfg, spec, verifier, on_round, streamer, stacklevel=5, validate=True)


def make_batch(model, prompts: list, cfg: GenerateConfig, *, verifier=None, on_round=None) -> BatchPlan:
    """The plans of a list of prompts (any lengths) under one config; on_round: one hook for all prompts or a list
    (one per prompt). Every prompt is checked before any forward."""
    hooks = list(on_round) if isinstance(on_round, (list, tuple)) else [on_round] * len(prompts)
    if len(hooks) != len(prompts):
        raise ValueError(f"on_round: {len(hooks)} hooks for {len(prompts)} prompts; give one hook or one per prompt")
    spec = _spec(cfg, verifier)
    cfg.validate(spec)  # once for every prompt, before any is touched
    n = len(prompts)
    plans = []
    for i, (p, h) in enumerate(zip(prompts, hooks)):
        plans.append(_plan(model, p, cfg, spec, verifier, h, None, f"prompt {i} of {n}", stacklevel=6))
    return BatchPlan(tuple(plans), prompt_batch.batches(cfg, plans))


def _spec(cfg: GenerateConfig, verifier):
    """The spec (the one lookup by name); a verifier= for a strategy that takes none refused."""
    spec = strategies.get(cfg.strategy)  # a KnobError naming the registered strategies
    check_verifier_taken(cfg, verifier, spec)
    return spec


def _plan(model, input_ids, cfg, spec, verifier, on_round, streamer, label: str | None = None,
          stacklevel: int = 5, validate: bool = False) -> Plan:
    """One prompt's Plan. validate: the knobs are checked here (one request; a batch's were checked once before).
    label: names the prompt in its errors (a batch's); stacklevel: of the warnings, so that they point at the caller
    of generate (5 from here: make, generate_with_config, generate)."""
    with _naming(label):
        ids = prepare_prompt(model, input_ids)
        # max_new_tokens: whole blocks decoded
        bound, length, notes = cfg.bind_prompt(model, ids.numel(), spec, validate=validate)
        check_prompt(model, ids, bound)
        check_request_memory(model, ids.numel() + bound.max_new_tokens, bound, ids.numel(), verifier, spec)
    for note in notes:  # knobs set without effect (top_p at temperature 0, ...): HF warns about the same
        warnings.warn(note, UserWarning, stacklevel=stacklevel)
    if on_round is not None and not callable(on_round):
        raise TypeError(f"on_round: {type(on_round).__name__}; expected a callable on_round(prefix, info) or None")
    hook = on_round is not None or streamer is not None
    fn, ran, fallback = resolve_backend(bound, hook=hook, model=model, spec=spec, stacklevel=stacklevel + 1)
    with _naming(label):
        check_pair(model, verifier, ids, bound, spec)
    return Plan(model, bound, spec, ids, length, fn, ran, fallback, verifier, on_round, streamer)


class _naming:  # (lower-case: used as a function, `with _naming(label):`)
    """Errors raised inside name the prompt they are about (`label`, e.g. "prompt 2 of 5"), keeping their type and
    fields. (A class: a generator-based context manager raises and catches a StopIteration at every exit.)"""

    __slots__ = ("label",)

    def __init__(self, label: str | None):
        self.label = label

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if self.label is not None and isinstance(e, (ValueError, TypeError)):
            e.args = (f"{self.label}: {e.args[0] if e.args else e}",) + tuple(e.args[1:])
        return False  # the exception (if any) goes on
