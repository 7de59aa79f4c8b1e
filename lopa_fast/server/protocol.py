"""OpenAI request bodies -> a worker Job, and every refusal as a RequestError naming the field (HTTP 400).

A request body holds OpenAI fields and, beside them, any knob of `lopa_fast.generate` under its own name
(strategy, branching_factor, block_size, ...). The knobs are validated by `GenerateConfig` itself (the one list of
knobs and defaults): the server's defaults (`serve`'s flags, the model's generation_config.json sampling) then the
body's knobs. OpenAI fields:

    max_tokens (chat also max_completion_tokens)  -> max_new_tokens (None: the server's default)
    temperature, top_p, seed                       -> the knobs of the same name
    stop                                           -> text stops (str or a list of str; lists of ints are token-id
                                                      stops): lopa_fast.stream's one stop mechanism
    stream, stream_options.include_usage           -> server-sent events (usage rides on the finishing chunk; with
                                                      include_usage also on a usage-only chunk, as OpenAI sends)
    eos_token_id (an id or a list: the extra ids end decoding as token-id stops), top_k 0 / -1 (off), do_sample,
    pad_token_id / use_cache (accepted), typical_p, ... (refused naming the lopa_fast way): as lopa_fast.generate
    takes them (lopa_fast.request.aliases; docs/decoding.md "Knobs from other libraries")
    prompt (completions: str, [str] or [int] token ids), messages (chat: role + text content, the tokenizer's
    chat template), model (the served id, else 404), user (accepted, unused)
    n > 1, best_of > 1, logprobs, top_logprobs, echo, suffix, logit_bias, presence/frequency_penalty != 0, tools,
    functions, a non-text response_format                     -> 400: not implemented (never silently ignored)

Errors are mapped by type, never by message text: a RequestError carries its field; a lopa_fast KnobError its
`.knob` (max_new_tokens reported as max_tokens, prompt as prompt / messages); a plain ValueError / TypeError raised
while a stage runs is blamed on that stage's field (a knob's is found by validating each given knob on its own).
"""
from __future__ import annotations

import dataclasses
import json
import random
import warnings

import pydantic

from lopa_fast import api
from lopa_fast.request import aliases, plan
from lopa_fast import strategies
from lopa_fast.config import MAX_STOP_SEQUENCES, GenerateConfig
from lopa_fast.keyed import needs_draws
from lopa_fast.errors import KnobError, LopaError, MemoryBudgetError
from lopa_fast.server.limits import LimitError, Limits
from lopa_fast.server.served import NOT_SERVED, OPERATOR_ONLY  # noqa: F401  (re-exported)
from lopa_fast.request.text import (chat_ids, check_text_prompt, check_unicode, encode_prompt, max_token_chars,
                                    split_stops, unknown_note, unknown_words)

KNOBS = tuple(f.name for f in dataclasses.fields(GenerateConfig))
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")
COMMON_FIELDS = ("model", "stream", "stream_options", "n", "stop", "user", "logprobs", "logit_bias",
                 "presence_penalty", "frequency_penalty", *MAX_TOKENS_FIELDS)
ENDPOINT_FIELDS = {
    "completions": ("prompt", "echo", "suffix", "best_of"),
    "chat": ("messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
             "function_call", "response_format"),
}
CHAT_ROLES = ("system", "user", "assistant", "developer")


class RequestError(Exception):
    """A refused request: HTTP `status`, the OpenAI error `type`, the offending field `param` (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Parsed:
    """A request after parsing: what the worker needs plus what the response echoes."""

    prompt_ids: list[int]
    knobs: dict  # merged: the server's defaults, then the body's (validated)
    stop: list | None
    stream: bool
    warnings: list[str]
    include_usage: bool = False  # stream_options.include_usage: a usage-only chunk before [DONE]
    memory: int = 0  # the request's memory estimate (limits.Limits.check), reserved while it runs
    # the request resolved and checked ONCE, here: its lopa_fast.request.plan.Plan (bound config with its stops and
    # seed), its text stops and the pieces' unit (the requested config's length unit); the worker runs the plan
    plan: object = None
    text_stops: list = dataclasses.field(default_factory=list)
    unit: int = 1


def _openai_knob_name(knob: str | None, endpoint: str) -> str | None:
    if knob == "max_new_tokens":
        return "max_tokens"
    if knob in ("prompt", "input_ids"):  # input_ids: the prompt's token ids, as generate names them
        return "messages" if endpoint == "chat" else "prompt"
    return knob


# a request's text stops, all together (UTF-8 bytes): each is tokenised when the request is parsed and searched in
# the answer text at every streamed delta; 60,000 stops (720 KB) took 4.6 s and slowed a normal request beside
# them from 0.03 s to 2.27 s (issue 43, finding 2). Their count is capped by MAX_STOP_SEQUENCES (config).
MAX_STOP_BYTES = 4096
MAX_CHOICES = 16  # choices of one request (prompts x n): each is a request of its own in the worker's queue


def fan_out(body, endpoint: str, defaults: dict) -> tuple[list[dict], int] | None:
    """(the requests a body with several choices stands for, one body each in choice order: prompt by prompt, n
    samples each; n), or None for a body of one choice (`parse` checks it). Several choices: a list of prompts in a
    completions body (texts or token-id lists), or `n` > 1 at temperature > 0 (choice j of a prompt decodes with
    seed `seed + j`; seed unset: one drawn for the request). RequestError for `n` > 1 at temperature 0 (n identical
    choices), a streamed request of several choices, or more than MAX_CHOICES."""

    if not isinstance(body, dict):
        return None
    n = body.get("n")
    prompts = body.get("prompt") if endpoint == "completions" else None
    several = (isinstance(prompts, list) and len(prompts) > 1
               and all(isinstance(p, (str, list)) for p in prompts))
    if not several and (n is None or n == 1):
        return None
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestError(f"n={n!r}; expected an int >= 1 (choices per prompt)", "n")
    temperature = body.get("temperature", defaults.get("temperature", 0.0))
    if n > 1 and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise RequestError(f"n={n} at temperature {temperature!r} gives {n} identical choices; n > 1 samples, with "
                           "temperature > 0 (choice j seeded seed + j)", "n")
    count = (len(prompts) if several else 1) * n
    if count > MAX_CHOICES:
        raise RequestError(f"{count} choices in one request (prompts x n); this server takes at most {MAX_CHOICES}",
                           "n" if n > 1 else "prompt")
    if body.get("stream"):
        raise RequestError("stream: true streams one choice; send one request per prompt and sample", "stream")
    seed = body.get("seed")
    if n > 1 and seed is None:
        seed = random.randrange(2**31 - MAX_CHOICES)
    out = []
    for p in (prompts if several else [body.get("prompt")] if endpoint == "completions" else [None]):
        for j in range(n):
            sub = {k: v for k, v in body.items() if k != "n"}
            if endpoint == "completions":
                sub["prompt"] = p
            if n > 1:
                sub["seed"] = seed + j if isinstance(seed, int) and not isinstance(seed, bool) else seed
            out.append(sub)
    return out, n


def _refuse_unsupported(body: dict, endpoint: str) -> None:
    """400 for the OpenAI features not implemented, when the request asks for them."""
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise RequestError(f"n={n!r}: one choice here; n > 1 samples at temperature > 0 (choice j seeded seed + j)",
                           "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise RequestError(f"best_of={best_of!r}: only best_of=1 is served", "best_of")
    if body.get("logprobs") not in (None, False):
        raise RequestError(f"logprobs={body['logprobs']!r}: log-probabilities are not implemented", "logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError("top_logprobs: log-probabilities are not implemented", "top_logprobs")
    if body.get("echo") not in (None, False):
        raise RequestError("echo=true is not implemented", "echo")
    if body.get("suffix") is not None:
        raise RequestError("suffix (insertion) is not implemented", "suffix")
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not implemented", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"{name}={body[name]!r}: penalties are not implemented (pass 0 or leave it out)", name)
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise RequestError(f"{name}: tool / function calling is not implemented", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError(f"response_format={fmt!r}: only {{'type': 'text'}} is served", "response_format")


class StreamOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    include_usage: pydantic.StrictBool = False


class OpenAIFields(pydantic.BaseModel):
    """The JSON types of the OpenAI fields that are not knobs (pydantic, strict: `n: true` is not 1); the knobs
    beside them are GenerateConfig's to check. A null field was dropped before (null = the default)."""

    model_config = pydantic.ConfigDict(extra="allow", strict=True)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    best_of: int | None = None
    echo: bool | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | int | None = None
    frequency_penalty: float | int | None = None


def _check_types(body: dict) -> None:
    """The OpenAI fields that are not knobs: their JSON types (OpenAIFields); a refusal names the field."""
    try:
        OpenAIFields.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        shown = repr(body.get(field))[:80] if field is not None else ""
        raise RequestError(f"{field}={shown}: {err['msg']}", field) from None


def _knobs_of(body: dict, endpoint: str) -> tuple[dict, list]:
    """(the body's generate knobs (OpenAI names mapped), token-id stops from a list eos_token_id); unknown fields are
    refused by name; other libraries' names (do_sample, top_k -1, pad_token_id, typical_p, ...) as generate takes
    or refuses them (lopa_fast.request.aliases)."""
    allowed = set(COMMON_FIELDS) | set(ENDPOINT_FIELDS[endpoint])
    knobs: dict = {}
    for name, value in body.items():
        if name in allowed or name == "stop":
            continue
        if name == "max_length":
            raise RequestError(f"max_length={value!r}: pass max_tokens (the new tokens; max_length is HF's prompt + "
                               "new tokens)", name)
        if name in aliases.NAMES:
            knobs[name] = value
            continue
        if name in NOT_SERVED or name in OPERATOR_ONLY:
            why = NOT_SERVED.get(name) or OPERATOR_ONLY[name]
            raise RequestError(f"{name}: not accepted by the server ({why})", name)
        if name in ("temperature", "top_p", "seed") or name in KNOBS:
            knobs[name] = value
            continue
        other = "chat" if endpoint == "completions" else "completions"
        hint = f" (a field of the {other} endpoint)" if name in ENDPOINT_FIELDS[other] else ""
        raise RequestError(f"unknown field {name!r}{hint}; the body takes OpenAI fields and the knobs of "
                           "lopa_fast.generate (docs/serve.md)", name)
    given = [f for f in MAX_TOKENS_FIELDS if body.get(f) is not None]
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} both given; pass one", given[1])
    if given:
        knobs["max_new_tokens"] = body[given[0]]
    extra_stops: list = []
    if aliases.applies(knobs):
        try:
            knobs = aliases.translate(knobs, None)
        except KnobError as e:
            raise RequestError(str(e), e.knob) from e
        extra_stops = [list(q) for q in knobs.pop("stop", None) or []]  # a list eos_token_id's extra ids
    return knobs, extra_stops


def blame_knob(knobs: dict, defaults: dict, model=None) -> str | None:
    """The knob of `knobs` (a request's) to blame for a failed validation on top of `defaults` (and, with a model,
    resolution against it): the one whose removal makes the request valid (e.g. `cache` given with a strategy
    that has no cache), else the first that fails on its own, else the first given (a combination); None when
    the request gave no knob."""
    def ok(kn: dict) -> bool:
        try:
            cfg = GenerateConfig(**{**defaults, **kn}).validate()
            if model is not None:
                cfg.resolve(model)
        except (ValueError, TypeError):
            return False
        return True

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if len(knobs) > 1:
            for name in knobs:
                if ok({k: v for k, v in knobs.items() if k != name}):
                    return name
        for name, value in knobs.items():
            if not ok({name: value}):
                return name
    return next(iter(knobs), None)


def checked(stage_param: str | None, fn, *args, knobs=None, defaults=None, model=None, endpoint="completions"):
    """Run one validation stage; its errors become RequestErrors naming the field (module docstring)."""
    try:
        return fn(*args)
    except RequestError:
        raise
    except KnobError as e:
        raise RequestError(str(e), _openai_knob_name(e.knob, endpoint) or stage_param) from e
    except MemoryBudgetError as e:
        raise RequestError(str(e), "max_tokens") from e
    except LopaError:
        raise
    except (ValueError, TypeError) as e:
        param = stage_param
        if param is None and knobs is not None:
            param = _openai_knob_name(blame_knob(knobs, defaults or {}, model), endpoint)
        raise RequestError(str(e), param) from e


def _check_stop_caps(stop) -> None:
    """RequestError (field "stop") before any stop is tokenised: more than MAX_STOP_SEQUENCES entries, text stops of
    more than MAX_STOP_BYTES UTF-8 bytes together, or a text stop holding a lone UTF-16 surrogate (no tokenizer can
    encode one; its own message does not name the field)."""
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        return  # split_stops names the wrong type
    if len(items) > MAX_STOP_SEQUENCES:
        raise RequestError(f"stop: {len(items)} sequences; allowed: at most {MAX_STOP_SEQUENCES}", "stop")
    size = 0
    for i, item in enumerate(items):
        if isinstance(item, str):
            try:
                check_unicode(item, f"stop[{i}]")
            except KnobError as e:
                raise RequestError(str(e), "stop") from e
            size += len(item.encode("utf-8"))
    if size > MAX_STOP_BYTES:
        raise RequestError(f"stop: {size} bytes of text stops; allowed: at most {MAX_STOP_BYTES} UTF-8 bytes in all",
                           "stop")


def _plan(cfg, model, prompt_len):
    """GenerateConfig.plan_length, its KnobError on max_new_tokens blamed on the stage's field (prompt or
    max_tokens) rather than on the knob."""
    try:
        return cfg.plan_length(model, prompt_len)
    except KnobError as e:
        raise ValueError(str(e)) from e


def _check_text_length(chars: int, max_len: int, tokenizer, field: str) -> None:
    """Refuse, before tokenising, a text longer than `max_len` tokens can hold (a 1 MiB prompt took 9.9 s of a
    shared parse thread and +490 MiB to be refused after tokenising: issue 36)."""
    cap = max_len * max_token_chars(tokenizer)
    if chars > cap:
        raise RequestError(f"{field}: {chars} characters; at most {cap} fit the {max_len} positions of this server "
                           f"(--max-model-len) at {max_token_chars(tokenizer)} characters per token (the tokenizer's "
                           "longest); refused before tokenising", field)


def _chat_ids(tokenizer, messages, warn, max_len: int) -> list[int]:
    """Token ids of a chat: the tokenizer's chat template over the messages, with the generation prompt."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise RequestError(f"messages[{i}]: expected an object with role in {', '.join(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are served", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: expected text", "messages")
        check_unicode(content, f"messages[{i}].content")
        if set(m) - {"role", "content", "name"}:
            extra = sorted(set(m) - {"role", "content", "name"})
            raise RequestError(f"messages[{i}]: fields {extra} are not served", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not clean[-1]["content"].strip():
        raise RequestError("messages: the last message is empty (or only whitespace)", "messages")
    _check_text_length(sum(len(m["content"]) for m in clean), max_len, tokenizer, "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("the model's tokenizer has no chat template; use /v1/completions", "messages")
    missing = list(dict.fromkeys(w for m in clean for w in unknown_words(tokenizer, m["content"])))
    if missing:
        warn(unknown_note(tokenizer, missing))
    return chat_ids(tokenizer, clean)


def _completion_ids(tokenizer, prompt, warn, max_len: int) -> list[int]:
    """Token ids of a completions prompt: text (the tokenizer's own specials) or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        check_text_prompt(prompt)
        _check_text_length(len(prompt), max_len, tokenizer, "prompt")
        return encode_prompt(tokenizer, prompt, warn=warn)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"prompt: {len(prompt)} prompts in one request; send one prompt per request", "prompt")
    if prompt is None or prompt == []:
        raise RequestError("prompt: required (text or a list of token ids)", "prompt")
    raise RequestError(f"prompt: {type(prompt).__name__}; expected text or a list of token ids", "prompt")


def parse(body, endpoint: str, model, tokenizer, defaults: dict, limits: Limits | None = None,
          verifier=None) -> Parsed:
    """Check an OpenAI request body (endpoint "completions" or "chat") and build what the worker runs.

    defaults: the server's knobs (validated at start-up); the body's knobs replace them; limits: the server's caps
    (limits.Limits, bound to the model), checked once the config is bound, before anything is allocated.
    verifier: the server's APD verifier (serve --verifier) or None: a request that needs one without it is refused
    naming the knob that asks for it (apd_mixture_weight). Raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    body = {k: v for k, v in body.items() if v is not None}  # null means the default, as OpenAI servers read it
    _check_types(body)
    _refuse_unsupported(body, endpoint)
    knobs, extra_stops = _knobs_of(body, endpoint)
    merged = {**defaults, **knobs}
    if knobs.get("strategy", defaults.get("strategy")) != defaults.get("strategy"):  # another strategy than the
        # server's: the model's own knobs for it under the body's (request.model_defaults; issue 42, finding 2)
        from lopa_fast.request.model_defaults import merge, model_knobs

        own = model_knobs(getattr(model, "name_or_path", None), knobs["strategy"])
        merged = merge({**defaults, **own}, knobs) if own else merged
    # stage 1: the knobs on their own (GenerateConfig.validate, no model)
    cfg = checked(None, lambda: GenerateConfig(**merged).validate(), knobs=knobs, defaults=defaults,
                  endpoint=endpoint)
    spec = strategies.get(cfg.strategy)
    checked(None, api.check_verifier_given, cfg, verifier is not None and spec.takes_verifier,
            "serve --verifier DIR (this server was started without one)", endpoint=endpoint)
    notes: list[str] = list(cfg.sampling_notes())  # set but without effect (top_p at temperature 0, ...)
    # stage 2: the prompt
    field = "messages" if endpoint == "chat" else "prompt"
    limit = model.config.max_position_embeddings
    max_len = min(limit, limits.max_model_len or limit) if limits is not None else limit
    if endpoint == "chat":
        ids = checked(field, _chat_ids, tokenizer, body.get("messages"), notes.append, max_len, endpoint=endpoint)
    else:
        ids = checked(field, _completion_ids, tokenizer, body.get("prompt"), notes.append, max_len, endpoint=endpoint)
    if len(ids) >= limit:
        raise RequestError(f"{field}: too long ({len(ids)} tokens); the model has max_position_embeddings={limit} "
                           "positions for the prompt and the answer together", field)
    # stage 3: the stops
    stop = body.get("stop")
    seqs, text_stops = None, []
    if extra_stops:  # a list eos_token_id's extra ids: token-id stops beside the body's
        stop = [*([stop] if isinstance(stop, str) else (stop or [])), *extra_stops]
    if stop is not None:
        _check_stop_caps(stop)
        seqs, text_stops = checked("stop", split_stops, tokenizer, stop, endpoint=endpoint)
        if seqs:  # the token-id stops: GenerateConfig's rules (1..32 ids >= 0, how many), then the vocabulary
            checked("stop", lambda: GenerateConfig(**{**merged, "stop": seqs}).validate(), endpoint=endpoint)
            vocab = model.config.vocab_size
            big = next((q for q in seqs if max(q) >= vocab), None)
            if big is not None:
                raise RequestError(f"stop sequence {big!r} holds id {max(big)}; allowed: ids in "
                                   f"[0, vocab_size={vocab})", "stop")
    # stage 4: what generate checks with the model and the prompt, before any forward
    ids_t = checked(field, api.prepare_prompt, model, ids, endpoint=endpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generate warns itself when it runs
        # no max_tokens and a prompt that leaves less than one block: the prompt is to blame
        length_field = "max_tokens" if merged.get("max_new_tokens") is not None else field
        planned, length = checked(length_field, _plan, cfg, model, ids_t.numel(), endpoint=endpoint)
        bound = checked(None, planned.resolve, model, knobs=knobs, defaults=defaults, model=model,
                        endpoint=endpoint)
        if merged.get("seed") is None and needs_draws(bound):  # e.g. vanilla's `origin` reveal at temperature 0:
            # unseeded, two identical calls differed with no word (issue 43, finding 7); now seeded here and said
            merged["seed"] = random.randrange(2**31)
            notes.append(f"seed: none given and this request draws random numbers ({cfg.strategy}"
                         f"{', alg=origin' if getattr(bound, 'alg', None) == 'origin' else ''}, temperature "
                         f"{bound.temperature:g}); it ran with seed={merged['seed']} (pass it to repeat this answer)")
        memory = 0
        if limits is not None:
            try:
                memory = limits.check(model, bound, ids_t.numel(), verifier)
            except LimitError as e:
                raise RequestError(str(e), _openai_knob_name(e.field, endpoint)) from e
        checked(field, api.check_prompt, model, ids_t, bound, endpoint=endpoint)
        fn, ran, fallback = checked("backend", api.resolve_backend, bound, True, endpoint=endpoint)
        uses = verifier is not None and spec.uses_verifier(bound)
        if uses:
            checked(field, api.check_pair, model, verifier, ids_t, bound, endpoint=endpoint)
    # the plan the worker runs, built once from what was checked above: the bound config with the request's token-id
    # stops (checked in stage 3) and its seed (drawn above when it was missing)
    final = bound.replace(stop=seqs or None, seed=merged.get("seed"))
    request_plan = plan.Plan(model, final, spec, ids_t, length, fn, ran, fallback, verifier if uses else None)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
    return Parsed(ids, merged, stop, bool(body.get("stream", False)), notes, include_usage, memory, request_plan,
                  list(text_stops), max(1, cfg.length_unit(spec)))


def model_sampling_defaults(model_dir) -> dict:
    """temperature / top_p / top_k from the model's generation_config.json when it samples (do_sample not false),
    else {} (the knobs' own defaults: temperature 0, greedy)."""
    from pathlib import Path

    f = Path(model_dir) / "generation_config.json"
    if not f.is_file():
        return {}
    data = json.loads(f.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("do_sample") is False:
        return {}
    return {k: data[k] for k in ("temperature", "top_p", "top_k") if data.get(k) is not None}
