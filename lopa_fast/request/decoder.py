"""Which decoder runs a request (its `backend`): the strategy's fast decoder or its reference (the oracle), as the
spec names them (lopa_fast.strategies), for a validated, bound config. `backend="auto"` falls back to the reference,
with a RuntimeWarning naming the knob, where the fast decoder does not cover the request; `backend="fast"` raises
there."""
from __future__ import annotations

import inspect
import warnings

from lopa_fast import strategies
from lopa_fast.config import GenerateConfig


def takes_hook(fn) -> bool:
    """Whether a strategy implementation accepts the `on_round=` progress hook."""
    try:
        return "on_round" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def resolve_backend(cfg: GenerateConfig, hook: bool = False, model=None, spec=None, stacklevel: int = 4):
    """Return (callable, backend name that runs, fallback note or None) for a validated config.

    "fast" runs the fast decoder or raises (strategy not covered, or a knob it does not cover:
    lopa_fast.strategies.fast_not_covered, e.g. sampler="upstream" at T > 0); "auto" runs it where it covers the
    config, else the reference (with a RuntimeWarning when the strategy has a fast path but the knobs do not
    fit it). hook: an `on_round=` hook is given (a fast implementation that does not accept one counts as not
    covering the request). model: when given, "auto" runs a model without the static forward (`forward_static`:
    a duck-typed stand-in) on the reference. spec: the strategy's spec when the caller holds it (else looked up).
    stacklevel: of the fallback warnings, counted from the caller of this function.
    """
    spec = spec if spec is not None else strategies.get(cfg.strategy)
    fn, ran, fallback = _choose(cfg, spec, stacklevel + 1)
    if ran == "fast" and cfg.backend == "auto" and model is not None and not hasattr(model, "forward_static"):
        # a duck-typed model without the static forward (test stubs, custom wrappers): not a supported model
        return spec.load("reference"), "reference", "reference (the model has no forward_static)"
    if hook and ran == "fast" and not takes_hook(fn):
        why = "does not take the on_round= progress hook yet"
        if cfg.backend == "fast":
            raise ValueError(f"backend='fast' ({cfg.strategy}) {why}. Use backend='reference' (or 'auto')")
        warnings.warn(f"backend='auto': {cfg.strategy} runs on the reference backend ({why})", RuntimeWarning,
                      stacklevel=stacklevel)
        return spec.load("reference"), "reference", f"reference ({why})"
    return fn, ran, fallback


def _choose(cfg: GenerateConfig, spec, stacklevel: int):
    strategy, backend = cfg.strategy, cfg.backend
    if backend == "reference":
        return spec.load("reference"), "reference", None
    if spec.fast is None:
        if backend == "fast":
            covered = ", ".join(n for n in strategies.names() if strategies.get(n).fast is not None) or "none yet"
            raise ValueError(
                f"backend='fast' does not cover strategy={strategy!r}; the fast backend covers: {covered}. "
                "Use backend='reference' or backend='auto' (fast where available, else reference)"
            )
        return spec.load("reference"), "reference", None
    why = strategies.fast_not_covered(cfg, spec)
    if why is None:
        return spec.load("fast"), "fast", None
    if backend == "fast":
        raise ValueError(f"backend='fast' ({strategy}) {why}. Use backend='reference' (or 'auto', which falls back)")
    warnings.warn(f"backend='auto': {strategy} runs on the reference backend ({why})", RuntimeWarning,
                  stacklevel=stacklevel)
    return spec.load("reference"), "reference", f"reference ({why})"
