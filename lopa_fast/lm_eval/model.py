"""`LopaFastLM`: the lm-eval model `lopa_fast` (generate_until over `lopa_fast.generate`, loglikelihood by the
masked-diffusion ELBO of lopa_fast.lm_eval.elbo) and its model-arg checks (every bad value names itself and what
is allowed)."""
from __future__ import annotations

import dataclasses
import warnings

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lopa_fast.request import threads
from lopa_fast.lm_eval.elbo import MC_BATCH, MC_NUM, greedy_matches, mc_loglikelihood, request_seed

SAMPLING_KWARGS = ("do_sample", "temperature", "top_p", "top_k")  # the gen_kwargs mapped to knobs
MODEL_ARGS = ("pretrained", "lora", "verifier", "dtype", "device", "max_gen_toks", "mc_num", "mc_batch_size", "seed",
              "check_greedy")  # # the others are generate knobs
DTYPES = ("float32", "bfloat16", "float16")
SEED = 1234  # the seed LLaDA's eval script sets


# ---- model-arg checks: every bad value names itself and what is allowed ------------------------------------------
def _arg_error(name: str, value, allowed: str):
    from lopa_fast.errors import KnobError

    return KnobError(f"lopa_fast model_args: {name}={value!r}; allowed: {allowed}", knob=name, value=value)


def _int_arg(name: str, value, low: int, allowed: str) -> int:
    """`value` as an int >= low (an int, or a string of one: model_args may come as text), else KnobError."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _arg_error(name, value, allowed)
    try:
        v = int(value)
    except ValueError:
        raise _arg_error(name, value, allowed) from None
    if v < low:
        raise _arg_error(name, value, allowed)
    return v


def _bool_arg(name: str, value) -> bool:
    """`value` as a bool (True / False, or "true" / "false" in any case), else KnobError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _arg_error(name, value, "true or false")


def _device_arg(device) -> str:
    """The device to load on: `device` (default cuda when available); cuda without CUDA: the CPU, with a warning
    (lm-eval's --device defaults to cuda:0). A string torch cannot parse: KnobError."""
    dev = str(device) if device else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.device(dev)
    except (RuntimeError, ValueError):
        raise _arg_error("device", device, "cpu, cuda, cuda:N, mps (a torch device string)") from None
    if dev.startswith("cuda") and not torch.cuda.is_available():
        warnings.warn(f"lopa_fast: device={dev!r} but CUDA is not available; running on the CPU", RuntimeWarning,
                      stacklevel=3)
        dev = "cpu"
    return dev


def _mc_args(mc_num, mc_batch_size) -> tuple[int, int]:
    """(mc_num, mc_batch_size): mc_num >= 1; the batch (default min(32, mc_num)) must divide mc_num, since every
    forward holds one stratified batch of mask draws (`draw_masks`)."""
    n = _int_arg("mc_num", mc_num, 1, f"an int >= 1 (default {MC_NUM})")
    if mc_batch_size is None:
        b = min(MC_BATCH, n)
    else:
        b = _int_arg("mc_batch_size", mc_batch_size, 1, f"an int >= 1 that divides mc_num (default min({MC_BATCH}, "
                     "mc_num))")
    if n % b:
        divisors = [d for d in range(1, min(n, 256) + 1) if n % d == 0]
        raise _arg_error("mc_num", n, f"a multiple of mc_batch_size={b} (or an mc_batch_size that divides {n}: "
                         f"{', '.join(map(str, divisors))})")
    return n, b


@register_model("lopa_fast")
class LopaFastLM(TemplateLM):
    """lm-eval model over `lopa_fast.generate` and the masked-diffusion ELBO (module docstring). model_args:
    pretrained (model directory; default the embedded model), lora (PEFT adapter directory), dtype (float32 |
    bfloat16 | float16; default bfloat16 on CUDA, float32 on CPU), device (default cuda when available; cuda without
    CUDA: the CPU, with a warning), max_gen_toks (default 256, when a task gives none), for loglikelihood mc_num
    (Monte Carlo samples per request, default 128), mc_batch_size (samples per forward, default min(32, mc_num);
    must divide mc_num), seed (default 1234; each request's draws are seeded from it and the request's ids),
    check_greedy (default true: LLaDA's greedy check for is_greedy, up to L extra forwards per request; false: is_greedy
    is always False, as Dream's eval returns), verifier (APD's causal AR verifier directory, loaded like the model and
    checked against it; needed by apd_mixture_weight), and any GenerateConfig knob.

    Built by name (`lm_eval.simple_evaluate(model="lopa_fast", model_args=...)`) the generate_until totals land in the
    result dict too: results["config"]["lopa_fast"] (lm-eval's get_model_info hook) and results["lopa_fast"]."""

    last: "LopaFastLM | None" = None  # the instance created last

    def __init__(self, pretrained=None, lora=None, dtype=None, device=None, max_gen_toks=256, mc_num=MC_NUM,
                 mc_batch_size=None, seed=SEED, check_greedy=True, batch_size=None, max_batch_size=None,
                 verifier=None, **knobs):
        super().__init__()
        import lopa_fast
        from lopa_fast.assets import model_dir
        from lopa_fast.config import GenerateConfig
        from lopa_fast.request.text import text_decoder

        fields = {f.name for f in dataclasses.fields(GenerateConfig)}
        unknown = sorted(set(knobs) - fields)
        if unknown:
            import difflib

            named = [f"{u} (did you mean {g[0]}?)" if (g := difflib.get_close_matches(u, [*MODEL_ARGS, *fields], 1,
                                                                                      0.75)) else u for u in unknown]
            raise TypeError(f"lopa_fast model_args: unknown {', '.join(named)}; allowed: {', '.join(MODEL_ARGS)} and "
                            "the GenerateConfig knobs (inspect.signature(lopa_fast.generate))")
        from lopa_fast import api

        self.knobs = dict(knobs)
        cfg = GenerateConfig(**self.knobs).validate()  # bad knobs fail here, before the model loads
        api.check_verifier_given(cfg, verifier is not None, "model_args verifier=DIR")
        if dtype is not None and dtype not in DTYPES:
            raise _arg_error("dtype", dtype, f"{', '.join(DTYPES)} (default bfloat16 on CUDA, float32 on CPU)")
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1, "an int >= 1 (default 256)")
        self.mc_num, self.mc_batch_size = _mc_args(mc_num, mc_batch_size)
        self.seed = _int_arg("seed", seed, 0, f"an int >= 0 (default {SEED})")
        self.check_greedy = _bool_arg("check_greedy", check_greedy)
        dev = _device_arg(device)
        path = model_dir() if pretrained is None else str(pretrained)
        self.model = lopa_fast.load_model(path, dtype=dtype, device=dev, lora=lora)  # None: default_dtype
        self.tok = lopa_fast.load_tokenizer(path)
        self.verifier = None
        if verifier is not None:  # loaded like the model, checked against it once
            self.verifier = lopa_fast.load_model(str(verifier), dtype=dtype, device=dev)
            api.check_verifier_fits(self.model, self.verifier, self.tok, lopa_fast.load_tokenizer(str(verifier)))
        self.verifier_path = None if verifier is None else str(verifier)
        self.path = str(path)
        self._device = torch.device(dev)
        self.decode = text_decoder(self.tok)
        self.chat_applied = False
        self.records: list[dict] = []
        LopaFastLM.last = self

    # ---- tokens (TemplateLM) ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.model.eos_token_id
        return int(eos if eos is not None else self.tok.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced by (TemplateLM.loglikelihood): bos when there is one, else eos."""
        bos = getattr(self.tok, "bos_token_id", None)
        bos = self.model.bos_token_id if bos is None else bos
        return self.eot_token_id if bos is None else int(bos)

    @property
    def max_length(self) -> int:
        """Context + continuation must fit the model's positions."""
        return int(self.model.config.max_position_embeddings)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`; add_special_tokens None: the tokenizer's own (e.g. bos), unless lm-eval applied the
        chat template, whose text already holds them (the rule generate_until encodes contexts by)."""
        if add_special_tokens is None:
            add_special_tokens = not self.chat_applied
        return list(self.tok(string, add_special_tokens=add_special_tokens)["input_ids"])

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
                            knob="apply_chat_template", value=True)
        self.chat_applied = True  # the templated text holds the special tokens: encode it without adding more
        if add_generation_prompt:  # a context ending with the template's own "Answer :" gets it once
            from lopa_fast.request.text import without_generation_prompt

            chat_history = without_generation_prompt(self.tok, chat_history)
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    # ---- loglikelihood requests ----------------------------------------------------------------------------
    def _require_diffusion(self, what: str) -> None:
        mc = self.model.config
        if not mc.is_diffusion or self.model.mask_token_id is None:  # the family's property, not its attention
            raise NotImplementedError(
                f"lopa_fast: {what} needs a masked-diffusion model (a mask token to fill); {self.path} is "
                f"model_type={mc.model_type!r} (is_diffusion={mc.is_diffusion}, attention={self.model.attention!r}), "
                f"mask_token_id={self.model.mask_token_id!r}. Supported on it: generate_until")

    def _fit(self, context: list[int], continuation: list[int]) -> list[int]:
        """The context cut on the left so context + continuation fit `max_length` (with a warning); at least one
        context token is kept (Dream-family models predict the first continuation token from it)."""
        room = self.max_length - len(continuation)
        if room < 1:
            from lopa_fast.errors import KnobError

            raise KnobError(f"lopa_fast loglikelihood: a continuation of {len(continuation)} tokens does not fit "
                            f"max_position_embeddings={self.max_length} with at least one context token",
                            knob="continuation", value=len(continuation))
        context = list(context) or [self.prefix_token_id]
        if len(context) > room:
            warnings.warn(f"lopa_fast loglikelihood: context of {len(context)} tokens + continuation of "
                          f"{len(continuation)} exceed {self.max_length}; the context is cut on the left",
                          RuntimeWarning, stacklevel=3)
            context = context[-room:]
        return context

    def _score(self, context: list[int], continuation: list[int], greedy: bool) -> tuple[float, bool]:
        """(ELBO estimate, is_greedy) of one tokenised request, its draws seeded by `request_seed`."""
        context = self._fit(context, continuation)
        gen = torch.Generator().manual_seed(request_seed(self.seed, context, continuation))
        with threads.scoped(self.model):  # the thread policy of generate (lopa_fast.request.threads)
            ll = mc_loglikelihood(self.model, context, continuation, mc_num=self.mc_num,
                                  batch_size=self.mc_batch_size, generator=gen)
            is_greedy = greedy and self.check_greedy and greedy_matches(self.model, context, continuation)
        return ll, bool(is_greedy)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood estimate, is_greedy) per (context, continuation) request; lm-eval's TemplateLM
        tokenises (trailing context spaces moved to the continuation; an empty context becomes `prefix_token_id`)."""
        if requests:
            self._require_diffusion("loglikelihood")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        out = []
        unknown: dict[str, None] = {}
        for pair, context, continuation in tqdm(requests, disable=disable_tqdm, desc="lopa_fast loglikelihood"):
            for text in pair:
                unknown.update(dict.fromkeys(self._unknown(text)))
            res = self._score(context, continuation, greedy=True)
            out.append(res)
            self.cache_hook.add_partial("loglikelihood", pair, res)
        self._warn_unknown(list(unknown), "request")
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood per request: the sum of the ELBO estimates of lm-eval's rolling windows
        (lm_eval.utils.get_rolling_token_windows, context_len=1 as lm-eval's HF model uses: the first window is
        conditioned on `prefix_token_id`, each later one on the token before it), so a lower bound, as each
        window's ELBO is. is_greedy is not computed."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        from tqdm import tqdm

        if requests:
            self._require_diffusion("loglikelihood_rolling")
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="lopa_fast loglikelihood_rolling"):
            (text,) = req.args
            self._warn_unknown(self._unknown(text), "text")
            windows = get_rolling_token_windows(self.tok_encode(text, add_special_tokens=False), self.prefix_token_id,
                                                max_seq_len=self.max_length - 1, context_len=1)
            total = sum(self._score(*make_disjoint_window(w), greedy=False)[0] for w in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def _unknown(self, text: str) -> list[str]:
        from lopa_fast.request.text import unknown_words

        return unknown_words(self.tok, text) if text else []

    def _warn_unknown(self, missing: list[str], where: str) -> None:
        if missing:  # reported, never silently mapped
            warnings.warn(f"lopa_fast: {len(missing)} word(s) of the {where} unknown to the tokenizer: "
                          + ", ".join(repr(w) for w in missing[:20]), UserWarning, stacklevel=3)

    # ---- generate_until requests -------------------------------------------------------------------------------
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
                          f"{', '.join(SAMPLING_KWARGS)})", RuntimeWarning, stacklevel=2)
        if isinstance(until, str):
            until = [until]
        return knobs, [u for u in (until or []) if u]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        import lopa_fast
        from lopa_fast.request.text import answer_text, check_text_prompt, split_stops

        out_texts = []
        for req in tqdm(requests, disable=disable_tqdm, desc="lopa_fast generate_until"):
            context, gen_kwargs = req.args[0], req.args[1]
            check_text_prompt(context, "context")
            self._warn_unknown(self._unknown(context), "context")
            knobs, until = self.request_knobs(gen_kwargs)
            seqs, text_stops = split_stops(self.tok, until or None)
            if seqs:
                knobs["stop"] = seqs
            ids = self.tok_encode(context)
            out = lopa_fast.generate(self.model, ids, **knobs, verifier=self.verifier)
            eos = knobs.get("eos_token_id", self.model.eos_token_id)
            text = answer_text(out, self.decode, eos, text_stops)
            st = out.stats
            self.records.append({
                "task": getattr(req, "task_name", None), "doc_id": getattr(req, "doc_id", None),
                "prompt_tokens": len(ids), "generated_tokens": st["generated_tokens"], "forwards": st["forwards"],
                "tpf": st["tpf"], "finish_reason": st["finish_reason"], "strategy": st["strategy"],
                "backend": st["backend"],
            })
            out_texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out_texts

    def summary(self) -> dict:
        """What the result dict records for this model: the model args (defaults included; the loglikelihood
        estimator's settings too: an ELBO estimate depends on them) and the totals."""
        args = {"path": self.path, **({"verifier": self.verifier_path} if self.verifier_path else {}), **self.knobs,
                "mc_num": self.mc_num, "mc_batch_size": self.mc_batch_size, "seed": self.seed,
                "check_greedy": self.check_greedy}
        return {"model_args": args, "total": self.totals()}

    def get_model_info(self) -> dict:
        """lm-eval's hook (simple_evaluate calls it once the requests ran, into results["config"]): the summary under
        "lopa_fast". lm-eval has no hook for a top-level key, so the same summary is also set as results["lopa_fast"]
        on the result dict simple_evaluate is building (found in its frame; left alone when lm-eval changes)."""
        import sys

        summary = self.summary()
        frame = sys._getframe(1)
        results = frame.f_locals.get("results") if frame.f_code.co_name == "simple_evaluate" else None
        if isinstance(results, dict) and results.get("lopa_fast") is None:
            results["lopa_fast"] = summary
        return {"lopa_fast": summary}

    def totals(self) -> dict:
        """Tokens, forwards and TPF over every generate_until request so far (TPF = all generated tokens / all
        forwards)."""
        tokens = sum(r["generated_tokens"] for r in self.records)
        forwards = sum(r["forwards"] for r in self.records)
        return {"requests": len(self.records), "generated_tokens": tokens, "forwards": forwards,
                "tpf": tokens / forwards if forwards else 0.0}
