"""The knob names users bring from Hugging Face `generate`, Dream's `diffusion_generate` and LLaDA's `generate`,
translated into lopa_fast's where they mean the same, refused naming lopa_fast's knob where they do not.

    max_length=N         (HF, Dream)  prompt + new tokens: max_new_tokens = N - prompt length (one prompt only)
    gen_length=N         (LLaDA)      max_new_tokens=N
    do_sample=False      (HF)         greedy: temperature 0 (a temperature > 0 beside it is refused)
    do_sample=True       (HF)         sampling: needs temperature > 0 (given, not defaulted: lopa_fast's default
                                      temperature is 0, HF's 1.0)
    eos_token_id=[a, b]  (HF)         EOS a; b, ... end decoding too, as one-token stop sequences (the output is cut
                                      before them, finish_reason "stop")
A name of the same family that lopa_fast has no counterpart for (num_beams, repetition_penalty, ...) is refused by
name (REFUSED says why)."""
from __future__ import annotations

from lopa_fast.errors import KnobError

# names lopa_fast does not take, and what to use instead (each a KnobError naming the knob)
REFUSED = {
    "num_beams": "diffusion decoding has no beam search; LoPA's branches are the parallel candidates "
                 "(branching_factor=)",
    "num_return_sequences": "one output per prompt; pass a list of prompts (or seeds) for several",
    "repetition_penalty": "not implemented",
    "length_penalty": "not implemented (no beam search)",
    "min_length": "not implemented; max_new_tokens= bounds the length",
    "min_new_tokens": "not implemented; max_new_tokens= bounds the length",
    "output_scores": "not implemented; return_trace=True records each round's branch scores",
    "return_dict_in_generate": "generate returns a GenerateOutput (generated_ids, stats, trace)",
    "stopping_criteria": "pass stop= token-id sequences (or text stops to lopa_fast.stream)",
    "gen_kwargs": "pass the knobs as keyword arguments",
    "generation_config": "pass the knobs as keyword arguments (a model's generation_config.json supplies "
                         "max_new_tokens and the special ids)",
}
ALIASES = ("max_length", "gen_length", "do_sample")


def translate(knobs: dict, prompt_lens: list[int] | None) -> dict:
    """`knobs` with the aliases above replaced by lopa_fast's knobs (a new dict). prompt_lens: the prompt lengths
    (max_length needs exactly one). Raises KnobError naming the alias when it conflicts or cannot apply."""
    out = dict(knobs)
    for name, why in REFUSED.items():
        if name in out:
            raise KnobError(f"{name}={out[name]!r} is not a lopa_fast knob: {why}", knob=name, value=out[name])
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
                            "max_new_tokens=", knob="max_length", value=n)  # fmt: skip
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
                                knob="do_sample", value=False)  # fmt: skip
            out["temperature"] = 0.0
        elif t is None or t == 0:
            raise KnobError("do_sample=True needs temperature > 0 (lopa_fast's default temperature is 0, greedy; "
                            "HF's is 1.0): pass temperature=", knob="do_sample", value=True)  # fmt: skip
    eos = out.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        if not eos or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise KnobError(f"eos_token_id={eos!r}; expected an int id or a non-empty list of int ids",
                            knob="eos_token_id", value=eos)  # fmt: skip
        out["eos_token_id"] = eos[0]
        extra = [[t] for t in dict.fromkeys(eos[1:]) if t != eos[0]]
        if extra:
            out["stop"] = [*(list(out.get("stop") or [])), *extra]
    return out


def _one_of(knobs: dict, alias: str, knob: str) -> None:
    if knobs.get(knob) is not None:
        raise KnobError(f"{alias}={knobs[alias]!r} and {knob}={knobs[knob]!r} both given; pass one",
                        knob=alias, value=knobs[alias])  # fmt: skip
