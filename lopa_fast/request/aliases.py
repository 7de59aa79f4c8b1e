"""The knob names users bring from Hugging Face `generate`, Dream's `diffusion_generate` and LLaDA's `generate`,
translated into lopa_fast's where they mean the same, refused naming lopa_fast's knob where they do not.

    max_length=N         (HF, Dream)  prompt + new tokens: max_new_tokens = N - prompt length (one prompt only)
    gen_length=N         (LLaDA)      max_new_tokens=N
    do_sample=False      (HF)         greedy: temperature 0 (a temperature > 0 beside it is refused)
    do_sample=True       (HF)         sampling: needs temperature > 0 (given, not defaulted: lopa_fast's default
                                      temperature is 0, HF's 1.0)
    eos_token_id=[a, b]  (HF)         EOS a; b, ... end decoding too, as one-token stop sequences (the output is cut
                                      before them, finish_reason "stop")
    attention_mask=M     (HF)         accepted when all ones (an unpadded prompt); a 0 anywhere is refused naming it
    pad_token_id=N       (HF)         accepted, no effect: outputs are never padded (one GenerateOutput per prompt)
    use_cache=B          (HF)         accepted, no effect: each strategy keeps the KV cache it defines (threshold:
                                      cache=)
    n=1                  (vLLM)       accepted (one output per prompt); n > 1 refused
    top_k=0 / top_k=-1   (HF / vLLM)  "off", as there (GenerateConfig stores top_k=None)
    streamer=S           (HF)         a TextStreamer-style object (put(ids), end()): generate / stream call put(prompt
                                      ids), then put(new ids) as they become final, then end()
A name of the same family that lopa_fast has no counterpart for (num_beams, repetition_penalty, typical_p, ...) is
refused by name (REFUSED says why). docs/decoding.md "Knobs from other libraries" has the table."""
from __future__ import annotations

from lopa_fast.errors import KnobError

# names lopa_fast does not take, and what to use instead (each a KnobError naming the knob)
REFUSED = {
    "num_beams": "diffusion decoding has no beam search; LoPA's branches are the parallel candidates "
                 "(branching_factor=)",
    # generate takes it (n samples at T > 0, lopa_fast.api); the other surfaces refuse it here
    "num_return_sequences": "one output per call here; generate(..., num_return_sequences=n, temperature > 0) "
                            "returns n samples (the server: n=), or pass a list of prompts (or seeds)",
    "repetition_penalty": "not implemented",
    "length_penalty": "not implemented (no beam search)",
    "min_length": "not implemented; max_new_tokens= bounds the length",
    "min_new_tokens": "not implemented (a diffusion round may fill EOS anywhere in the canvas; HF suppresses it only "
                      "left to right); max_new_tokens= bounds the length, stop= ends it early",
    "output_scores": "not implemented; return_trace=True records each round's branch scores",
    "return_dict_in_generate": "generate returns a GenerateOutput (generated_ids, stats, trace)",
    "stopping_criteria": "pass stop= (token-id sequences, or text with tokenizer=)",
    "typical_p": "not implemented; nucleus sampling is top_p= (with temperature > 0)",
    "min_p": "not implemented; nucleus sampling is top_p=, top-k is top_k= (with temperature > 0)",
    "epsilon_cutoff": "not implemented; nucleus sampling is top_p= (with temperature > 0)",
    "eta_cutoff": "not implemented; nucleus sampling is top_p= (with temperature > 0)",
    "no_repeat_ngram_size": "not implemented (a diffusion round fills positions out of order)",
    "bad_words_ids": "not implemented; suppress_mask_token=True is the one suppressed id",
    "logprobs": "not implemented; return_trace=True records each round's fill order and branch scores",
    "top_logprobs": "not implemented; return_trace=True records each round's fill order and branch scores",
    "best_of": "one output per prompt; LoPA's branches are the parallel candidates (branching_factor=)",
    "logit_bias": "not implemented",
    "presence_penalty": "not implemented",
    "frequency_penalty": "not implemented",
    "guidance_scale": "LLaDA vanilla's classifier-free guidance is cfg_scale= (its scale s: logits = u + (s + 1) * "
                      "(c - u), so HF's guidance_scale g is cfg_scale = g - 1)",
    "gen_kwargs": "pass the knobs as keyword arguments",
    "generation_config": "pass the knobs as keyword arguments (a model's generation_config.json supplies "
                         "max_new_tokens and the special ids)",
}
ALIASES = ("max_length", "gen_length", "do_sample", "stop_strings")
# names accepted where they mean the same (checked, then dropped: no lopa_fast knob holds them)
ACCEPTED = ("attention_mask", "pad_token_id", "use_cache", "n")
# every name `translate` handles (generate calls it when one is given, or a list eos_token_id, or top_k 0 / -1)
NAMES = frozenset(ALIASES) | frozenset(REFUSED) | frozenset(ACCEPTED)


# names that are no knob here, with the lopa_fast name they mean (the unknown-keyword error suggests it)
SUGGEST = {
    "max_tokens": "max_new_tokens",  # OpenAI / vLLM (the server's body takes max_tokens itself)
    "max_gen_toks": "max_new_tokens",  # lm-eval's gen_kwargs
    "stop_sequences": "stop",
    "stop_token_ids": "stop (token-id sequences: stop=[[id], ...])",
    "temp": "temperature",
    "block_len": "block_size",
    "num_steps": "steps",
    "diffusion_steps": "steps",
    "k": "branching_factor",
}


def unknown_knobs_error(fn: str, unknown: list[str], known) -> TypeError:
    """The TypeError of `fn` given keyword arguments it does not take, each with the lopa_fast name it probably means
    (SUGGEST, else the closest knob name by difflib), e.g. "max_tokens (did you mean max_new_tokens?)"."""
    import difflib

    known = sorted(known)
    named = []
    for name in unknown:
        guess = SUGGEST.get(name) or next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.75)), None)
        named.append(f"{name} (did you mean {guess}?)" if guess else name)
    return TypeError(f"{fn}() got unknown keyword argument(s): {', '.join(named)}; inspect.signature("
                     "lopa_fast.generate) lists every knob (docs/decoding.md)")


def applies(knobs: dict) -> bool:
    """Whether `translate` has work on `knobs` (a name of another library, or a list eos_token_id)."""
    return bool(NAMES & set(knobs)) or isinstance(knobs.get("eos_token_id"), (list, tuple))


def check_attention_mask(mask, prompt_lens: list[int] | None) -> None:
    """attention_mask= is accepted when it is all ones (and, with the prompt lengths known, as long as the prompt):
    lopa_fast decodes unpadded prompts. A 0 (padding) or a shape that is not the prompt's is refused naming it."""
    import torch

    try:
        t = torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError):
        raise KnobError(f"attention_mask: {type(mask).__name__}; expected a tensor or list of 0 / 1 (all ones)",
                        knob="attention_mask", value=type(mask).__name__) from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise KnobError(f"attention_mask has shape {tuple(t.shape)}; allowed: [P] or [1, P] of ones (for several "
                        "prompts pass a list of prompts, unpadded)", knob="attention_mask", value=tuple(t.shape))
    if prompt_lens is not None and len(prompt_lens) == 1 and t.numel() != prompt_lens[0]:
        raise KnobError(f"attention_mask has {t.numel()} entries for a prompt of {prompt_lens[0]} tokens",
                        knob="attention_mask", value=t.numel())
    zeros = (t != 1).nonzero().flatten().tolist()
    if zeros:
        raise KnobError(f"attention_mask has {len(zeros)} zero(s) (padding; first at position {zeros[0]}): lopa_fast "
                        "decodes unpadded prompts; pass the prompt without its padding (a list of prompts of any "
                        "lengths for several)", knob="attention_mask", value=zeros[0])


def unpad(input_ids, mask) -> list:
    """A padded batch `input_ids [B, P]` (tensor or list of lists) with its HF `attention_mask [B, P]` (1: a token,
    0: padding; left padding as transformers' decoder tokenizers give it, right padding too) -> the list of the B
    unpadded prompts (1-D LongTensors), which generate decodes as a list of prompts (one output per row, each equal to
    decoding the row alone). KnobError naming attention_mask when the shapes differ, a value is not 0 / 1, a row's
    ones are not contiguous (padding inside the prompt) or a row is all padding."""
    import torch

    try:
        ids, m = torch.as_tensor(input_ids), torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError):
        raise KnobError(f"attention_mask: {type(mask).__name__}; expected a tensor or list of 0 / 1 shaped like "
                        "input_ids", knob="attention_mask", value=type(mask).__name__) from None
    if ids.dim() == 1:
        ids = ids[None]
    if m.dim() == 1:
        m = m[None]
    if m.shape != ids.shape:
        raise KnobError(f"attention_mask has shape {tuple(m.shape)}, input_ids {tuple(ids.shape)}; allowed: the same "
                        "[B, P] shape", knob="attention_mask", value=tuple(m.shape))
    if not bool(((m == 0) | (m == 1)).all()):
        raise KnobError("attention_mask holds values other than 0 and 1", knob="attention_mask", value="not 0/1")
    prompts = []
    for b in range(ids.shape[0]):
        on = m[b].nonzero().flatten()
        if on.numel() == 0:
            raise KnobError(f"attention_mask row {b} is all zeros (an empty prompt)", knob="attention_mask", value=b)
        first, last = int(on[0]), int(on[-1])
        if last - first + 1 != on.numel():
            raise KnobError(f"attention_mask row {b} has padding inside the prompt (zeros between positions {first} "
                            f"and {last}); allowed: left or right padding only", knob="attention_mask", value=b)
        prompts.append(ids[b, first:last + 1].to(torch.long))
    return prompts


def translate(knobs: dict, prompt_lens: list[int] | None) -> dict:
    """`knobs` with the aliases above replaced by lopa_fast's knobs (a new dict). prompt_lens: the prompt lengths
    (max_length needs exactly one). Raises KnobError naming the alias when it conflicts or cannot apply."""
    out = dict(knobs)
    for name, why in REFUSED.items():
        if name in out:
            raise KnobError(f"{name}={out[name]!r} is not a lopa_fast knob: {why}", knob=name, value=out[name])
    if "n" in out:
        n = out.pop("n")
        if n != 1 or isinstance(n, bool):
            raise KnobError(f"n={n!r}: one output per prompt (n=1); pass a list of prompts (or seeds) for several",
                            knob="n", value=n)
    if "attention_mask" in out:
        check_attention_mask(out.pop("attention_mask"), prompt_lens)
    if "pad_token_id" in out:
        pad = out.pop("pad_token_id")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
            raise KnobError(f"pad_token_id={pad!r}; expected an int id >= 0 (accepted, unused: outputs are not "
                            "padded)", knob="pad_token_id", value=pad)
    if "use_cache" in out:
        use = out.pop("use_cache")
        if not isinstance(use, bool):
            raise KnobError(f"use_cache={use!r}; expected True or False (accepted, no effect: each strategy keeps "
                            "the KV cache it defines; threshold: cache=)", knob="use_cache", value=use)
    if "gen_length" in out:
        _one_of(out, "gen_length", "max_new_tokens")
        out["max_new_tokens"] = out.pop("gen_length")
    if "max_length" in out:
        _one_of(out, "max_length", "max_new_tokens")
        n = out.pop("max_length")
        if isinstance(n, bool) or not isinstance(n, int):
            raise KnobError(f"max_length={n!r}; expected an int (prompt + new tokens)", knob="max_length", value=n)
        if prompt_lens is None or len(prompt_lens) != 1:
            raise KnobError("max_length= (prompt + new tokens) needs one prompt; for a list of prompts pass "
                            "max_new_tokens=", knob="max_length", value=n)
        if n <= prompt_lens[0]:
            raise KnobError(f"max_length={n} leaves no new token after the prompt's {prompt_lens[0]}; pass "
                            f"max_length > {prompt_lens[0]} or max_new_tokens=", knob="max_length", value=n)
        out["max_new_tokens"] = n - prompt_lens[0]
    if "do_sample" in out:
        sample = out.pop("do_sample")
        if not isinstance(sample, bool):
            raise KnobError(f"do_sample={sample!r}; expected True or False", knob="do_sample", value=sample)
        t = out.get("temperature")
        if not sample:
            if t not in (None, 0, 0.0):
                raise KnobError(f"do_sample=False with temperature={t!r}: greedy decoding is temperature=0; drop one",
                                knob="do_sample", value=False)
            out["temperature"] = 0.0
        elif t is None or t == 0:
            raise KnobError("do_sample=True needs temperature > 0 (lopa_fast's default temperature is 0, greedy; "
                            "HF's is 1.0): pass temperature=", knob="do_sample", value=True)
    eos = out.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        if not eos or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise KnobError(f"eos_token_id={eos!r}; expected an int id or a non-empty list of int ids",
                            knob="eos_token_id", value=eos)
        out["eos_token_id"] = eos[0]
        extra = [[t] for t in dict.fromkeys(eos[1:]) if t != eos[0]]
        if extra:
            out["stop"] = [*(list(out.get("stop") or [])), *extra]
    return out


def _one_of(knobs: dict, alias: str, knob: str) -> None:
    if knobs.get(knob) is not None:
        raise KnobError(f"{alias}={knobs[alias]!r} and {knob}={knobs[knob]!r} both given; pass one",
                        knob=alias, value=knobs[alias])
