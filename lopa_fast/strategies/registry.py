"""The strategy registry: one `Strategy` spec per decoding strategy, and the one place that maps a name to it.

Everything that differs between strategies is a field of the spec, so `GenerateConfig`, `lopa_fast.generate`,
the batch scheduler, the server, the distributed runtime and the eval ask the registry instead of comparing
strategy names (the built-in specs live in `lopa_fast/strategies/<folder>/spec.py`; a strategy registered from outside
the package, e.g. by a test, runs through the same paths):

    from lopa_fast.strategies import Strategy, register
    register(Strategy(name="ltr", summary="...", reference=my_reference_fn, fast=my_fast_fn))

Implementations are given as callables or as "module:attribute" strings imported on first use (so the registry
imports neither the reference decoders, which are the oracle, nor the fast ones).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from lopa_fast.errors import KnobError


# the fast path of every strategy with a `driver`: one request as a batch of one through the one loop
# (lopa_fast.decode.batch.run_solo: fn(model, prompt, cfg, verifier=None, on_round=None))
SOLO = "lopa_fast.decode.batch:run_solo"


@dataclass(frozen=True)
class Strategy:
    """What lopa_fast knows about one strategy.

    name:       the `strategy=` value.
    summary:    one line for help texts.
    knobs:      the strategy-specific GenerateConfig fields it reads (any other strategy's specific knob, when
                set, is refused naming its owners).
    knob_class: the frozen dataclass of the knobs its folder adds to GenerateConfig (`<folder>/knobs.py`, fields made
                with lopa_fast.request.knobs.knob: default, help, choices); `compose_config` adds them. Strategies may
                share one (d2f / lopa) or read another's fields (threshold reads vanilla's steps / block_length).
    reference:  the readable per-branch decoder (the semantics oracle):
                fn(model, prompt [P], cfg, **extra) -> GenerateOutput; a callable or "module:attribute".
    fast:       the fast decoder (same signature), or None (then backend="fast" refuses the strategy); SOLO
                (`lopa_fast.decode.batch.run_solo`) for a strategy with a `driver`: its request as a batch of one.
    validate:   the strategy's own rules between knobs (no model): validate(cfg) raises naming the knob.
    check_values: the value checks of the GenerateConfig fields it owns that every request carries (fields with a
                default, e.g. D2F's thresholds, LoPA's k): run for EVERY request whatever its strategy
                (`check_values`), so a bad value is an error even where the strategy leaves the knob unread.
    resolve:    the model-dependent defaults of its knobs: resolve(cfg, model) -> cfg (after the shared ones).
    length_unit: the block it decodes in whole: length_unit(cfg) -> int (1: no blocks); max_new_tokens is
                rounded up to it and the output cut back.
    rows:       branch slots (forward rows) of one request: rows(cfg) -> int (LoPA: k + 1).
    driver:     the fast backend's per-request driver for the one loop (lopa_fast.decode.batch.Scheduler):
                driver(model, prompt, cfg, cache=None, **extra) (extra: verifier= for a strategy that takes one)
                -> a lopa_fast.decode.driver.Driver (the protocol: begin / next_bucket / prepare / forward_args /
                finish / read_head / after_round / result / use_cache, optional forwards / batch_step / take);
                None: requests of this strategy are decoded one after another by its own `fast`.
    cache_rows: the rows of static KV cache one request needs in the batch's pool: cache_rows(prompt_len, cfg)
                (1: a cache-free driver).
    batches:    batches(cfg): whether the driver's steps of this config can share a forward (default: all; a
                config whose steps cannot runs its requests one at a time).
    share_key:  share_key(cfg) -> tuple: what requests of the strategy must agree on, beyond their rows, to share a
                scheduler of the batch engine (D2F / LoPA: the attention mode; default: nothing).
    compile:    compile=True is implemented on its fast path.
    compile_batches: its driver runs compiled / captured batched steps (`batch_step(*bucket)` -> a
                lopa_fast.decode.compiled_batch.BatchStep or None for an eager step, `take(state, info)`), so that
                compile=True requests share a forward too (default: no, such requests run one at a time, each a
                batch of one).
    distributed: distributed=True (the round's branch slots over the ranks) is implemented.
    default_sampler: the `sampler` when None: "keyed" (the fast path's) or "upstream" (one generator in
                upstream's draw order, reference only; APD's, for exactness with upstream).
    verifier:   it takes a second model (`generate(..., verifier=)`): check_models(model, verifier, cfg) runs
                before any forward; None: a verifier is refused.
    verifier_knob: the knob whose value (not None) makes a request use the verifier (apd: apd_mixture_weight); the
                CLI / server / lm-eval name it when no verifier was given, and pass their verifier only to requests
                that set it (`uses_verifier`).
    eval_rows:  its rows in the eval (lopa_fast.tasks.eval_rows; the CLI's --preset for a strategy without a
                verifier): eval_rows(block_size, gen_len) -> {row name: knobs, "strategy" included} for answers of
                gen_len new tokens with every block knob at block_size; default: none.
    """

    name: str
    summary: str
    reference: Callable | str
    fast: Callable | str | None = None
    knobs: tuple[str, ...] = ()
    knob_class: type | None = None
    validate: Callable[[Any], None] = lambda cfg: None
    check_values: Callable[[Any], None] = lambda cfg: None
    resolve: Callable[[Any, Any], Any] = lambda cfg, model: cfg
    length_unit: Callable[[Any], int] = lambda cfg: 1
    rows: Callable[[Any], int] = lambda cfg: 1
    driver: Callable | str | None = None
    cache_rows: Callable[[int, Any], int] = lambda prompt_len, cfg: 1
    batches: Callable[[Any], bool] = lambda cfg: True
    share_key: Callable[[Any], tuple] = lambda cfg: ()
    compile: bool = False
    compile_batches: bool = False
    distributed: bool = False
    default_sampler: str = "keyed"
    check_models: Callable | str | None = None
    verifier_knob: str | None = None
    eval_rows: Callable[[int, int], dict] = lambda block_size, gen_len: {}
    extra: dict = field(default_factory=dict)  # anything else a strategy wants to publish (docs, presets)

    def load(self, what: str):
        """The implementation `what` ("reference" | "fast" | "driver" | "check_models"), imported on first use."""
        impl = getattr(self, what)
        solo = impl == SOLO
        if isinstance(impl, str):
            module, _, attr = impl.partition(":")
            impl = getattr(importlib.import_module(module), attr)
        # the one loop knows no strategy: its solo entry is handed this spec (the plan's) with the request
        return functools.partial(impl, spec=self) if solo and what == "fast" else impl

    @property
    def takes_verifier(self) -> bool:
        return self.check_models is not None

    def uses_verifier(self, cfg) -> bool:
        """Whether a request with `cfg` runs with a verifier (its `verifier_knob` is set)."""
        return self.takes_verifier and self.verifier_knob is not None and getattr(cfg, self.verifier_knob) is not None


_REGISTRY: dict[str, Strategy] = {}
_COMPOSED: set[str] | None = None  # the knob names GenerateConfig holds, once compose_config built it


def register(spec: Strategy, *, replace: bool = False) -> Strategy:
    """Add `spec` (ValueError when the name is taken, unless replace=True). Returns it."""
    if not isinstance(spec, Strategy):
        raise TypeError(f"register: {type(spec).__name__}; expected a lopa_fast.strategies.Strategy")
    if not isinstance(spec.name, str) or not spec.name.isidentifier():
        raise ValueError(f"register: name={spec.name!r}; allowed: an identifier such as 'lopa'")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"register: strategy {spec.name!r} is already registered; pass replace=True to replace it")
    if spec.default_sampler not in ("keyed", "upstream"):
        raise ValueError(f"register: default_sampler={spec.default_sampler!r}; allowed: 'keyed', 'upstream'")
    new = [f.name for f in dataclasses.fields(spec.knob_class)] if spec.knob_class is not None else []
    if _COMPOSED is not None and set(new) - _COMPOSED:
        raise TypeError(f"register({spec.name!r}): knob_class {spec.knob_class.__name__} adds knobs "
                        f"{sorted(set(new) - _COMPOSED)} after GenerateConfig was built; register the strategy before "
                        "lopa_fast.config is imported (a built-in folder: its line in "
                        "lopa_fast/strategies/__init__.py)")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered strategy (KeyError when there is none of that name)."""
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """Every registered strategy name, in registration order."""
    return tuple(_REGISTRY)


def find(name) -> Strategy | None:
    """The spec of `name`, or None when no strategy of that name is registered (or `name` is not a string)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get(name) -> Strategy:
    """The spec of `name`, else a ValueError (a KnobError on knob "strategy") listing the registered names."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise KnobError(f"strategy={name!r}; allowed: {', '.join(repr(n) for n in _REGISTRY)}", knob="strategy",
                        value=name)
    return spec


def specific_knobs() -> tuple[str, ...]:
    """Every strategy-specific knob of every registered strategy (each once, in registration order)."""
    return tuple(dict.fromkeys(k for s in _REGISTRY.values() for k in s.knobs))


def check_values(cfg) -> None:
    """Every registered strategy's `check_values` on cfg (a knob's value is checked whatever the strategy)."""
    for spec in _REGISTRY.values():
        spec.check_values(cfg)


def owners(knob: str) -> list[str]:
    """The strategies that read the specific knob `knob`."""
    return [s.name for s in _REGISTRY.values() if knob in s.knobs]


def decode_length(n: int, unit: int, strict_length: bool) -> int:
    """The length decoded for a request of `n` new tokens in whole blocks of `unit` (a spec's `length_unit`): n
    rounded up to a multiple of it, or n itself with strict_length (whose validation refuses a non-multiple)."""
    return n if strict_length else -(-n // unit) * unit


def fast_not_covered(cfg, spec: Strategy | None = None) -> str | None:
    """Why the fast backend cannot run this validated config (a phrase naming the knob), or None.

    Random draws run on the keyed sampler (lopa_fast.keyed: a pure function of seed, step and position, so a
    batched step draws what the reference draws); upstream's draw-for-draw order (sampler="upstream") exists
    only on the per-step reference (APD's default, for exactness with upstream at T > 0: pass sampler='keyed'
    for its fast path). spec: the strategy's spec when the caller holds it (else looked up)."""
    from lopa_fast.keyed import needs_draws  # torch: only when a request is checked, never for the CLI's parser

    if getattr(cfg, "sampler", "keyed") == "upstream" and needs_draws(cfg):
        if (spec if spec is not None else get(cfg.strategy)).default_sampler == "upstream":
            fast = (f"for {cfg.strategy}'s fast path pass sampler='keyed' ({cfg.strategy}'s default at T > 0 is "
                    "upstream's order, for exactness with upstream)")
        else:
            fast = "the fast backend draws with sampler='keyed' (the default)"
        return (f"sampler='upstream' (upstream's draw order from one generator) runs on the per-step reference only; "
                f"{fast}")
    return None


def compose_config(base: type, name: str = "GenerateConfig") -> type:
    """The config class: `base` (a frozen dataclass holding the shared knobs and the config's methods) extended by
    the fields of every registered strategy's `knob_class`, in registration order, each class once. A field name
    two classes define is a TypeError naming both (one knob, one owner). lopa_fast.config builds GenerateConfig with
    it once, after the built-in strategies registered (a strategy registered later runs on existing knobs)."""
    owner = {f.name: base.__name__ for f in dataclasses.fields(base)}
    fields, seen = [], set()
    for spec in _REGISTRY.values():
        cls = spec.knob_class
        if cls is None or cls in seen:
            continue
        seen.add(cls)
        for f in dataclasses.fields(cls):
            if f.name in owner:
                raise TypeError(f"knob {f.name!r} is defined by both {owner[f.name]} and {cls.__name__}")
            owner[f.name] = cls.__name__
            fields.append((f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata)))
    global _COMPOSED
    cls = dataclasses.make_dataclass(name, fields, bases=(base,), frozen=True)
    _COMPOSED = set(owner)
    cls.__module__ = base.__module__  # pickles (the server's, torch.distributed's) find it where it is bound
    return cls


def check_distributed(cfg, spec: Strategy) -> None:
    """distributed=True: the knobs it needs (KnobError naming the knob); the process group itself is checked where
    the request runs (lopa_fast.distributed.check_group)."""
    if not spec.distributed:
        covered = ", ".join(repr(n) for n in names() if get(n).distributed)
        raise KnobError(f"distributed=True covers strategy {covered}; got strategy={cfg.strategy!r}",
                        knob="strategy", value=cfg.strategy)
    if cfg.backend == "reference":
        raise KnobError("distributed=True runs the fast decoder; pass backend='fast' (or 'auto')",
                        knob="backend", value=cfg.backend)
    if cfg.temperature > 0 and cfg.sampler == "upstream":
        raise KnobError(
            f"distributed=True at temperature={cfg.temperature!r} draws with sampler='keyed' (noise keyed by seed, "
            "round and position, so every rank draws any branch's noise without a message); sampler='upstream' (one "
            "generator, draw by draw in upstream's order) cannot be split over ranks", knob="sampler", value="upstream")
