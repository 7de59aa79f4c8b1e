"""`lopa_fast.generate`: the public entry points and the run.

Every strategy implementation, reference or fast, has one signature:

    fn(model, prompt_ids: LongTensor [P] (on model.device), cfg: GenerateConfig (bound)) -> GenerateOutput

Each strategy's spec in the registry (lopa_fast.strategies) names both: its reference (lopa_fast.reference.*, the
oracle) and its fast decoder (lopa_fast.decode.*), imported on first use. A call resolves its arguments once into a
validated plan (lopa_fast.request.plan: knobs, prompt, lengths, memory, backend, verifier pair, batching) before any
forward, and runs it: implementations may assume a bound, valid config and a clean prompt. The jobs live in their
own modules: lopa_fast.request.prompts (the prompt), lopa_fast.request.decoder (which backend runs),
lopa_fast.request.verifiers (the second model), lopa_fast.request.prompt_batch (a list of prompts),
lopa_fast.output.text_streamer (streamer=), lopa_fast.output.finish (cutting the output); their public names are
importable from here too.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from lopa_fast.request import aliases, plan, prompt_batch, threads
from lopa_fast.request.decoder import resolve_backend  # noqa: F401  (public here: the CLI, the server, stream)
from lopa_fast.config import GenerateConfig
from lopa_fast.output.finish import cut_to_length
from lopa_fast.memory import check_request_memory
from lopa_fast.request.model_defaults import with_model_knobs
from lopa_fast.output import GenerateOutput
from lopa_fast.request.prompts import is_batch, is_text, prepare_prompt, prompt_lens  # noqa: F401  (public here)
from lopa_fast.request.prompts import check_prompt as _check_prompt_ids
from lopa_fast.output.text_streamer import check_streamer, streamer_hook
from lopa_fast.request.verifiers import check_pair, check_verifier_fits, check_verifier_given  # noqa: F401  (public here)


def check_prompt(model, ids: torch.Tensor, cfg: GenerateConfig) -> None:
    """Checks that need both the prompt [P] and the bound config (lopa_fast.request.prompts.check_prompt: id range, mask
    id in the prompt, length), then the request's memory estimate (`check_request_memory`)."""
    _check_prompt_ids(model, ids, cfg)
    check_request_memory(model, ids.numel() + cfg.max_new_tokens, cfg, ids.numel())


_POSITIONAL_KNOBS = ("strategy", "backend")  # generate(model, ids, "lopa", "fast", ...) reads naturally


def _generate_signature() -> inspect.Signature:
    """generate(model, input_ids, strategy, backend, *, <every other GenerateConfig field>): the knobs and
    their defaults come from the GenerateConfig dataclass only, so users and tools see them in one place."""
    P = inspect.Parameter
    params = [P("model", P.POSITIONAL_OR_KEYWORD), P("input_ids", P.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(GenerateConfig):
        kind = P.POSITIONAL_OR_KEYWORD if f.name in _POSITIONAL_KNOBS else P.KEYWORD_ONLY
        params.append(P(f.name, kind, default=f.default, annotation=f.type))
    # the arguments that are not knobs (never stored in the copyable config): APD's verifier model and the
    # per-round progress hook
    params.append(P("verifier", P.KEYWORD_ONLY, default=None))
    params.append(P("on_round", P.KEYWORD_ONLY, default=None))
    params.append(P("tokenizer", P.KEYWORD_ONLY, default=None))
    params.append(P("streamer", P.KEYWORD_ONLY, default=None))
    return inspect.Signature(params, return_annotation="GenerateOutput")


_SIGNATURE = _generate_signature()


def _bound(model, input_ids, args: tuple, knobs: dict) -> dict:
    """generate's arguments by name, as `_SIGNATURE.bind(...).arguments` gives them (knobs already known names). A call
    whose extra positionals fill the positional knobs (strategy, backend) no keyword repeats is mapped directly:
    Signature.bind raises and catches a KeyError for every keyword-only parameter it does not receive (~40 a call,
    ~150 us of a tiny CPU request); any other call goes through bind, which raises the TypeError Python would."""
    named = {"model", "input_ids", *_POSITIONAL_KNOBS[: len(args)]}  # what the positionals already name
    if len(args) <= len(_POSITIONAL_KNOBS) and not named & knobs.keys():
        return {"model": model, "input_ids": input_ids, **dict(zip(_POSITIONAL_KNOBS, args)), **knobs}
    return dict(_SIGNATURE.bind(model, input_ids, *args, **knobs).arguments)


def generate(model, input_ids, *args, **knobs) -> GenerateOutput:
    """Decode `max_new_tokens` positions after the prompt with a diffusion LM.

    model:      a DecoderLM from `lopa_fast.load_model` (Dream / D2F / DiffuCoder / LLaDA family).
    input_ids:  LongTensor [P] or [1, P] on the model's device, or list[int]; or a list of such prompts (any
                lengths): then a list of GenerateOutput, one per prompt, each equal to decoding it alone
                (every strategy whose spec has a batch driver, on the fast backend: vanilla, threshold, d2f, lopa,
                apd, share one forward per round / step: `generate_batch`).
    strategy:   "vanilla" | "threshold" | "d2f" | "lopa" | "apd" (docs/decoding.md describes each and its knobs).
    backend:    "auto" (the default: the fast backend wherever it covers the request, else the reference with
                a RuntimeWarning naming the knob, e.g. sampler="upstream" at T > 0) | "fast" (raises where it
                does not cover) | "reference" (per-branch Python, the semantics oracle).
    Every other knob is keyword-only, with the defaults and one-line descriptions of `lopa_fast.GenerateConfig`'s
    fields (the one place they are written; `inspect.signature(generate)` shows them; D2F / LoPA knobs keep
    upstream names; a strategy-specific knob left None runs as the strategy's default).
    verifier:   strategy="apd" only: the causal AR qwen2 model that verifies the drafts (its vocabulary a
                prefix of the drafter's); None with apd_mixture_weight=None runs the leftright baseline.
    stop:       token-id sequences (every strategy): decoding ends once one lies in the finalised prefix (the
                tokens before the first mask); the output is cut before it, finish_reason "stop".
    on_round:   a progress hook `on_round(prefix, info)` called after every round / step with the accepted
                sequence's finalised prefix (list[int]: generated ids before its first mask) and info
                {"round", "forwards", "canvas" (every decoded position, mask id where not yet filled),
                "mask_token_id"} (lopa_fast.output.progress.report_round). It costs one host read per round (the
                fast backend otherwise reads only its small round head). An exception raised by the hook
                ends decoding and propagates. lopa_fast.stream is built on it.

    HF / Dream / LLaDA names: max_length (prompt + new tokens), gen_length, do_sample, a list eos_token_id are
    translated where they mean the same; num_beams, repetition_penalty, ... are refused naming lopa_fast's knob
    (lopa_fast.request.aliases).

    Returns GenerateOutput(generated_ids: list[int] of every generated position, stats, trace).
    """
    if "num_return_sequences" in knobs:  # HF: n samples of one prompt (T > 0), a list of outputs
        return _return_sequences(model, input_ids, args, knobs, knobs.pop("num_return_sequences"))
    if "attention_mask" in knobs and not is_text(input_ids) and _padded(input_ids, knobs["attention_mask"]):
        # HF's padded batch [B, P] + attention_mask: the unpadded rows, decoded as a list of prompts (each equal to
        # decoding it alone); one row: one output, as for an unpadded [1, P]
        rows = aliases.unpad(input_ids, knobs.pop("attention_mask"))
        input_ids = rows[0] if len(rows) == 1 else rows
    if "stop_strings" in knobs:  # HF's text stops: the same as text items of stop= (with the tokenizer)
        knobs["stop"] = _with_stop_strings(knobs.get("stop"), knobs.pop("stop_strings"))
    tokenizer, streamer = knobs.pop("tokenizer", None), knobs.pop("streamer", None)
    text_stops: list[str] = []
    stop = knobs.get("stop")
    has_text_stop = isinstance(stop, str) or (isinstance(stop, (list, tuple)) and any(isinstance(q, str) for q in stop))
    if tokenizer is None and (is_text(input_ids) or has_text_stop):
        tokenizer = known_tokenizer(model, "a str prompt" if is_text(input_ids) else "a text stop")
    if tokenizer is not None:
        from lopa_fast.request.text import encode_prompt, split_stops

        if isinstance(input_ids, str):
            input_ids = encode_prompt(tokenizer, input_ids)
        elif isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(p, str) for p in input_ids):
            input_ids = [encode_prompt(tokenizer, p) for p in input_ids]
        if has_text_stop:
            seqs, text_stops = split_stops(tokenizer, stop)
            knobs.pop("stop")
            if seqs:
                knobs["stop"] = seqs
    if aliases.applies(knobs):  # HF / Dream / LLaDA / vLLM names (lopa_fast.request.aliases)
        need = {"max_length", "attention_mask"} & set(knobs)
        knobs = aliases.translate(knobs, prompt_lens(input_ids) if need else None)
    unknown = sorted(set(knobs) - set(_SIGNATURE.parameters))
    if unknown:
        raise aliases.unknown_knobs_error("generate", unknown, set(_SIGNATURE.parameters) - {"model", "input_ids"})
    kw = _bound(model, input_ids, args, knobs)
    model, input_ids = kw.pop("model"), kw.pop("input_ids")
    extra = {k: v for k in ("verifier", "on_round") if (v := kw.pop(k, None)) is not None}
    kw = with_model_knobs(model, kw)  # the model's own knobs where none is given (lopa_fast.request.model_defaults)
    if streamer is not None:
        extra["streamer"] = streamer
    out = generate_with_config(model, input_ids, GenerateConfig(**kw), **extra)
    if tokenizer is not None:
        from lopa_fast.request.text import answer_text, text_decoder

        eos = kw.get("eos_token_id")
        eos = eos if eos is not None else model.eos_token_id
        for o in out if isinstance(out, list) else [out]:
            o.text = answer_text(o, text_decoder(tokenizer), eos, text_stops)
    return out


def _padded(input_ids, mask) -> bool:
    """Whether generate's input is HF's padded batch: a [B, P] input with B > 1, or a mask with a zero (padding)."""
    try:
        m = torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError):
        return False  # aliases.check_attention_mask names it
    rows = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else (
        len(input_ids) if is_batch(input_ids) else 1)
    return rows > 1 or bool((m == 0).any())


def _with_stop_strings(stop, strings) -> list:
    """stop= with HF's stop_strings= added as text stops (KnobError naming stop_strings when it is not text)."""
    from lopa_fast.errors import KnobError

    strings = [strings] if isinstance(strings, str) else strings
    if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(q, str) and q for q in strings):
        raise KnobError(f"stop_strings={strings!r}; expected a non-empty str or list of them (text stops, as stop=)",
                        knob="stop_strings", value=strings)
    stop = [] if stop is None else ([stop] if isinstance(stop, str) else list(stop))
    return [*stop, *strings]


def _return_sequences(model, input_ids, args, knobs: dict, n) -> list[GenerateOutput]:
    """HF's num_return_sequences=n (sampling, T > 0): n outputs of one prompt, the i-th decoded with seed
    `seed + i` (seed None: one drawn from torch's global generator), so each is reproducible alone. KnobError at
    temperature 0 (n identical greedy outputs), for a list of prompts or with a streamer."""
    from lopa_fast.errors import KnobError

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KnobError(f"num_return_sequences={n!r}; expected an int >= 1", knob="num_return_sequences", value=n)
    if n == 1:
        return generate(model, input_ids, *args, **knobs)
    t = knobs.get("temperature")
    if knobs.get("do_sample") is False or not (isinstance(t, (int, float)) and t > 0):
        raise KnobError(f"num_return_sequences={n} samples {n} outputs and needs temperature > 0 (greedy decoding "
                        f"gives {n} identical ones); got temperature={t!r}", knob="num_return_sequences", value=n)
    if is_batch(input_ids) or (isinstance(input_ids, (list, tuple)) and is_text(input_ids) and len(input_ids) > 1):
        raise KnobError(f"num_return_sequences={n} samples one prompt; got a list of prompts (repeat the prompts "
                        "in the list, with seeds, for several each)", knob="num_return_sequences", value=n)
    if knobs.get("streamer") is not None:
        raise KnobError(f"num_return_sequences={n} with streamer=: a streamer takes one output",
                        knob="num_return_sequences", value=n)
    seed = knobs.get("seed")
    base = seed if seed is not None else int(torch.randint(0, 2**31 - n, ()).item())
    return [generate(model, input_ids, *args, **{**knobs, "seed": base + i}) for i in range(n)]


def known_tokenizer(model, why: str):
    """The tokenizer of a model loaded from a directory (lopa_fast.load_model sets `name_or_path`), loaded once and
    kept on the model; a TypeError saying to pass tokenizer= when the model has none."""
    tok = getattr(model, "_lopa_fast_tokenizer", None)
    if tok is not None:
        return tok
    where = getattr(model, "name_or_path", None)
    import os

    if not where or not os.path.isdir(str(where)):
        raise TypeError(f"generate(): {why} needs a tokenizer, and this model was not loaded from a directory; pass "
                        "tokenizer= (lopa_fast.load_tokenizer(dir)) or token ids")
    from lopa_fast.models.loading import load_tokenizer

    tok = load_tokenizer(where)
    try:
        model._lopa_fast_tokenizer = tok
    except AttributeError:
        pass
    return tok


generate.__signature__ = _SIGNATURE


def generate_with_config(model, input_ids, cfg: GenerateConfig, verifier=None, on_round=None,
                         engine=None, streamer=None) -> GenerateOutput:
    """`generate` with a prepared GenerateConfig (validated and bound to the model here).

    verifier: APD's verifier model (strategy="apd" only); passed to the strategy as `verifier=`.
    on_round: the per-round progress hook (see `generate`); passed to the strategy as `on_round=`.
    engine:   a lopa_fast.decode.batch.BatchEngine (the server's): a request it covers (`batchable`: a strategy with
              a batch driver on the fast backend; with compile=True one whose driver runs compiled batched steps)
              joins its running batch (the same result as decoding alone); others run here.
    streamer: a TextStreamer-style object (`put(ids)`, `end()`, as Hugging Face's generate drives it): put(prompt
              [1, P]) first, then put(new ids [n]) as they become final (the tokens before the first mask, cut at the
              requested length and before a stop sequence, so the puts join to the returned generated_ids), end()."""
    if not isinstance(cfg, GenerateConfig):
        raise TypeError(f"cfg: {type(cfg).__name__}; expected a lopa_fast.GenerateConfig")
    check_streamer(streamer)
    if is_batch(input_ids):
        if streamer is not None:
            raise ValueError("streamer= streams one prompt (as in transformers); got a list of prompts")
        return generate_batch(model, list(input_ids), cfg, verifier, on_round)
    p = plan.make(model, input_ids, cfg, verifier=verifier, on_round=on_round, streamer=streamer)
    return run_plan(p, engine)


def on_engine(p: plan.Plan, engine) -> bool:
    """Whether `engine` (a BatchEngine, the server's) covers the resolved request `p`: it then decodes there, in the
    running batch."""
    return engine is not None and p.backend == "fast" and engine.covers(p.cfg, p.spec)


def finish_output(p: plan.Plan, out: GenerateOutput, batched: bool = False) -> GenerateOutput:
    """A decoded request's output as generate returns it: its stats (strategy, backend, fallback, batched: it
    decoded on the engine) and cut to the requested length (lopa_fast.output.finish.cut_to_length)."""
    if batched:
        out.stats["batched"] = True
    out.stats.setdefault("strategy", p.cfg.strategy)
    out.stats["backend"] = p.backend
    if p.fallback is not None:
        out.stats["fallback"] = p.fallback
    return cut_to_length(out, p.length, p.cfg)


def run_plan(p: plan.Plan, engine=None) -> GenerateOutput:
    """Run one resolved request (lopa_fast.request.plan.Plan) and cut its output: on `engine` (a BatchEngine, the
    server's) when it covers the request, else the plan's implementation; the streamer driven when the plan has one."""
    on_round, finish = p.on_round, None
    if p.streamer is not None:
        on_round, finish = streamer_hook(p.streamer, p.ids, p.cfg, p.length["requested"], on_round)
    batched = on_engine(p, engine)
    with torch.inference_mode(), threads.scoped(p.model):  # small CPU models: one thread for the call (threads.py)
        if batched:
            out = engine.generate(p.ids, p.cfg, on_round, p.verifier, spec=p.spec)
        else:
            out = p.fn(p.model, p.ids, p.cfg, **p.extra(on_round))
    out = finish_output(p, out, batched)
    if finish is not None:
        finish(out)
    return out


def generate_batch(model, prompts: list, cfg: GenerateConfig, verifier=None, on_round=None) -> list[GenerateOutput]:
    """`generate` for a list of prompts (any lengths): one GenerateOutput per prompt, in order, each equal to
    decoding that prompt alone (which requests share forwards: lopa_fast.request.prompt_batch). on_round: one hook for
    all prompts or a list (one per prompt). Every prompt is checked before any forward."""
    batch = plan.make_batch(model, prompts, cfg, verifier=verifier, on_round=on_round)
    if batch.batched:
        return prompt_batch.run(batch.plans)
    return [run_plan(p) for p in batch.plans]
