"""lm-evaluation-harness model `lopa_fast` (optional: `pip install .[eval]`; lm-eval has no plugin discovery).

    python -m lopa_fast lm-eval --model lopa_fast \\
        --model_args pretrained=DIR,lora=DIR,strategy=lopa,branching_factor=4,block_size=32 \\
        --tasks gsm8k --apply_chat_template --output_path results/

`python -m lopa_fast lm-eval ARGS` imports this module (which registers the model) and hands ARGS to lm-eval's
own command line (`main`). Without `pretrained=` the embedded d2f-arith model runs .

- `generate_until` runs each request through `lopa_fast.generate` (batch 1; lm-eval's batch_size is accepted and
  ignored): the context tokenised (as is, or without added specials when lm-eval applied the chat template,
  which already holds them), `until` as text stops (lopa_fast.text.split_stops: tokenised into generate's `stop=`,
  the one stop mechanism, and matched on the text), `max_gen_toks` as max_new_tokens, `do_sample` / `temperature`
  / `top_p` / `top_k` as the sampling knobs; every other model_arg is a generate knob (GenerateConfig's names).
- loglikelihood / loglikelihood_rolling raise NotImplementedError (a diffusion decoder generates; as the other
  dLLM engines, only generate_until tasks run).
- Per request the tokens, forwards, TPF and finish reason are recorded (`LopaFastLM.records`); `main` prints the
  totals and writes them, with every request, to `lopa_fast_stats_<date>.json` next to lm-eval's results file
  (when --output_path is given).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

SAMPLING_KWARGS = ("do_sample", "temperature", "top_p", "top_k")  # the gen_kwargs mapped to knobs
MODEL_ARGS = ("pretrained", "lora", "dtype", "device", "max_gen_toks")  # the others are knobs


@register_model("lopa_fast")
class LopaFastLM(LM):
    """lm-eval model over `lopa_fast.generate` (module docstring). model_args: pretrained (model directory;
    default the embedded model), lora (PEFT adapter directory), dtype (float32 | bfloat16 | float16; default
    bfloat16 on CUDA, float32 on CPU), device (default cuda when available; cuda without CUDA: the CPU, with a warning), max_gen_toks (default 256, when a task
    gives none) and any GenerateConfig knob."""

    last: "LopaFastLM | None" = None  # the instance lm-eval created last (read by `main` after the run)

    def __init__(self, pretrained=None, lora=None, dtype=None, device=None, max_gen_toks: int = 256,
                 batch_size=None, max_batch_size=None, **knobs):  # fmt: skip
        super().__init__()
        import torch

        import lopa_fast
        from lopa_fast.assets import model_dir
        from lopa_fast.config import GenerateConfig
        from lopa_fast.text import text_decoder

        fields = {f.name for f in dataclasses.fields(GenerateConfig)}
        unknown = sorted(set(knobs) - fields)
        if unknown:
            raise TypeError(f"lopa_fast model_args: unknown {unknown}; allowed: {', '.join(MODEL_ARGS)} and the "
                            "GenerateConfig knobs (inspect.signature(lopa_fast.generate))")  # fmt: skip
        self.knobs = dict(knobs)
        GenerateConfig(**self.knobs).validate()  # bad knobs fail here, before the model loads
        path = model_dir() if pretrained is None else str(pretrained)
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if str(dev).startswith("cuda") and not torch.cuda.is_available():  # lm-eval's --device defaults to cuda
            warnings.warn(f"lopa_fast: device={dev!r} but CUDA is not available; running on the CPU", RuntimeWarning,
                          stacklevel=2)  # fmt: skip
            dev = "cpu"
        dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if str(dev).startswith("cuda") else torch.float32)
        self.model = lopa_fast.load_model(path, dtype=dt, device=dev, lora=lora)
        self.tok = lopa_fast.load_tokenizer(path)
        self.path = str(path)
        self._device = torch.device(dev)
        self.max_gen_toks = int(max_gen_toks)
        self.decode = text_decoder(self.tok)
        self.chat_applied = False
        self.records: list[dict] = []
        LopaFastLM.last = self

    # ---- chat template (lm-eval's --apply_chat_template) -------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return str(self.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tok, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tok, "chat_template", None):
            from lopa_fast.errors import KnobError

            raise KnobError(f"--apply_chat_template: the tokenizer of {self.path} has no chat template",
                            knob="apply_chat_template", value=True)  # fmt: skip
        self.chat_applied = True  # the templated text holds the special tokens: encode it without adding more
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    # ---- requests ------------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("lopa_fast: loglikelihood requests are not supported (diffusion decoders generate; "
                                  "run generate_until tasks, e.g. gsm8k)")  # fmt: skip

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("lopa_fast: loglikelihood_rolling requests are not supported (diffusion decoders "
                                  "generate; run generate_until tasks, e.g. gsm8k)")  # fmt: skip

    def request_knobs(self, gen_kwargs: dict) -> tuple[dict, list]:
        """(generate knobs, `until` stops) for one request's gen_kwargs."""
        g = dict(gen_kwargs or {})
        until = g.pop("until", None)
        knobs = dict(self.knobs, max_new_tokens=int(g.pop("max_gen_toks", self.max_gen_toks)))
        do_sample = g.pop("do_sample", None)
        temperature = g.pop("temperature", None)
        if do_sample is False or (temperature is not None and float(temperature) == 0.0):
            knobs["temperature"] = 0.0
        elif temperature is not None:
            knobs["temperature"] = float(temperature)
        for k in ("top_p", "top_k"):
            if g.get(k) is not None:
                knobs[k] = g.pop(k)
        if g:
            warnings.warn(f"lopa_fast: gen_kwargs {sorted(g)} ignored (mapped: until, max_gen_toks, "
                          f"{', '.join(SAMPLING_KWARGS)})", RuntimeWarning, stacklevel=2)  # fmt: skip
        if isinstance(until, str):
            until = [until]
        return knobs, [u for u in (until or []) if u]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        import lopa_fast
        from lopa_fast.text import answer_text, check_text_prompt, split_stops, unknown_words

        out_texts = []
        for req in tqdm(requests, disable=disable_tqdm, desc="lopa_fast generate_until"):
            context, gen_kwargs = req.args[0], req.args[1]
            check_text_prompt(context, "context")
            missing = unknown_words(self.tok, context)
            if missing:  # reported, never silently mapped
                warnings.warn(f"lopa_fast: {len(missing)} word(s) of the context unknown to the tokenizer: "
                              + ", ".join(repr(w) for w in missing[:20]), UserWarning, stacklevel=2)  # fmt: skip
            knobs, until = self.request_knobs(gen_kwargs)
            seqs, text_stops = split_stops(self.tok, until or None)
            if seqs:
                knobs["stop"] = seqs
            ids = list(self.tok(context, add_special_tokens=not self.chat_applied)["input_ids"])
            out = lopa_fast.generate(self.model, ids, **knobs)
            eos = knobs.get("eos_token_id", self.model.eos_token_id)
            text = answer_text(out, self.decode, eos, text_stops)
            st = out.stats
            self.records.append({
                "task": getattr(req, "task_name", None), "doc_id": getattr(req, "doc_id", None),
                "prompt_tokens": len(ids), "generated_tokens": st["generated_tokens"], "forwards": st["forwards"],
                "tpf": st["tpf"], "finish_reason": st["finish_reason"], "strategy": st["strategy"],
                "backend": st["backend"],
            })  # fmt: skip
            out_texts.append(text)
            if hasattr(self, "cache_hook"):
                self.cache_hook.add_partial("generate_until", req.args, text)
        return out_texts

    def totals(self) -> dict:
        """Tokens, forwards and TPF over every request so far (TPF = all generated tokens / all forwards)."""
        tokens = sum(r["generated_tokens"] for r in self.records)
        forwards = sum(r["forwards"] for r in self.records)
        return {"requests": len(self.records), "generated_tokens": tokens, "forwards": forwards,
                "tpf": tokens / forwards if forwards else 0.0}  # fmt: skip


def _results_file(output_path: str | None, since: float) -> Path | None:
    """The results JSON lm-eval wrote in this run under --output_path (a directory or a .json path)."""
    if not output_path:
        return None
    p = Path(output_path)
    found = p.parent.glob(f"{p.stem}_*.json") if p.suffix == ".json" else p.rglob("results_*.json")
    fresh = [f for f in found if f.stat().st_mtime >= since]
    return max(fresh, key=lambda f: f.stat().st_mtime) if fresh else None


def main(argv: list[str]) -> int:
    """`python -m lopa_fast lm-eval ARGS`: lm-eval's command line with the `lopa_fast` model registered, then the
    TPF / forwards totals printed and written (with every request) next to lm-eval's results file."""
    from lm_eval.__main__ import cli_evaluate

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--output_path", "-o", default=None)
    known, _ = pre.parse_known_args(argv)
    LopaFastLM.last = None
    since = time.time() - 1.0
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    lm = LopaFastLM.last
    if lm is None:  # another --model, or lm-eval stopped before creating it (e.g. --help, `ls`)
        return 0
    summary = {"model_args": {"path": lm.path, **lm.knobs}, "total": lm.totals(), "requests": lm.records}
    t = summary["total"]
    print(f"lopa_fast: {t['requests']} requests, {t['generated_tokens']} tokens, {t['forwards']} forwards, "
          f"TPF {t['tpf']:.2f}")  # fmt: skip
    results = _results_file(known.output_path, since)
    if results is not None:
        date = results.stem.rsplit("_", 1)[-1] if "_" in results.stem else "run"
        path = results.with_name(f"lopa_fast_stats_{date}.json")
        path.write_text(json.dumps(summary, indent=2))
        print(f"lopa_fast: wrote {path}")
    return 0
