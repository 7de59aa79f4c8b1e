"""The decoding knobs as one validated, frozen dataclass (knob names are upstream's).

GenerateConfig = the shared knobs below (`_SharedKnobs`) + every strategy's own knob dataclass (its folder's
knobs.py, e.g. lopa_fast/strategies/lopa/knobs.py), composed by the registry (`strategies.compose_config`): one
source of defaults, --help texts and choices (field metadata: lopa_fast.request.knobs.knob). `validate()` checks
every knob that needs no model (the shared ones here, each strategy's through its spec's hooks) and raises naming
the knob, the value and what is allowed; `bind(model)` / `bind_prompt` fill the model-dependent defaults. Strategies
and the fast decoder receive only resolved configs.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from lopa_fast import strategies
from lopa_fast.errors import KnobError, RoundCapError  # noqa: F401  (RoundCapError re-exported here)
from lopa_fast.request import lengths
from lopa_fast.request.knobs import INT_KNOB_LIMIT, MAX_STOP_SEQUENCES, knob, knob_choices  # noqa: F401  (public here)
from lopa_fast.request.knobs import (check_bool as _bool, check_choice as _choice, check_number as _num,
                                    check_positive_int as _positive_int, check_prob as _prob, check_stop)
from lopa_fast.request.model_checks import model_ids

BACKENDS = ("reference", "fast", "auto")
ROUND_CAP_ACTIONS = ("warn", "error")
SAMPLERS = ("keyed", "upstream")


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class _SharedKnobs:
    """The knobs every strategy shares, and the config's methods (GenerateConfig adds the strategies' own)."""

    strategy: str = knob("lopa", 'the decoding strategy (docs/decoding.md "Strategies")', choices=strategies.names)
    backend: str = knob("auto", "auto: the fast decoder wherever it covers the request, else the reference (the "
                        "per-step oracle)", choices=BACKENDS)
    max_new_tokens: int | None = knob(None, "new tokens to return (decoded in whole blocks, the output cut to it)",
                                      unset="the model's generation_config.json max_new_tokens (else 512), clipped "
                                            "to its max_position_embeddings")
    strict_length: bool = knob(False, "refuse a max_new_tokens that is not a whole number of blocks (instead of "
                                      "rounding up and cutting)")
    block_size: int = knob(32, "tokens per block (d2f / lopa; threshold's block_length when that is unset)")
    # sampling
    temperature: float = knob(0.0, "sampling temperature (0 = greedy)")
    top_p: float | None = knob(None, "nucleus sampling: keep the most likely tokens holding this much probability "
                                     "(T > 0)", unset="off")
    top_k: int | None = knob(None, "keep only the k most likely tokens (T > 0; 0 or -1: off, as in HF / vLLM)",
                             unset="off")
    # ids (None: the model's)
    mask_token_id: int | None = knob(None, "the mask token id", unset="the model's")
    eos_token_id: int | None = knob(None, "the end-of-sequence token id", unset="the model's")
    seed: int | None = knob(None, "seed of the random draws (T > 0, random remasking / reveal orders)",
                            unset="drawn from torch's global generator")
    # the draws at T > 0 and vanilla's random remasking / origin reveal / alg_temp; keyed: also per branch, CPU or GPU
    sampler: str | None = knob(None, "the random draws: keyed (a function of seed, step and position; both backends "
                                     "agree) or upstream's draw order (reference backend only)",
                               choices=SAMPLERS, unset="keyed (apd: upstream)")
    return_trace: bool = knob(False, "record the per-round trace (fill order, branches) in the output")
    # loop caps and deliberate deviations from upstream (all off = upstream-exact)
    max_rounds: int | None = knob(None, "cap on the rounds / steps of the decoding loop",
                                  unset="2 * max_new_tokens + 64")
    on_round_cap: str = knob("warn", "at max_rounds: warn and return (finish_reason round_cap), or raise "
                                     "RoundCapError", choices=ROUND_CAP_ACTIONS)
    suppress_mask_token: bool = knob(False, "never emit the mask token (upstream does not suppress it)")
    # None (auto): capture on CUDA (a round's capture costs about a second and removes hundreds of launches; a
    # failed capture falls back to the eager step with a warning), eager on CPU (Inductor compiles take minutes);
    # batched requests run one compiled / captured step per batch-size bucket (lopa_fast.decode.compiled_batch)
    compile: bool | None = knob(None, "compile each round / step bucket once and replay it (CUDA graphs on GPU, "
                                      "torch.compile on CPU)", unset="capture on CUDA, eager on CPU")
    # T = 0 on the fast backend; every rank returns the result (lopa_fast.distributed)
    distributed: bool = knob(False, "split each d2f / lopa round's branches over the ranks of the initialised "
                                    "torch.distributed group (docs/distributed.md)")
    # every strategy; the finalised prefix: the tokens before the first mask
    stop: tuple[tuple[int, ...], ...] | None = knob(
        None, "token-id stop sequences: decoding ends once one is in the finalised prefix, the output cut before it",
        unset="none")

    def __post_init__(self):
        # stop=[[...], ...] (lists, what users and JSON send) -> tuples, so the config stays hashable; a value
        # that is not a sequence of sequences is left for validate() to name
        if isinstance(self.stop, (list, tuple)) and all(isinstance(q, (list, tuple)) for q in self.stop):
            object.__setattr__(self, "stop", tuple(tuple(q) for q in self.stop))
        # top_k=0 (HF) and top_k=-1 (vLLM) mean "off" there: stored as None, the one "off" here
        if type(self.top_k) is int and self.top_k in (0, -1):
            object.__setattr__(self, "top_k", None)

    def sampling_notes(self) -> list[str]:
        """Knobs that are set but have no effect with the others (HF warns about the same): top_p / top_k at
        temperature 0 (greedy). generate warns with them; the server returns them in the response's warnings."""
        if self.temperature != 0:
            return []
        return [f"{name}={getattr(self, name)!r} has no effect at temperature=0 (greedy decoding); pass temperature > "
                "0 to sample" for name in ("top_p", "top_k")
                if getattr(self, name) is not None and not (name == "top_p" and getattr(self, name) == 1.0)]

    def replace(self, **kw) -> "GenerateConfig":
        """dataclasses.replace(self, **kw), by copying the instance dict and running __post_init__ (its
        normalisations: stop lists -> tuples, top_k 0 / -1 -> None) on the result: dataclasses.replace reads and re-sets
        all ~48 fields through the frozen __init__ (~25 us, twice a request). A name that is not a field is refused as
        dataclasses.replace refuses it."""
        unknown = kw.keys() - _field_names(type(self))
        if unknown:
            return dataclasses.replace(self, **kw)  # (its TypeError names the argument)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(kw)
        new.__post_init__()
        return new

    def validate(self, spec=None) -> "GenerateConfig":
        """Check every knob that needs no model; raise ValueError/TypeError before any work.

        The shared knobs are checked here, then the strategy's own (its spec's `knobs` and `validate` hook:
        lopa_fast/strategies/<folder>/spec.py). spec: the strategy's spec when the caller has looked it up already (the
        request plan, lopa_fast.request.plan), else looked up here (a KnobError naming the registered strategies)."""
        spec = spec if spec is not None else strategies.get(self.strategy)
        _choice("backend", self.backend, BACKENDS)
        _positive_int("max_new_tokens", self.max_new_tokens, allow_none=True)
        _bool("strict_length", self.strict_length)
        check_stop(self.stop)
        _positive_int("block_size", self.block_size)
        _num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}; allowed: >= 0 (0 = greedy)")
        _prob("top_p", self.top_p, allow_none=True)
        _positive_int("top_k", self.top_k, allow_none=True)
        for name in ("mask_token_id", "eos_token_id", "seed"):
            v = getattr(self, name)
            _num(name, v, allow_none=True, integer=True, limit=2**63 if name == "seed" else INT_KNOB_LIMIT)
            if v is not None and v < 0:
                raise ValueError(f"{name}={v!r}; allowed: an int >= 0")
        if self.sampler is not None:
            _choice("sampler", self.sampler, SAMPLERS)
        _bool("return_trace", self.return_trace)
        _positive_int("max_rounds", self.max_rounds, allow_none=True)
        _choice("on_round_cap", self.on_round_cap, ROUND_CAP_ACTIONS)
        _bool("suppress_mask_token", self.suppress_mask_token)
        if self.compile is not None:
            _bool("compile", self.compile)
        if self.compile and self.backend == "reference":
            raise ValueError("compile=True applies to backend='fast' or 'auto'; the reference backend runs eagerly")
        if self.compile and not spec.compile:
            raise KnobError(f"compile=True: strategy={self.strategy!r} has no compiled path; pass compile=False",
                            knob="compile", value=True)
        _bool("distributed", self.distributed)
        if self.distributed:
            strategies.check_distributed(self, spec)
        strategies.check_values(self)  # every strategy's shared-field values (a bad value is an error anywhere)
        for name in strategies.specific_knobs():
            if getattr(self, name) is not None and name not in spec.knobs:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} does not apply to strategy={self.strategy!r}; "
                    f"it is a knob of {' / '.join(strategies.owners(name))}"
                )
        spec.validate(self)  # the strategy's own knobs and the rules between them
        return self

    # ---- lengths (rounded up to whole blocks before decoding, cut after; docs/decoding.md "Lengths") ----------
    def length_unit(self, spec=None) -> int:
        """The block the strategy decodes in whole (its spec's `length_unit`; 1 where there are no blocks)."""
        return (spec if spec is not None else strategies.get(self.strategy)).length_unit(self)

    def decode_length(self, n: int, spec=None) -> int:
        """The length decoded for a request of `n` new tokens: n rounded up to whole blocks (n itself with
        strict_length=True, where validate() refuses a non-multiple; strategies.decode_length)."""
        return strategies.decode_length(n, self.length_unit(spec), self.strict_length)

    def bind_prompt(self, model, prompt_len: int, spec,
                    validate: bool = True) -> tuple["GenerateConfig", dict, list[str]]:
        """Everything the config knows about a request with a prompt of `prompt_len` tokens, in one call: the knobs
        validated (`validate`; validate=False: the caller validated this config already, e.g. once for a batch's
        prompts), then (the bound config: `plan_length` then `resolve`, max_new_tokens the length decoded;
        plan_length's length info; `sampling_notes`). spec: the strategy's spec (the request plan looked it up once:
        lopa_fast.request.plan)."""
        if validate:
            self.validate(spec)
        planned, length = self.plan_length(model, prompt_len, spec)
        return planned.resolve(model, spec), length, self.sampling_notes()

    def plan_length(self, model, prompt_len: int, spec=None) -> tuple["GenerateConfig", dict]:
        """(config whose max_new_tokens is the length to DECODE, info): lopa_fast.request.lengths.plan_length."""
        return lengths.plan_length(self, model, prompt_len, spec if spec is not None else strategies.get(self.strategy))

    def bind(self, model) -> "GenerateConfig":
        """`validate()` then `resolve(model)`: a new, validated, fully resolved config."""
        return self.validate().resolve(model)

    def resolve(self, model, spec=None) -> "GenerateConfig":
        """Resolve the model-dependent defaults of a VALIDATED config (call `validate()` first, or `bind`); spec:
        the strategy's spec when the caller holds it (else looked up).

        mask/eos ids default to the model's; the round cap defaults to 2 * max_new_tokens + 64 (a round
        fills at least one position unless the mask token itself is emitted, so the cap is only hit by
        such a stall); family-specific vanilla knobs are checked against the model's family.
        """
        spec = spec if spec is not None else strategies.get(self.strategy)
        if self.max_new_tokens is None or self.decode_length(self.max_new_tokens, spec) != self.max_new_tokens:
            # no prompt here (generate plans the length with it): the model's default, in whole blocks
            n = self.max_new_tokens if self.max_new_tokens is not None else lengths.default_max_new_tokens(model)[0]
            self = self.replace(max_new_tokens=self.decode_length(n, spec))
        mask, eos = model_ids(self, model)  # the ids checked against the model (a diffusion model, in its vocabulary)
        kw: dict = {"mask_token_id": mask, "eos_token_id": eos}
        if self.sampler is None:
            kw["sampler"] = spec.default_sampler
        kw["max_rounds"] = self.max_rounds if self.max_rounds is not None else 2 * self.max_new_tokens + 64
        return spec.resolve(self.replace(**kw), model)  # the strategy's own model-dependent defaults


GenerateConfig = strategies.compose_config(_SharedKnobs)
GenerateConfig.__doc__ = """Every knob of `lopa_fast.generate` (see its docstring and docs/decoding.md): the shared
ones (`_SharedKnobs`) and each strategy's (its folder's knobs.py). Each field carries its one-line description, its
choices and what None runs as in its metadata (`knob`): the CLI's --help is built from them."""
LopaConfig = GenerateConfig  # the name docs/architecture.md uses
