"""`lopa_fast.generate`: validate the knobs and the prompt, pick strategy + backend, run, return stats.

Every strategy implementation, reference or fast, has one signature:

    fn(model, prompt_ids: LongTensor [P] (on model.device), cfg: GenerateConfig (bound)) -> GenerateOutput

Each strategy's spec in the registry (lopa_fast.strategies) names both: its reference (lopa_fast.reference.*, the
oracle) and its fast decoder (lopa_fast.decode.*), imported on first use. All validation happens here, before any
forward: implementations may assume a bound, valid config and a clean prompt.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings

import torch

from lopa_fast import aliases, memory, strategies, threads
from lopa_fast.config import GenerateConfig
from lopa_fast.contracts import first_stop
from lopa_fast.errors import KnobError
from lopa_fast.output import GenerateOutput


def prepare_prompt(model, input_ids) -> torch.Tensor:
    """Validate the prompt and return it as a LongTensor [P] on model.device.

    Accepts a LongTensor [P] or [1, P] (int64 or int32) on the model's device, or a list of ints.
    """
    device = model.device
    if isinstance(input_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise TypeError("input_ids: a list must hold only ints")
        big = next((i for i, t in enumerate(input_ids) if not -(2**63) <= t < 2**63), None)
        if big is not None:  # torch.tensor would overflow without naming the id
            vocab = model.config.vocab_size
            raise KnobError(f"input_ids contains token id {input_ids[big]} (at position {big}); allowed: ids in "
                            f"[0, vocab_size={vocab})", knob="input_ids", value=input_ids[big])  # fmt: skip
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
                    "([P] or [1, P]); for several prompts pass a list of prompts (one output each)"
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
    memory.check_request_memory(model, total, cfg, P)


def _takes_hook(fn) -> bool:
    """Whether a strategy implementation accepts the `on_round=` progress hook."""
    try:
        return "on_round" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def resolve_backend(cfg: GenerateConfig, hook: bool = False, model=None):
    """Return (callable, backend name that runs, fallback note or None) for a validated config.

    "fast" runs the fast decoder or raises (strategy not covered, or a knob it does not cover:
    lopa_fast.strategies.fast_not_covered, e.g. sampler="upstream" at T > 0); "auto" runs it where it covers the
    config, else the reference (with a RuntimeWarning when the strategy has a fast path but the knobs do not
    fit it). hook: an `on_round=` hook is given (a fast
    implementation that does not accept one counts as not covering the request). model: when given, "auto"
    runs a model without the static forward (`forward_static`: a duck-typed stand-in) on the reference.
    """
    fn, ran, fallback = _resolve_backend(cfg)
    if ran == "fast" and cfg.backend == "auto" and model is not None and not hasattr(model, "forward_static"):
        # a duck-typed model without the static forward (test stubs, custom wrappers): not a supported model
        return strategies.get(cfg.strategy).load("reference"), "reference", "reference (the model has no forward_static)"
    if hook and ran == "fast" and not _takes_hook(fn):
        why = "does not take the on_round= progress hook yet"
        if cfg.backend == "fast":
            raise ValueError(f"backend='fast' ({cfg.strategy}) {why}. Use backend='reference' (or 'auto')")
        warnings.warn(f"backend='auto': {cfg.strategy} runs on the reference backend ({why})", RuntimeWarning,
                      stacklevel=4)  # fmt: skip
        return strategies.get(cfg.strategy).load("reference"), "reference", f"reference ({why})"
    return fn, ran, fallback


def _resolve_backend(cfg: GenerateConfig):
    strategy, backend = cfg.strategy, cfg.backend
    spec = strategies.get(strategy)
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
    from lopa_fast.strategies import fast_not_covered

    why = fast_not_covered(cfg)
    if why is None:
        return spec.load("fast"), "fast", None
    if backend == "fast":
        raise ValueError(f"backend='fast' ({strategy}) {why}. Use backend='reference' (or 'auto', which falls back)")
    warnings.warn(f"backend='auto': {strategy} runs on the reference backend ({why})", RuntimeWarning, stacklevel=4)
    return spec.load("reference"), "reference", f"reference ({why})"


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
    Every other knob is keyword-only, with the defaults of `lopa_fast.GenerateConfig` (the one place they
    are written; `inspect.signature(generate)` shows them). D2F/LoPA knobs keep upstream names
    (block_size, block_add_threshold, decoded_token_threshold, skip_threshold, sampling_strategy,
    branching_factor, branch_topp, selection_conf_alpha, use_full_attention). branching_factor=1 is plain
    D2F; k >= 2 verifies k+1 sequences per round.
    max_rounds / on_round_cap: the loop cap (default 2 * max_new_tokens + 64) and what happens when it is
    hit ("warn": stats["hit_round_cap"] = True + RuntimeWarning; "error": RoundCapError).
    suppress_mask_token: exclude the mask id from predictions (upstream does not; default False).
    Strategy-specific knobs (None = the strategy's default): vanilla (LLaDA: steps, block_length, remasking,
    cfg_scale, logits_eos_inf, confidence_eos_eot_inf; Dream: steps, alg, alg_temp, eps) and threshold
    (block_length, steps, exactly one of threshold / factor / entropy_threshold, cache None|"prefix"|"dual",
    count_noop_forward); apd (apd_mixture_weight, kv_window, max_lookahead, tokens_per_step,
    single_temperature, coupled_gumbel, exact_prev_logits).
    verifier:   strategy="apd" only: the causal AR qwen2 model that verifies the drafts (its vocabulary a
                prefix of the drafter's); None with apd_mixture_weight=None runs the leftright baseline.
    stop:       token-id sequences (every strategy): decoding ends once one lies in the finalised prefix (the
                tokens before the first mask); the output is cut before it, finish_reason "stop".
    on_round:   a progress hook `on_round(prefix, info)` called after every round / step with the accepted
                sequence's finalised prefix (list[int]: generated ids before its first mask) and info
                {"round", "forwards", "canvas" (every decoded position, mask id where not yet filled),
                "mask_token_id"} (lopa_fast.contracts.report_round). It costs one host read per round (the
                fast backend otherwise reads only its small round head). An exception raised by the hook
                ends decoding and propagates. lopa_fast.stream is built on it.

    HF / Dream / LLaDA names: max_length (prompt + new tokens), gen_length, do_sample, a list eos_token_id are
    translated where they mean the same; num_beams, repetition_penalty, ... are refused naming lopa_fast's knob
    (lopa_fast.aliases).

    Returns GenerateOutput(generated_ids: list[int] of every generated position, stats, trace).
    """
    tokenizer, streamer = knobs.pop("tokenizer", None), knobs.pop("streamer", None)
    text_stops: list[str] = []
    stop = knobs.get("stop")
    has_text_stop = isinstance(stop, str) or (isinstance(stop, (list, tuple)) and any(isinstance(q, str) for q in stop))
    if tokenizer is None and (_is_text(input_ids) or has_text_stop):
        tokenizer = known_tokenizer(model, "a str prompt" if _is_text(input_ids) else "a text stop")
    if tokenizer is not None:
        from lopa_fast.text import encode_prompt, split_stops

        if isinstance(input_ids, str):
            input_ids = encode_prompt(tokenizer, input_ids)
        elif isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(p, str) for p in input_ids):
            input_ids = [encode_prompt(tokenizer, p) for p in input_ids]
        if has_text_stop:
            seqs, text_stops = split_stops(tokenizer, stop)
            knobs.pop("stop")
            if seqs:
                knobs["stop"] = seqs
    if aliases.applies(knobs):  # HF / Dream / LLaDA / vLLM names (lopa_fast.aliases)
        need = {"max_length", "attention_mask"} & set(knobs)
        knobs = aliases.translate(knobs, _prompt_lens(input_ids) if need else None)
    known = {p for p in _SIGNATURE.parameters}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise TypeError(
            f"generate() got unknown keyword argument(s) {unknown}; strategy-specific knobs are: "
            f"{', '.join(strategies.specific_knobs())}; see inspect.signature(lopa_fast.generate) for all knobs"
        )
    bound = _SIGNATURE.bind(model, input_ids, *args, **knobs)
    kw = dict(bound.arguments)
    model, input_ids = kw.pop("model"), kw.pop("input_ids")
    extra = {k: v for k in ("verifier", "on_round") if (v := kw.pop(k, None)) is not None}
    if streamer is not None:
        extra["streamer"] = streamer
    out = generate_with_config(model, input_ids, GenerateConfig(**kw), **extra)
    if tokenizer is not None:
        from lopa_fast.text import answer_text, text_decoder

        eos = kw.get("eos_token_id")
        eos = eos if eos is not None else model.eos_token_id
        for o in out if isinstance(out, list) else [out]:
            o.text = answer_text(o, text_decoder(tokenizer), eos, text_stops)
    return out


def _is_text(input_ids) -> bool:
    return isinstance(input_ids, str) or (isinstance(input_ids, (list, tuple)) and len(input_ids) > 0
                                          and all(isinstance(p, str) for p in input_ids))


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
                        "tokenizer= (lopa_fast.load_tokenizer(dir)) or token ids")  # fmt: skip
    from lopa_fast.models.loading import load_tokenizer

    tok = load_tokenizer(where)
    try:
        model._lopa_fast_tokenizer = tok
    except AttributeError:
        pass
    return tok


generate.__signature__ = _SIGNATURE


def _prompt_lens(input_ids) -> list[int] | None:
    """The prompt lengths of generate's input_ids (one prompt: one length), for max_length=; None when the input is
    not a prompt (prepare_prompt names what is wrong with it)."""
    prompts = list(input_ids) if is_batch(input_ids) else [input_ids]
    lens = []
    for p in prompts:
        if isinstance(p, torch.Tensor):
            lens.append(int(p.shape[-1]) if p.dim() else 0)
        elif isinstance(p, (list, tuple)):
            lens.append(len(p))
        else:
            return None
    return lens


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
    cfg.validate()  # the one validation of the knobs, before the prompt is touched
    for note in cfg.sampling_notes():  # HF warns about the same
        warnings.warn(note, UserWarning, stacklevel=3)
    spec = strategies.get(cfg.strategy)
    check_verifier_taken(cfg, verifier)
    ids = prepare_prompt(model, input_ids)
    cfg, length = cfg.plan_length(model, ids.numel())  # max_new_tokens -> the whole-block length decoded
    cfg = cfg.resolve(model)
    check_prompt(model, ids, cfg)
    if on_round is not None and not callable(on_round):
        raise TypeError(f"on_round: {type(on_round).__name__}; expected a callable on_round(prefix, info) or None")
    if streamer is not None:
        on_round, finish = _streamer_hook(streamer, ids, cfg, length["requested"], on_round)
    fn, ran, fallback = resolve_backend(cfg, hook=on_round is not None, model=model)
    check_pair(model, verifier, ids, cfg)
    extra = {"verifier": verifier} if spec.takes_verifier else {}
    if on_round is not None:
        extra["on_round"] = on_round
    with torch.inference_mode(), threads.scoped(model):  # small CPU models: one thread for the call (threads.py)
        if engine is not None and ran == "fast" and engine.covers(cfg):
            out = engine.generate(ids, cfg, on_round, verifier)
            out.stats["batched"] = True
        else:
            out = fn(model, ids, cfg, **extra)
    out.stats.setdefault("strategy", cfg.strategy)
    out.stats["backend"] = ran
    if fallback is not None:
        out.stats["fallback"] = fallback
    out = cut_to_length(out, length, cfg)
    if streamer is not None:
        finish(out)
    return out


def check_streamer(streamer) -> None:
    """streamer= is None or has transformers' TextStreamer protocol (put(ids), end()), else a TypeError."""
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise TypeError(f"streamer: {type(streamer).__name__}; expected an object with put(ids) and end() "
                        "(transformers' TextStreamer protocol)")  # fmt: skip


def _streamer_hook(streamer, ids: torch.Tensor, cfg: GenerateConfig, requested: int, on_round=None):
    """(per-round hook, finish(out)) driving a TextStreamer-style `streamer` (generate_with_config's docstring). A
    round puts the finalised prefix's new tokens, up to the requested length, before a stop sequence and holding
    back the last (longest stop - 1) tokens (a stop they start is not complete yet); finish puts the rest of the
    returned ids and calls end()."""
    streamer.put(ids.detach().reshape(1, -1).cpu())
    hold = max((len(q) for q in cfg.stop or ()), default=1) - 1
    sent = 0

    def put(new: list[int]) -> None:
        nonlocal sent
        if new:
            streamer.put(torch.tensor(new, dtype=torch.long))
            sent += len(new)

    def hook(prefix, info):
        if on_round is not None:
            on_round(prefix, info)
        upto = min(len(prefix) - hold, requested)
        if cfg.stop:
            at = first_stop(list(prefix), cfg.stop, cfg.mask_token_id)
            upto = upto if at is None else min(upto, at)
        if upto > sent:
            put(list(prefix[sent:upto]))

    def finish(out: GenerateOutput) -> None:
        put(list(out.generated_ids[sent:]))
        streamer.end()

    return hook, finish


def check_verifier_taken(cfg: GenerateConfig, verifier) -> None:
    """Refuse verifier= for a strategy that takes none (naming those that do)."""
    if verifier is not None and not strategies.get(cfg.strategy).takes_verifier:
        takers = [n for n in strategies.names() if strategies.get(n).takes_verifier]
        raise ValueError(f"verifier= applies to {' / '.join(f'strategy={n!r}' for n in takers)} (the AR model that "
                         f"verifies drafts); strategy={cfg.strategy!r}")  # fmt: skip


def check_verifier_given(cfg: GenerateConfig, given: bool, how: str = "verifier=") -> None:
    """The surfaces that load a verifier from a path (CLI --verifier, serve --verifier, lm-eval's verifier=): a
    KnobError naming the knob when `cfg` needs a verifier and none was given (`how`: how to give one there), or
    naming `verifier` when one was given to a strategy that takes none."""
    spec = strategies.get(cfg.strategy)
    if given and not spec.takes_verifier:
        takers = [n for n in strategies.names() if strategies.get(n).takes_verifier]
        names = " / ".join(f"strategy={n!r}" for n in takers)
        raise KnobError(f"a verifier ({how}) applies to {names} (the AR model that verifies drafts); "
                        f"strategy={cfg.strategy!r}", knob="verifier", value=cfg.strategy)  # fmt: skip
    if not given and spec.uses_verifier(cfg):
        name = spec.verifier_knob
        raise KnobError(f"{name}={getattr(cfg, name)!r} needs a verifier: pass {how} (a causal AR qwen2 model whose "
                        "vocabulary is a prefix of the drafter's, e.g. the embedded lopa_fast/assets/ar-arith for "
                        f"d2f-arith), or leave {name} unset for the verifier-free baseline of "
                        f"strategy={cfg.strategy!r}",
                        knob=name, value=getattr(cfg, name))  # fmt: skip


def check_verifier_fits(model, verifier, tokenizer=None, verifier_tokenizer=None) -> None:
    """A verifier loaded once for many requests (serve --verifier, lm-eval's verifier=): checked against the drafter
    at start (the check every request's pair passes: its strategy's check_models, with both tokenizers when given)."""
    name = next(n for n in strategies.names() if strategies.get(n).takes_verifier)
    spec = strategies.get(name)
    cfg = GenerateConfig(strategy=name, **({spec.verifier_knob: 0.5} if spec.verifier_knob else {})).validate()
    cfg = cfg.resolve(model)
    spec.load("check_models")(model, verifier, cfg, tokenizer=tokenizer, verifier_tokenizer=verifier_tokenizer)


def check_pair(model, verifier, ids: torch.Tensor, cfg: GenerateConfig) -> None:
    """A strategy that takes a verifier: the (model, verifier) pair checked before any forward (its spec's
    check_models), and the prompt + generation within the verifier's positions. ids: the prompt [P]."""
    spec = strategies.get(cfg.strategy)
    if not spec.takes_verifier:
        return
    spec.load("check_models")(model, verifier, cfg)
    if verifier is not None and verifier.config.max_position_embeddings < ids.numel() + cfg.max_new_tokens:
        raise ValueError(
            f"prompt length {ids.numel()} + max_new_tokens {cfg.max_new_tokens} exceeds the verifier's "
            f"max_position_embeddings={verifier.config.max_position_embeddings}"
        )


def is_batch(input_ids) -> bool:
    """A list / tuple of prompts (tensors or lists of ids) is a batch; a list of ints is one prompt."""
    return isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and all(
        isinstance(p, (torch.Tensor, list, tuple)) for p in input_ids
    )


def generate_batch(model, prompts: list, cfg: GenerateConfig, verifier=None, on_round=None) -> list[GenerateOutput]:
    """`generate` for a list of prompts (any lengths): one GenerateOutput per prompt, in order, each equal to
    decoding that prompt alone. A strategy with a batch driver (vanilla, threshold, d2f, lopa, apd) on the fast
    backend runs every live request's windows in ONE forward per round / step (apd: one drafter forward, then one
    verifier forward; lopa_fast.decode.batch; with compile=True one compiled / captured batched step per step key:
    lopa_fast.decode.compiled_batch); the reference backend and distributed=True decode the prompts one after
    another.
    on_round: one hook for all prompts or a list (one
    per prompt). Every prompt is checked before any forward."""
    hooks = list(on_round) if isinstance(on_round, (list, tuple)) else [on_round] * len(prompts)
    if len(hooks) != len(prompts):
        raise ValueError(f"on_round: {len(hooks)} hooks for {len(prompts)} prompts; give one hook or one per prompt")
    cfg.validate()
    check_verifier_taken(cfg, verifier)
    preps = []
    for i, p in enumerate(prompts):
        try:
            ids = prepare_prompt(model, p)
            c, length = cfg.plan_length(model, ids.numel())
            c = c.resolve(model)
            check_prompt(model, ids, c)
            check_pair(model, verifier, ids, c)
        except (ValueError, TypeError) as e:  # say which prompt (the error keeps its type and fields)
            e.args = (f"prompt {i} of {len(prompts)}: {e.args[0] if e.args else e}",) + tuple(e.args[1:])
            raise
        preps.append((ids, c, length))
    from lopa_fast.decode.batch import batchable, run_batch

    batched = batchable(cfg) and all(
        resolve_backend(c, hook=h is not None, model=model)[1] == "fast" for (_, c, _), h in zip(preps, hooks))
    if not batched:
        return [generate_with_config(model, p, cfg, verifier, h) for p, h in zip(prompts, hooks)]
    with torch.inference_mode(), threads.scoped(model):
        outs = run_batch(model, [ids for ids, _, _ in preps], [c for _, c, _ in preps], on_round=hooks,
                         verifier=verifier)  # fmt: skip
    results = []
    for out, (_, c, length) in zip(outs, preps):
        out.stats.setdefault("strategy", c.strategy)
        out.stats["backend"] = "fast"
        out.stats["batched"] = len(prompts)
        results.append(cut_to_length(out, length, c))
    return results


def cut_to_length(out: GenerateOutput, length: dict, cfg: GenerateConfig) -> GenerateOutput:
    """Cut the decoded whole blocks to the requested length and record how the output ended.

    stats: max_new_tokens (the request the output is cut to), decoded_new_tokens (the whole blocks decoded),
    max_new_tokens_source ("argument" | "generation_config.json" | "default"), max_new_tokens_clipped (the reason,
    only when a default was clipped to the position limit), finish_reason ("round_cap": the loop stopped at
    max_rounds, stats["hit_round_cap"]; else "stop": the returned tokens hold an EOS; else "length"; a stop
    sequence (cfg.stop) in the finalised prefix cuts the output before it: finish_reason "stop" first,
    stats["stop_sequence_at"] its position). After a cut
    the token counts (generated_tokens, tokens_until_eos, tpf, tpf_until_eos, tokens_per_second, masks_left)
    describe the returned tokens, and the trace's `accepted` lists drop the positions past the cut (its entries,
    one per round / forward, stay); forwards describe the decoding.
    """
    n = length["requested"]
    st = out.stats
    stop_at = first_stop(out.generated_ids[:n], cfg.stop, cfg.mask_token_id) if cfg.stop else None
    if stop_at is not None:  # a stop sequence in the finalised prefix: the output ends before it
        n = stop_at
        st["stop_sequence_at"] = stop_at
    if len(out.generated_ids) > n:
        ids = out.generated_ids = list(out.generated_ids[:n])
        fw, eos = int(st.get("forwards", 0)), cfg.eos_token_id
        until = ids.index(eos) + 1 if eos is not None and eos in ids else len(ids)
        st["generated_tokens"], st["tokens_until_eos"] = len(ids), until
        st["tpf"] = len(ids) / fw if fw else 0.0
        st["tpf_until_eos"] = until / fw if fw else 0.0
        sec = st.get("seconds", 0.0)
        st["tokens_per_second"] = len(ids) / sec if sec > 0 else 0.0
        st["masks_left"] = sum(1 for t in ids if t == cfg.mask_token_id)
        if out.trace is not None:
            for entry in out.trace:
                if "accepted" in entry:
                    entry["accepted"] = [a for a in entry["accepted"] if int(a[0]) < n]
    st["max_new_tokens"] = n
    st["decoded_new_tokens"] = length["decoded"]
    st["max_new_tokens_source"] = length["source"]
    if "clipped" in length:
        st["max_new_tokens_clipped"] = length["clipped"]
    eos = cfg.eos_token_id
    if stop_at is not None:
        st["finish_reason"] = "stop"
    elif st.get("hit_round_cap"):
        st["finish_reason"] = "round_cap"
    else:
        st["finish_reason"] = "stop" if eos is not None and eos in out.generated_ids else "length"
    return out
