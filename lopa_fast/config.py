"""The decoding knobs as one validated dataclass (knob names are upstream's).

`GenerateConfig.validate()` checks every knob that needs no model (the shared ones here, each strategy's own
through its spec's `validate` hook: lopa_fast/strategies/<folder>/spec.py) and raises ValueError / TypeError naming the
knob, the value and what is allowed. `bind(model)` fills the model-dependent defaults (mask / EOS ids, the round
cap, the spec's `resolve` hook) and returns a new, fully resolved config (`bind_prompt`: the same for a prompt's
length, in whole blocks); strategies and the fast decoder receive only resolved configs.

Fields the fast decoder (lopa_fast.decode) needs for d2f / lopa, all resolved by `bind`:
    max_new_tokens, block_size, block_add_threshold (tau_add), decoded_token_threshold (tau_act),
    skip_threshold (tau_conf, strict `p_max > tau`), sampling_strategy, branching_factor (k: a round
    verifies k+1 sequences for k >= 2, one for k = 1), branch_topp, selection_conf_alpha,
    use_full_attention, temperature, top_p, top_k, mask_token_id (int), eos_token_id (int or None),
    seed, return_trace, max_rounds (int), on_round_cap ("warn" | "error"), suppress_mask_token (bool).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lopa_fast import strategies
from lopa_fast.errors import KnobError, RoundCapError  # noqa: F401  (RoundCapError re-exported here)
from lopa_fast.request.knobs import INT_KNOB_LIMIT
from lopa_fast.request.knobs import check_bool as _bool
from lopa_fast.request.knobs import check_choice as _choice
from lopa_fast.request.knobs import check_number as _num
from lopa_fast.request.knobs import check_positive_int as _positive_int
from lopa_fast.request.knobs import check_prob as _prob
from lopa_fast.request.knobs import SAMPLING_STRATEGIES
from lopa_fast.strategies.threshold.spec import CACHE_MODES
from lopa_fast.strategies.vanilla.spec import DREAM_ALGS, REMASKING

MAX_STOP_SEQUENCES, MAX_STOP_LENGTH = 16, 32  # checked on the device every round: a bounded static loop
BACKENDS = ("reference", "fast", "auto")
ROUND_CAP_ACTIONS = ("warn", "error")
SAMPLERS = ("keyed", "upstream")


def knob(default, help: str, *, choices=None, unset: str | None = None):
    """A GenerateConfig field: its default and, as field metadata, what the CLI's --help and the docs show.

    help:    one line saying what the knob does.
    choices: the allowed values of a choice knob (a tuple, or a function returning one: the strategy registry
             grows at run time); None values in it stand for the unset default.
    unset:   for a knob whose default is None, what that runs as (e.g. "the model's", "max_new_tokens").
    """
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if unset is not None:
        meta["unset"] = unset
    return field(default=default, metadata=meta)


def knob_choices(f: dataclasses.Field) -> tuple | None:
    """The allowed values of a GenerateConfig field (None: not a choice knob); None entries left out."""
    choices = f.metadata.get("choices")
    if callable(choices):
        choices = choices()
    return None if choices is None else tuple(c for c in choices if c is not None)


@dataclass(frozen=True)
class GenerateConfig:
    """Every knob of `lopa_fast.generate` (see its docstring and docs/decoding.md). Each field carries its one-line
    description, its choices and what None runs as in its metadata (`knob`): the CLI's --help is built from them."""

    strategy: str = knob("lopa", 'the decoding strategy (docs/decoding.md "Strategies")', choices=strategies.names)
    backend: str = knob("auto", "auto: the fast decoder wherever it covers the request, else the reference (the "
                        "per-step oracle)", choices=BACKENDS)
    max_new_tokens: int | None = knob(None, "new tokens to return (decoded in whole blocks, the output cut to it)",
                                      unset="the model's generation_config.json max_new_tokens (else 512), clipped "
                                            "to its max_position_embeddings")
    strict_length: bool = knob(False, "refuse a max_new_tokens that is not a whole number of blocks (instead of "
                                      "rounding up and cutting)")
    block_size: int = knob(32, "tokens per block (d2f / lopa; threshold's block_length when that is unset)")
    # D2F / LoPA (docs/semantics.md sections 2-3)
    block_add_threshold: float = knob(0.1, "tau_add (d2f / lopa): append a new block once the last block's decoded "
                                           "fraction is >= it")
    decoded_token_threshold: float = knob(0.95, "tau_act (d2f / lopa): once a block's decoded fraction is >= it, the "
                                                "next block is fully activated")
    skip_threshold: float = knob(0.9, "tau_conf (d2f / lopa): a masked position is filled when its max probability "
                                      "is > it")
    sampling_strategy: str = knob("neg_entropy", "confidence of the fallback fill, the lookahead ranking and the "
                                                 "branch score (d2f / lopa)", choices=SAMPLING_STRATEGIES)
    branching_factor: int = knob(4, "LoPA's k: lookahead branches per round; a round verifies k + 1 sequences "
                                    "(1 = D2F)")
    branch_topp: float = knob(1.0, "LoPA branch score: the mean of the lowest max(1, int(n * branch_topp)) "
                                   "confidences over its n masks")
    selection_conf_alpha: float = knob(0.0, "LoPA branch score: alpha * creation confidence + (1 - alpha) * that mean")
    use_full_attention: bool = knob(True, "d2f / lopa: full attention over [cache ; window] (upstream LoPA); off: "
                                          "D2F's block-causal mask")
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
    # vanilla (LLaDA / Dream) and threshold (Fast-dLLM / dParallel)
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
    threshold: float | None = knob(None, "threshold: commit masks with p(x0) >= it (Fast-dLLM); give at most one of "
                                         "threshold / factor / entropy_threshold",
                                   unset="0.9 (Fast-dLLM's default) when neither factor nor entropy_threshold is given")
    factor: float | None = knob(None, "threshold: Fast-dLLM's factor rule, commit the longest prefix with c(k) >= "
                                      "1 - factor / (k + 1)", unset="none")
    entropy_threshold: float | None = knob(None, "threshold: commit masks whose entropy is <= it, in nats "
                                                 "(dParallel)", unset="none")
    cache: str | None = knob(None, "threshold: Fast-dLLM's KV cache", choices=CACHE_MODES, unset="no cache")
    count_noop_forward: bool | None = knob(None, "threshold: run and count the cached forward after a refresh that "
                                                 "filled the block (upstream's loop)", unset="off")
    # apd (docs/decoding.md "APD"; the quirk fixes: None or False is upstream)
    apd_mixture_weight: float | None = knob(None, "apd: R, the dLLM's weight in the target R * l_D + (1 - R) * l_AR "
                                                  "(needs verifier=)", unset="the verifier-free leftright baseline")
    kv_window: int | None = knob(None, "apd: W, committed positions recomputed each step (the dLLM's KV cache)",
                                 unset="no cache")
    max_lookahead: int | None = knob(None, "apd: M, masked positions the dLLM sees past the decoding position",
                                     unset="the whole canvas")
    tokens_per_step: int | None = knob(None, "apd leftright baseline: K, tokens committed per step", unset="1")
    single_temperature: bool | None = knob(None, "apd: fix of quirk Q1 (draft from softmax(l / T), not at T^2)",
                                           unset="off (upstream)")
    coupled_gumbel: bool | None = knob(None, "apd: fix of quirk Q2 (the target reuses the draft's Gumbel noise at "
                                             "T > 0)", unset="off (upstream)")
    exact_prev_logits: bool | None = knob(None, "apd: fix of quirk Q3 (after an all-accepted step, the next step's "
                                                "first AR logit predicts right)", unset="off (upstream)")

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

    # ---------------------------------------------------------------------------------------------
    def replace(self, **kw) -> "GenerateConfig":
        return dataclasses.replace(self, **kw)

    def validate(self, spec=None) -> "GenerateConfig":
        """Check every knob that needs no model; raise ValueError/TypeError before any work.

        The shared knobs are checked here, then the strategy's own (its spec's `knobs` and `validate` hook:
        lopa_fast/strategies/<folder>/spec.py). spec: the strategy's spec when the caller has looked it up already (the
        request plan, lopa_fast.request.plan), else looked up here (a KnobError naming the registered strategies)."""
        spec = spec if spec is not None else strategies.get(self.strategy)
        _choice("backend", self.backend, BACKENDS)
        _positive_int("max_new_tokens", self.max_new_tokens, allow_none=True)
        _bool("strict_length", self.strict_length)
        self._check_stop()
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
                            knob="compile", value=True)  # fmt: skip
        _bool("distributed", self.distributed)
        if self.distributed:
            self._check_distributed(spec)
        strategies.check_values(self)  # every strategy's shared-field values (a bad value is an error anywhere)
        for knob in strategies.specific_knobs():
            if getattr(self, knob) is not None and knob not in spec.knobs:
                raise ValueError(
                    f"{knob}={getattr(self, knob)!r} does not apply to strategy={self.strategy!r}; "
                    f"it is a knob of {' / '.join(strategies.owners(knob))}"
                )
        spec.validate(self)  # the strategy's own knobs and the rules between them
        return self

    def _check_distributed(self, spec) -> None:
        """distributed=True: the knobs it needs (KnobError naming the knob); the process group itself is checked
        where the request runs (lopa_fast.distributed.check_group)."""
        if not spec.distributed:
            covered = ", ".join(repr(n) for n in strategies.names() if strategies.get(n).distributed)
            raise KnobError(f"distributed=True covers strategy {covered}; got strategy={self.strategy!r}",
                            knob="strategy", value=self.strategy)  # fmt: skip
        if self.backend == "reference":
            raise KnobError("distributed=True runs the fast decoder; pass backend='fast' (or 'auto')",
                            knob="backend", value=self.backend)  # fmt: skip
        if self.temperature > 0 and self.sampler == "upstream":
            raise KnobError(
                f"distributed=True at temperature={self.temperature!r} draws with sampler='keyed' (noise keyed by "
                "seed, round and position, so every rank draws any branch's noise without a message); "
                "sampler='upstream' (one generator, draw by draw in upstream's order) cannot be split over ranks",
                knob="sampler", value="upstream",
            )  # fmt: skip

    def _check_stop(self) -> None:
        if self.stop is None:
            return
        example = "e.g. stop=[[13, 198], [7]]"
        if not isinstance(self.stop, tuple) or not self.stop:
            raise TypeError(f"stop={self.stop!r}; expected a non-empty list of token-id sequences ({example})")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop: {len(self.stop)} sequences; allowed: at most {MAX_STOP_SEQUENCES}")
        for q in self.stop:
            if not q or len(q) > MAX_STOP_LENGTH or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in q
            ):
                raise ValueError(
                    f"stop sequence {list(q)!r}; allowed: 1..{MAX_STOP_LENGTH} token ids (ints >= 0) ({example})"
                )

    # ---- lengths (rounded up to whole blocks before decoding, cut after; docs/decoding.md "Lengths") ----------
    def length_unit(self, spec=None) -> int:
        """The block the strategy decodes in whole (its spec's `length_unit`: d2f / lopa block_size; threshold
        block_length, default block_size; vanilla block_length when given; 1 where there are no blocks).
        spec: the strategy's spec when the caller holds it (else looked up)."""
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
        """(config whose max_new_tokens is the length to DECODE, info) for a prompt of `prompt_len` tokens.

        info: requested (the length the output is cut to), decoded (whole blocks), source ("argument",
        "generation_config.json" or "default"), clipped (the reason, when the default was clipped to the room
        left in max_position_embeddings). An explicit max_new_tokens that fits but whose whole-block rounding
        does not raises KnobError (the position limit check of a plain overflow stays in prompts.check_prompt).
        """
        limit = model.config.max_position_embeddings
        room = limit - prompt_len
        info: dict = {}
        spec = spec if spec is not None else strategies.get(self.strategy)
        unit = self.length_unit(spec)  # decoding needs whole blocks of it, strict or not
        if self.max_new_tokens is None:
            n, source = default_max_new_tokens(model)
            if self.strict_length and n % unit:
                raise KnobError(
                    f"max_new_tokens=None: the default {n} ({source}) is not a multiple of the block {unit} and "
                    "strict_length=True; pass max_new_tokens=", knob="max_new_tokens", value=n)  # fmt: skip
            fit = (room // unit) * unit
            if fit < 1:
                raise KnobError(
                    f"max_new_tokens: the prompt ({prompt_len} tokens) leaves {max(room, 0)} of the model's "
                    f"max_position_embeddings={limit} positions, less than one block of {unit}; shorten the prompt",
                    knob="max_new_tokens", value=None)  # fmt: skip
            if n > fit:
                info["clipped"] = (f"max_new_tokens {n} ({source}) clipped to {fit}: prompt {prompt_len} + {n} "
                                   f"exceeds max_position_embeddings={limit}")  # fmt: skip
                n = fit
            info["source"] = source
        else:
            n = self.max_new_tokens
            info["source"] = "argument"
            d = self.decode_length(n, spec)
            if prompt_len + n > limit:
                raise KnobError(
                    f"prompt length {prompt_len} + max_new_tokens {n} = {prompt_len + n} exceeds the model's "
                    f"max_position_embeddings={limit}", knob="max_new_tokens", value=n)  # fmt: skip
            if prompt_len + d > limit:
                raise KnobError(
                    f"max_new_tokens={n} is decoded in whole blocks of {unit} ({d} positions), and prompt length "
                    f"{prompt_len} + {d} exceeds the model's max_position_embeddings={limit}; pass max_new_tokens <= "
                    f"{max(room // unit * unit, 0)} or a smaller block", knob="max_new_tokens", value=n)  # fmt: skip
        info["requested"] = n
        info["decoded"] = self.decode_length(n, spec)
        return self.replace(max_new_tokens=info["decoded"]), info

    # ---------------------------------------------------------------------------------------------
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
            n = self.max_new_tokens if self.max_new_tokens is not None else default_max_new_tokens(model)[0]
            self = self.replace(max_new_tokens=self.decode_length(n, spec))
        if not model.config.is_diffusion:  # the real reason first: a causal AR model has no mask token to ask for
            raise ValueError(
                f"model_type {model.config.model_type!r} (causal AR Qwen2) cannot run diffusion decoding; "
                "use a Dream / D2F / DiffuCoder / LLaDA model (a qwen2 model is APD's verifier: strategy='apd', "
                "verifier=)"
            )
        mask = self.mask_token_id if self.mask_token_id is not None else model.mask_token_id
        if mask is None:
            raise ValueError("mask_token_id=None and the model config has none; pass mask_token_id=")
        vocab = model.config.vocab_size
        if not 0 <= mask < vocab:
            raise ValueError(f"mask_token_id={mask}; allowed: an id in [0, vocab_size={vocab})")
        eos = self.eos_token_id if self.eos_token_id is not None else model.eos_token_id
        if eos is not None and not 0 <= eos < vocab:
            raise ValueError(f"eos_token_id={eos}; allowed: an id in [0, vocab_size={vocab})")
        if eos is not None and eos == mask:
            raise ValueError(f"eos_token_id={eos} equals mask_token_id; they must differ")
        if self.top_k is not None and self.top_k > vocab:
            raise ValueError(f"top_k={self.top_k}; allowed: 1..vocab_size={vocab}")
        for q in self.stop or ():
            if max(q) >= vocab:
                raise ValueError(f"stop sequence {list(q)!r} holds id {max(q)}; allowed: ids in [0, vocab_size={vocab})")
        kw: dict = {"mask_token_id": mask, "eos_token_id": eos}
        if self.sampler is None:
            kw["sampler"] = spec.default_sampler
        kw["max_rounds"] = self.max_rounds if self.max_rounds is not None else 2 * self.max_new_tokens + 64
        return spec.resolve(self.replace(**kw), model)  # the strategy's own model-dependent defaults


LopaConfig = GenerateConfig  # the name docs/architecture.md uses

DEFAULT_MAX_NEW_TOKENS = 512  # max_new_tokens=None when the model's generation_config.json has none


def default_max_new_tokens(model) -> tuple[int, str]:
    """(max_new_tokens, source) for `max_new_tokens=None`: `max_new_tokens` of the generation_config.json in the
    model's directory (`model.name_or_path`, set by load_model) when it has one, else DEFAULT_MAX_NEW_TOKENS."""
    from pathlib import Path

    from lopa_fast.errors import ConfigError
    from lopa_fast.models.checkpoint import read_json

    where = getattr(model, "name_or_path", None)
    f = Path(where) / "generation_config.json" if where else None
    if f is None or not f.is_file():
        return DEFAULT_MAX_NEW_TOKENS, "default"
    data = read_json(f)  # ConfigError naming the file when it is not JSON
    n = data.get("max_new_tokens") if isinstance(data, dict) else None
    if n is None:
        return DEFAULT_MAX_NEW_TOKENS, "default"
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < INT_KNOB_LIMIT:
        raise ConfigError(f"{f}: max_new_tokens={n!r}; expected an int >= 1", file=f, key="max_new_tokens", value=n)
    return n, "generation_config.json"
