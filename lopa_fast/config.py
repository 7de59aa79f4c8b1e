"""The decoding knobs as one validated dataclass (knob names are upstream's).

`GenerateConfig.validate()` checks every knob on its own (no model needed) and raises ValueError /
TypeError naming the knob, the value and what is allowed. `bind(model)` fills the model-dependent
defaults (mask / EOS ids, the round cap) and returns a new, fully resolved config; strategies and the
fast decoder receive only resolved configs.

Fields the fast decoder (lopa_fast.decode) needs for d2f / lopa, all resolved by `bind`:
    max_new_tokens, block_size, block_add_threshold (tau_add), decoded_token_threshold (tau_act),
    skip_threshold (tau_conf, strict `p_max > tau`), sampling_strategy, branching_factor (k: a round
    verifies k+1 sequences for k >= 2, one for k = 1), branch_topp, selection_conf_alpha,
    use_full_attention, temperature, top_p, top_k, mask_token_id (int), eos_token_id (int or None),
    seed, return_trace, max_rounds (int), on_round_cap ("warn" | "error"), suppress_mask_token (bool).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

STRATEGIES = ("vanilla", "threshold", "d2f", "lopa", "apd")
MAX_STOP_SEQUENCES, MAX_STOP_LENGTH = 16, 32  # checked on the device every round: a bounded static loop
BACKENDS = ("reference", "fast", "auto")
SAMPLING_STRATEGIES = ("default", "margin", "neg_entropy")
ROUND_CAP_ACTIONS = ("warn", "error")
REMASKING = ("low_confidence", "random")
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
CACHE_MODES = (None, "prefix", "dual")
SAMPLERS = ("keyed", "upstream")

# strategy-specific knobs (passed through generate's **strategy_specific); None = "not given"
LLADA_VANILLA_KNOBS = ("steps", "block_length", "remasking", "cfg_scale", "logits_eos_inf", "confidence_eos_eot_inf")
DREAM_VANILLA_KNOBS = ("steps", "alg", "alg_temp", "eps")
THRESHOLD_KNOBS = ("steps", "block_length", "threshold", "factor", "entropy_threshold", "cache", "count_noop_forward")
# APD (danielmisrael/apd `apd_sample`): R, W, M, the leftright baseline's K, and the opt-in fixes of quirks Q1-Q3
APD_KNOBS = ("apd_mixture_weight", "kv_window", "max_lookahead", "tokens_per_step", "single_temperature",
             "coupled_gumbel", "exact_prev_logits")  # fmt: skip
STRATEGY_KNOBS = {
    "vanilla": tuple(dict.fromkeys(LLADA_VANILLA_KNOBS + DREAM_VANILLA_KNOBS)),
    "threshold": THRESHOLD_KNOBS,
    "d2f": (),
    "lopa": (),
    "apd": APD_KNOBS,
}
ALL_SPECIFIC_KNOBS = tuple(dict.fromkeys(k for v in STRATEGY_KNOBS.values() for k in v))


from lopa_fast.errors import KnobError, RoundCapError  # noqa: E402,F401  (RoundCapError re-exported here)

INT_KNOB_LIMIT = 2**31  # every int knob is below it (device tables index with int32); seeds: below 2**63


def _num(name, value, *, allow_none=False, integer=False, limit=INT_KNOB_LIMIT):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an int" if integer else "a number"
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected {kind}")
    if isinstance(value, float) and not math.isfinite(value):
        raise KnobError(f"{name}={value!r}; expected a finite number", knob=name, value=value)
    if isinstance(value, int) and abs(value) >= limit:
        raise KnobError(f"{name}={value!r} is out of range; allowed: |{name}| < 2**{limit.bit_length() - 1}",
                        knob=name, value=value)  # fmt: skip


def _prob(name, value, *, allow_none=False):
    _num(name, value, allow_none=allow_none)
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r}; allowed: a probability in [0, 1]")


def _positive_int(name, value, *, allow_none=False):
    _num(name, value, allow_none=allow_none, integer=True)
    if value is not None and value <= 0:
        raise ValueError(f"{name}={value!r}; allowed: an int >= 1")


def _bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected True or False")


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {', '.join(repr(a) for a in allowed)}")


@dataclass(frozen=True)
class GenerateConfig:
    """Every knob of `lopa_fast.generate` (see its docstring and docs/decoding.md)."""

    strategy: str = "lopa"
    backend: str = "auto"  # the fast backend wherever it covers the request (lopa_fast.decode.fast_not_covered)
    # None: the model's generation_config.json `max_new_tokens` (else DEFAULT_MAX_NEW_TOKENS), clipped to the room
    # left in max_position_embeddings. A length that is not a whole number of blocks is decoded in whole blocks
    # and the output cut to it (stats["finish_reason"]); strict_length=True refuses such a length instead.
    max_new_tokens: int | None = None
    strict_length: bool = False
    block_size: int = 32
    # D2F / LoPA (docs/semantics.md sections 2-3)
    block_add_threshold: float = 0.1
    decoded_token_threshold: float = 0.95
    skip_threshold: float = 0.9
    sampling_strategy: str = "neg_entropy"
    branching_factor: int = 4
    branch_topp: float = 1.0
    selection_conf_alpha: float = 0.0
    use_full_attention: bool = True
    # sampling
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    # ids (None: the model's)
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    seed: int | None = None
    # the random draws (T > 0; vanilla's random remasking / origin reveal / alg_temp): "keyed" = a pure function
    # of (seed, step, branch, position), the same tokens on both backends, CPU or GPU; "upstream" = upstream's
    # draw order from one torch.Generator (reference backend only). None: "keyed" (apd: "upstream")
    sampler: str | None = None
    return_trace: bool = False
    # loop caps and deliberate deviations from upstream (all off = upstream-exact)
    max_rounds: int | None = None
    on_round_cap: str = "warn"
    suppress_mask_token: bool = False
    # the fast backend: compile each round bucket once (CUDA graphs on GPU, torch.compile on CPU) and replay
    compile: bool = False
    # the fast backend (d2f / lopa, T = 0): split each round's branch slots over the ranks of the initialised
    # torch.distributed process group (lopa_fast.distributed; docs/distributed.md); every rank returns the result
    distributed: bool = False
    # stop sequences (token ids; every strategy): decoding ends once one lies in the finalised prefix (the tokens
    # before the first mask); the output is cut before it. A list of lists is accepted (stored as tuples).
    stop: tuple[tuple[int, ...], ...] | None = None
    # vanilla (LLaDA: steps, block_length, remasking, cfg_scale, logits_eos_inf, confidence_eos_eot_inf;
    #          Dream: steps, alg, alg_temp, eps) and threshold (Fast-dLLM / dParallel)
    steps: int | None = None
    block_length: int | None = None
    remasking: str | None = None
    cfg_scale: float | None = None
    logits_eos_inf: bool | None = None
    confidence_eos_eot_inf: bool | None = None
    alg: str | None = None
    alg_temp: float | None = None
    eps: float | None = None
    threshold: float | None = None
    factor: float | None = None
    entropy_threshold: float | None = None
    cache: str | None = None
    count_noop_forward: bool | None = None
    # apd (docs/decoding.md "APD"): apd_mixture_weight R in [0, 1] (None: the verifier-free leftright baseline),
    # kv_window W >= 0 (None: no dLLM cache), max_lookahead M >= 1 (None: the whole canvas), tokens_per_step K
    # (leftright only; None: 1), and the opt-in fixes of upstream quirks Q1 / Q2 / Q3 (None or False: upstream)
    apd_mixture_weight: float | None = None
    kv_window: int | None = None
    max_lookahead: int | None = None
    tokens_per_step: int | None = None
    single_temperature: bool | None = None
    coupled_gumbel: bool | None = None
    exact_prev_logits: bool | None = None

    def __post_init__(self):
        # stop=[[...], ...] (lists, what users and JSON send) -> tuples, so the config stays hashable; a value
        # that is not a sequence of sequences is left for validate() to name
        if isinstance(self.stop, (list, tuple)) and all(isinstance(q, (list, tuple)) for q in self.stop):
            object.__setattr__(self, "stop", tuple(tuple(q) for q in self.stop))

    # ---------------------------------------------------------------------------------------------
    def replace(self, **kw) -> "GenerateConfig":
        return dataclasses.replace(self, **kw)

    def validate(self) -> "GenerateConfig":
        """Check every knob that needs no model; raise ValueError/TypeError before any work."""
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("backend", self.backend, BACKENDS)
        _positive_int("max_new_tokens", self.max_new_tokens, allow_none=True)
        _bool("strict_length", self.strict_length)
        self._check_stop()
        _positive_int("block_size", self.block_size)
        for name in ("block_add_threshold", "decoded_token_threshold", "skip_threshold"):
            _prob(name, getattr(self, name))
        _choice("sampling_strategy", self.sampling_strategy, SAMPLING_STRATEGIES)
        _positive_int("branching_factor", self.branching_factor)
        _prob("branch_topp", self.branch_topp)
        _prob("selection_conf_alpha", self.selection_conf_alpha)
        _bool("use_full_attention", self.use_full_attention)
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
        _bool("compile", self.compile)
        if self.compile and self.backend == "reference":
            raise ValueError("compile=True applies to backend='fast' or 'auto'; the reference backend runs eagerly")
        _bool("distributed", self.distributed)
        if self.distributed:  # the strategy / backend / process-group checks (KnobError naming the knob)
            from lopa_fast.distributed import check_config

            check_config(self)

        allowed = STRATEGY_KNOBS[self.strategy]
        for knob in ALL_SPECIFIC_KNOBS:
            if getattr(self, knob) is not None and knob not in allowed:
                owners = [s for s, ks in STRATEGY_KNOBS.items() if knob in ks]
                raise ValueError(
                    f"{knob}={getattr(self, knob)!r} does not apply to strategy={self.strategy!r}; "
                    f"it is a knob of {' / '.join(owners)}"
                )
        if (self.strict_length and self.max_new_tokens is not None and self.strategy in ("d2f", "lopa")
                and self.max_new_tokens % self.block_size):  # fmt: skip
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} must be a multiple of block_size={self.block_size} "
                f"for strategy={self.strategy!r} with strict_length=True (blocks of block_size tokens are appended; "
                "strict_length=False decodes whole blocks and cuts the output to max_new_tokens)"
            )
        _positive_int("steps", self.steps, allow_none=True)
        _positive_int("block_length", self.block_length, allow_none=True)
        if self.remasking is not None:
            _choice("remasking", self.remasking, REMASKING)
        _num("cfg_scale", self.cfg_scale, allow_none=True)
        if self.cfg_scale is not None and self.cfg_scale < 0:
            raise ValueError(f"cfg_scale={self.cfg_scale!r}; allowed: >= 0 (0 = off)")
        for name in ("logits_eos_inf", "confidence_eos_eot_inf", "count_noop_forward"):
            if getattr(self, name) is not None:
                _bool(name, getattr(self, name))
        if self.alg is not None:
            _choice("alg", self.alg, DREAM_ALGS)
        _num("alg_temp", self.alg_temp, allow_none=True)
        if self.alg_temp is not None and self.alg_temp < 0:
            raise ValueError(f"alg_temp={self.alg_temp!r}; allowed: >= 0 (None or 0 = deterministic top-k)")
        _num("eps", self.eps, allow_none=True)
        if self.eps is not None and not 0.0 <= self.eps < 1.0:
            raise ValueError(f"eps={self.eps!r}; allowed: a number in [0, 1)")
        _prob("threshold", self.threshold, allow_none=True)
        _num("factor", self.factor, allow_none=True)
        if self.factor is not None and self.factor <= 0:
            raise ValueError(f"factor={self.factor!r}; allowed: a number > 0")
        _num("entropy_threshold", self.entropy_threshold, allow_none=True)
        if self.entropy_threshold is not None and self.entropy_threshold < 0:
            raise ValueError(f"entropy_threshold={self.entropy_threshold!r}; allowed: >= 0 (nats)")
        if self.cache is not None:
            _choice("cache", self.cache, CACHE_MODES)
        if self.strategy == "threshold":
            given = [k for k in ("threshold", "factor", "entropy_threshold") if getattr(self, k) is not None]
            if len(given) > 1:
                raise ValueError(
                    f"threshold strategy: {' and '.join(f'{k}={getattr(self, k)!r}' for k in given)} given; "
                    "allowed: exactly one of threshold=, factor=, entropy_threshold="
                )
            if not given:
                raise ValueError(
                    "threshold strategy: none of threshold=, factor=, entropy_threshold= given; pass exactly one"
                )
        if self.strategy in ("vanilla", "threshold"):
            self._check_blocks()
        if self.strategy == "apd":
            self._check_apd()
        return self

    def _check_apd(self) -> None:
        _prob("apd_mixture_weight", self.apd_mixture_weight, allow_none=True)
        _num("kv_window", self.kv_window, allow_none=True, integer=True)
        if self.kv_window is not None and self.kv_window < 0:
            raise ValueError(f"kv_window={self.kv_window!r}; allowed: an int >= 0 (recomputed positions) or None (no cache)")
        _positive_int("max_lookahead", self.max_lookahead, allow_none=True)
        _positive_int("tokens_per_step", self.tokens_per_step, allow_none=True)
        for name in ("single_temperature", "coupled_gumbel", "exact_prev_logits"):
            if getattr(self, name) is not None:
                _bool(name, getattr(self, name))
        if self.apd_mixture_weight is not None and self.tokens_per_step is not None:
            raise ValueError(
                f"tokens_per_step={self.tokens_per_step!r} applies to the verifier-free leftright baseline "
                f"(apd_mixture_weight=None); with apd_mixture_weight={self.apd_mixture_weight!r} the verifier decides "
                "how many tokens each step accepts"
            )
        if self.apd_mixture_weight is None:
            for name in ("coupled_gumbel", "exact_prev_logits"):
                if getattr(self, name):
                    raise ValueError(f"{name}=True applies to APD with a verifier; apd_mixture_weight=None (leftright) has none")
        k = self.tokens_per_step or 1
        if self.max_lookahead is not None and k > self.max_lookahead:
            raise ValueError(
                f"tokens_per_step={k} > max_lookahead={self.max_lookahead}: a step cannot commit more tokens than the "
                "lookahead window drafts; allowed: tokens_per_step <= max_lookahead"
            )

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

    def _check_blocks(self) -> None:
        """LLaDA-style block loop: gen_length % block_length == 0 and steps % num_blocks == 0 (gen_length: the
        decoded length, i.e. max_new_tokens rounded up to whole blocks unless strict_length)."""
        bl = self.block_length if self.block_length is not None else None
        if bl is None or self.max_new_tokens is None:
            return  # vanilla Dream has no blocks; LLaDA/threshold default block_length is resolved in bind()
        if self.strict_length and self.max_new_tokens % bl:
            raise ValueError(
                f"block_length={bl} must divide max_new_tokens={self.max_new_tokens} with strict_length=True "
                f"(strategy={self.strategy!r} decodes max_new_tokens in blocks of block_length)"
            )
        n = self.decode_length(self.max_new_tokens)
        nb = n // bl
        if self.steps is not None and self.steps % nb:
            raise ValueError(
                f"steps={self.steps} must be a multiple of the number of blocks {nb} "
                f"(= max_new_tokens {n} / block_length {bl})"
            )

    # ---- lengths (rounded up to whole blocks before decoding, cut after; docs/decoding.md "Lengths") ----------
    def length_unit(self) -> int:
        """The block the strategy decodes in whole (d2f / lopa: block_size; threshold: block_length, default
        block_size; vanilla: block_length when given; 1 where there are no blocks)."""
        if self.strategy in ("d2f", "lopa"):
            return self.block_size
        if self.strategy == "threshold":
            return self.block_length if self.block_length is not None else self.block_size
        if self.strategy == "vanilla" and self.block_length is not None:
            return self.block_length
        return 1

    def decode_length(self, n: int) -> int:
        """The length decoded for a request of `n` new tokens: n rounded up to whole blocks (n itself with
        strict_length=True, where validate() refuses a non-multiple)."""
        if self.strict_length:
            return n
        u = self.length_unit()
        return -(-n // u) * u

    def plan_length(self, model, prompt_len: int) -> tuple["GenerateConfig", dict]:
        """(config whose max_new_tokens is the length to DECODE, info) for a prompt of `prompt_len` tokens.

        info: requested (the length the output is cut to), decoded (whole blocks), source ("argument",
        "generation_config.json" or "default"), clipped (the reason, when the default was clipped to the room
        left in max_position_embeddings). An explicit max_new_tokens that fits but whose whole-block rounding
        does not raises KnobError (the position limit check of a plain overflow stays in api.check_prompt).
        """
        limit = model.config.max_position_embeddings
        room = limit - prompt_len
        info: dict = {}
        unit = self.length_unit()  # decoding needs whole blocks of it, strict or not
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
            d = self.decode_length(n)
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
        info["decoded"] = self.decode_length(n)
        return self.replace(max_new_tokens=info["decoded"]), info

    # ---------------------------------------------------------------------------------------------
    def bind(self, model) -> "GenerateConfig":
        """`validate()` then `resolve(model)`: a new, validated, fully resolved config."""
        return self.validate().resolve(model)

    def resolve(self, model) -> "GenerateConfig":
        """Resolve the model-dependent defaults of a VALIDATED config (call `validate()` first, or `bind`).

        mask/eos ids default to the model's; the round cap defaults to 2 * max_new_tokens + 64 (a round
        fills at least one position unless the mask token itself is emitted, so the cap is only hit by
        such a stall); family-specific vanilla knobs are checked against the model's family.
        """
        if self.max_new_tokens is None or self.decode_length(self.max_new_tokens) != self.max_new_tokens:
            # no prompt here (generate plans the length with it): the model's default, in whole blocks
            n = self.max_new_tokens if self.max_new_tokens is not None else default_max_new_tokens(model)[0]
            self = self.replace(max_new_tokens=self.decode_length(n))
        kind = model.config.kind
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
        if kind == "qwen2":
            raise ValueError(
                f"model kind {kind!r} (causal AR Qwen2) cannot run diffusion decoding; "
                "use a Dream / D2F / DiffuCoder / LLaDA model"
            )
        kw: dict = {"mask_token_id": mask, "eos_token_id": eos}
        if self.sampler is None:
            kw["sampler"] = "upstream" if self.strategy == "apd" else "keyed"
        kw["max_rounds"] = self.max_rounds if self.max_rounds is not None else 2 * self.max_new_tokens + 64
        if self.strategy == "vanilla":
            if kind == "llada":
                bad = [k for k in ("alg", "alg_temp", "eps") if getattr(self, k) is not None]
                if bad:
                    raise ValueError(
                        f"{bad[0]}={getattr(self, bad[0])!r} is a Dream vanilla knob, but the model is LLaDA; "
                        f"LLaDA vanilla knobs: {', '.join(LLADA_VANILLA_KNOBS)}"
                    )
                if self.top_p is not None or self.top_k is not None:
                    raise ValueError(
                        f"top_p={self.top_p!r} / top_k={self.top_k!r}: LLaDA vanilla sampling is Gumbel-max on raw "
                        "logits (no top-p/top-k); leave them None"
                    )
                bl = self.block_length if self.block_length is not None else self.max_new_tokens
                kw.update(
                    block_length=bl,
                    steps=self._vanilla_steps(),
                    remasking=self.remasking or "low_confidence",
                    cfg_scale=self.cfg_scale if self.cfg_scale is not None else 0.0,
                    logits_eos_inf=bool(self.logits_eos_inf),
                    confidence_eos_eot_inf=bool(self.confidence_eos_eot_inf),
                )
            else:
                bad = [k for k in LLADA_VANILLA_KNOBS if k != "steps" and getattr(self, k) is not None]
                if bad:
                    raise ValueError(
                        f"{bad[0]}={getattr(self, bad[0])!r} is a LLaDA vanilla knob, but the model is Dream-family; "
                        f"Dream vanilla knobs: {', '.join(DREAM_VANILLA_KNOBS)}"
                    )
                kw.update(
                    steps=self._vanilla_steps(),
                    alg=self.alg or "origin",
                    eps=self.eps if self.eps is not None else 1e-3,
                )
        elif self.strategy == "threshold":
            bl = self.block_length if self.block_length is not None else self.block_size
            kw.update(
                block_length=bl,
                steps=self.steps if self.steps is not None else self.max_new_tokens // bl,
                count_noop_forward=bool(self.count_noop_forward),
            )
        if self.strategy == "apd":
            kw.update(single_temperature=bool(self.single_temperature), coupled_gumbel=bool(self.coupled_gumbel),
                      exact_prev_logits=bool(self.exact_prev_logits))  # fmt: skip
        out = self.replace(**kw)
        if out.strategy in ("vanilla", "threshold"):
            out._check_blocks()  # the resolved block_length (default: block_size / max_new_tokens) and steps
        return out

    def _vanilla_steps(self) -> int:
        """Vanilla's steps (default max_new_tokens). More steps than positions only adds forwards that transfer
        nothing (upstream runs them): capped at max_new_tokens with a RuntimeWarning, or refused with
        on_round_cap="error" (the round-cap policy; a documented deviation, docs/decoding.md)."""
        if self.steps is None or self.steps <= self.max_new_tokens:
            return self.steps if self.steps is not None else self.max_new_tokens
        msg = (f"steps={self.steps} exceeds max_new_tokens={self.max_new_tokens} (at least one position per step); "
               "the extra steps would only repeat forwards")  # fmt: skip
        if self.on_round_cap == "error":
            raise KnobError(msg + "; pass steps <= max_new_tokens", knob="steps", value=self.steps)
        warnings.warn(msg + f"; capped at steps={self.max_new_tokens}", RuntimeWarning, stacklevel=4)
        return self.max_new_tokens

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


LopaConfig = GenerateConfig  # the name docs/architecture.md uses

DEFAULT_MAX_NEW_TOKENS = 512  # max_new_tokens=None when the model's generation_config.json has none


def default_max_new_tokens(model) -> tuple[int, str]:
    """(max_new_tokens, source) for `max_new_tokens=None`: `max_new_tokens` of the generation_config.json in the
    model's directory (`model.name_or_path`, set by load_model) when it has one, else DEFAULT_MAX_NEW_TOKENS."""
    import json
    from pathlib import Path

    from lopa_fast.errors import ConfigError

    where = getattr(model, "name_or_path", None)
    f = Path(where) / "generation_config.json" if where else None
    if f is None or not f.is_file():
        return DEFAULT_MAX_NEW_TOKENS, "default"
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{f}: unreadable ({e})", file=f) from None
    n = data.get("max_new_tokens") if isinstance(data, dict) else None
    if n is None:
        return DEFAULT_MAX_NEW_TOKENS, "default"
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < INT_KNOB_LIMIT:
        raise ConfigError(f"{f}: max_new_tokens={n!r}; expected an int >= 1", file=f, key="max_new_tokens", value=n)
    return n, "generation_config.json"
