"""lm-evaluation-harness model `lopa_fast` (optional: `pip install .[eval]`; lm-eval has no plugin discovery).

    python -m lopa_fast lm-eval --model lopa_fast \\
        --model_args pretrained=DIR,lora=DIR,strategy=lopa,branching_factor=4,block_size=32 \\
        --tasks gsm8k --apply_chat_template --output_path results/

`python -m lopa_fast lm-eval ARGS` (`main`) parses ARGS with lm-eval's own parser and configuration
(`EvaluatorConfig`: the same flags, defaults and checks as `lm-eval run`), builds the `LopaFastLM` instance, runs
`lm_eval.simple_evaluate` on it and saves lm-eval's result dict with lm-eval's `EvaluationTracker` under
`--output_path` (a directory, or a `.json` path). From Python, `evaluate(lm, tasks, output_path=...)` does the same.
Without `pretrained=` the embedded d2f-arith model runs.

- `generate_until` runs each request through `lopa_fast.generate` (batch 1; lm-eval's batch_size is accepted and
  ignored): the context tokenised (as is, or without added specials when lm-eval applied the chat template,
  which already holds them), `until` as text stops (lopa_fast.text.split_stops: tokenised into generate's `stop=`,
  the one stop mechanism, and matched on the text), `max_gen_toks` as max_new_tokens, `do_sample` / `temperature`
  / `top_p` / `top_k` as the sampling knobs; every other model_arg is a generate knob (GenerateConfig's names).
- `loglikelihood` (multiple-choice tasks, lambada, ...): the masked-diffusion ELBO of the continuation, a Monte
  Carlo estimate over `mc_num` noisy copies (`mc_loglikelihood`, as LLaDA's and Dream's own lm-eval code do);
  `is_greedy` by LLaDA's greedy check (`greedy_matches`). `loglikelihood_rolling` (perplexity tasks) sums the ELBO
  of lm-eval's rolling windows. Both need a full-attention (diffusion) model.
- Per generate_until request the tokens, forwards, TPF and finish reason are recorded (`LopaFastLM.records`);
  `evaluate` adds the totals to the result dict (key "lopa_fast"), prints them and writes them, with every
  request, to `lopa_fast_stats_<date>.json` next to lm-eval's `results_<date>.json`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import warnings
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lopa_fast import logs, threads

SAMPLING_KWARGS = ("do_sample", "temperature", "top_p", "top_k")  # the gen_kwargs mapped to knobs
MODEL_ARGS = ("pretrained", "lora", "verifier", "dtype", "device", "max_gen_toks", "mc_num", "mc_batch_size", "seed",
              "check_greedy")  # fmt: skip  # the others are generate knobs
DTYPES = ("float32", "bfloat16", "float16")
MC_NUM = 128  # LLaDA's eval default (mc_num=128)
MC_BATCH = 32  # LLaDA's eval default batch (its batch_size=32)
SEED = 1234  # the seed LLaDA's eval script sets
LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # lm-eval's EvaluatorConfig.device when --device is not given


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
                      stacklevel=3)  # fmt: skip
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
                     "mc_num))")  # fmt: skip
    if n % b:
        divisors = [d for d in range(1, min(n, 256) + 1) if n % d == 0]
        raise _arg_error("mc_num", n, f"a multiple of mc_batch_size={b} (or an mc_batch_size that divides {n}: "
                         f"{', '.join(map(str, divisors))})")  # fmt: skip
    return n, b


# ---- the masked-diffusion ELBO (loglikelihood) --------------------------------------------------------------------
def mask_counts(k: int, length: int, batch: int) -> torch.Tensor:
    """Stratified mask counts [batch] (int64, each in 1..length) for one draw k in 1..length.

    Row i masks ((k - 1 + floor(i * length / batch)) mod length) + 1 positions: the rows' counts are spread evenly
    over 1..length (LLaDA eval's low-variance draw of the masking ratio across a batch), and since k is uniform,
    every row's count on its own is exactly uniform on 1..length. (LLaDA rounds k + i * length / batch with
    torch.round, half to even: where an offset lands on .5, e.g. length 16 and batch 32, that row's count is
    always even, which biases the estimate slightly; the floor keeps each row unbiased.)"""
    i = torch.arange(batch, dtype=torch.int64)
    return (k - 1 + (i * length) // batch) % length + 1


def draw_masks(length: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Bool [batch, length] (on the CPU): row i masks mask_counts(k, length, batch)[i] positions of the continuation,
    a subset drawn uniformly among those of that size (LLaDA's `_forward_process`: a random permutation per row),
    with k uniform in 1..length. Every draw comes from `generator`."""
    k = int(torch.randint(1, length + 1, (), generator=generator))
    counts = mask_counts(k, length, batch)
    ranks = torch.rand(batch, length, generator=generator).argsort(dim=1).argsort(dim=1)  # a random permutation
    return ranks < counts[:, None]


def _as_ids(ids, device) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)


@torch.no_grad()
def masked_logprobs(model, prompt, target, masks: torch.Tensor) -> torch.Tensor:
    """log p(target[j] | noisy sequence) [batch, L] (float32; 0 where a row does not mask j) for the noisy copies
    prompt + target with row r's `masks[r]` continuation positions set to `model.mask_token_id`.

    prompt: ids [P] (P >= 1 when model.logits_shift); target: ids [L]; masks: bool [batch, L]. One forward of
    [batch, P + L] with the model's full attention; the LM head runs only on the masked rows. Dream-family models
    (`logits_shift`) predict token j from the raw logit at j - 1, LLaDA from the logit at j."""
    device = model.device
    prompt, target, masks = _as_ids(prompt, device), _as_ids(target, device), masks.to(device)
    b, length = masks.shape
    p = prompt.numel()
    n = p + length
    seq = torch.cat([prompt, target]).expand(b, n).clone()
    seq[:, p:] = torch.where(masks, torch.full_like(seq[:, p:], model.mask_token_id), seq[:, p:])
    row, j = masks.nonzero(as_tuple=True)  # the masked (row, position) pairs, R of them
    logits = model(seq, rows=row * n + p + j - int(bool(model.logits_shift)))  # [R, V]
    logp = logits.float().log_softmax(-1).gather(1, target[j][:, None]).squeeze(1)  # [R]
    out = torch.zeros(b, length, dtype=torch.float32, device=device)
    out[row, j] = logp
    return out


def elbo_terms(logp: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Per-row ELBO estimates [batch]: (L / l) * sum over the l masked positions of log p(true token), from
    logp [batch, L] (`masked_logprobs`) and masks bool [batch, L]. Averaged over rows whose masks are drawn as
    `draw_masks` draws them, this is unbiased for the masked-diffusion ELBO
    E_{l ~ U{1..L}} E_{|S| = l} [(L / l) sum_{j in S} log p(x_j | x with S masked)] <= log p(continuation)."""
    masks = masks.to(logp.device)
    length = masks.shape[1]
    return (logp * masks).sum(1) * length / masks.sum(1)


def mc_loglikelihood(model, prompt, target, *, mc_num: int = MC_NUM, batch_size: int = MC_BATCH,
                     generator: torch.Generator) -> float:  # fmt: skip
    """The Monte Carlo ELBO estimate of log p(target | prompt): the mean of `elbo_terms` over mc_num noisy copies,
    batch_size per forward (mc_num must be a multiple of batch_size). prompt: ids [P]; target: ids [L]. An empty
    target has log-likelihood 0.

    Reproduces LLaDA's eval (ML-GSAI/LLaDA eval_llada.py, get_loglikelihood / _forward_process: l uniform in 1..L
    with the stratified batch draw, l random positions masked, cross-entropy weighted by L / l) with the draw of
    `mask_counts`; Dream's eval (DreamLM/Dream eval/eval.py, _eval_target_nll_mc) estimates the same ELBO with an
    independent mask per position at a stratified rate t, weighted 1 / t, and appends EOS to the continuation:
    same expectation, neither of those two details is reproduced here."""
    if mc_num % batch_size:
        raise ValueError(f"mc_loglikelihood: mc_num={mc_num} is not a multiple of batch_size={batch_size}")
    length = len(target)
    if length == 0:
        return 0.0
    terms = [elbo_terms(masked_logprobs(model, prompt, target, m), m)
             for m in (draw_masks(length, batch_size, generator) for _ in range(mc_num // batch_size))]  # fmt: skip
    return float(torch.cat(terms).mean())


@torch.no_grad()
def greedy_matches(model, prompt, target) -> bool:
    """Whether greedy diffusion decoding of the fully masked continuation gives `target` (lm-eval's is_greedy).

    LLaDA's `suffix_greedy_prediction`: start from prompt + L masks; each forward commits the argmax token at the
    one masked position whose argmax probability is highest, until none is left. The first committed token that
    differs from the target ends the check (a committed token never changes, so the answer is already False):
    at most L forwards of one sequence, one when L == 1. prompt: ids [P]; target: ids [L]."""
    device = model.device
    prompt, target = _as_ids(prompt, device), _as_ids(target, device)
    p, length = prompt.numel(), target.numel()
    seq = torch.cat([prompt, torch.full_like(target, model.mask_token_id)])[None]  # [1, P + L]
    open_pos = list(range(length))
    shift = int(bool(model.logits_shift))
    for _ in range(length):
        pos = torch.tensor(open_pos, device=device)
        probs = model(seq, rows=p + pos - shift).float().softmax(-1)  # [m, V]
        conf, tok = probs.max(-1)
        pick = int(conf.argmax())
        j = open_pos.pop(pick)
        if int(tok[pick]) != int(target[j]):
            return False
        seq[0, p + j] = tok[pick]
    return True


def request_seed(seed: int, context_ids, continuation_ids) -> int:
    """The generator seed of one loglikelihood request: a hash of (seed, its ids), so a request's estimate does
    not depend on the order or the company lm-eval sends it in."""
    key = f"lopa_fast-ll:{int(seed)}:{list(context_ids)}:{list(continuation_ids)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


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
                 verifier=None, **knobs):  # fmt: skip
        super().__init__()
        import lopa_fast
        from lopa_fast.assets import model_dir
        from lopa_fast.config import GenerateConfig
        from lopa_fast.text import text_decoder

        fields = {f.name for f in dataclasses.fields(GenerateConfig)}
        unknown = sorted(set(knobs) - fields)
        if unknown:
            raise TypeError(f"lopa_fast model_args: unknown {unknown}; allowed: {', '.join(MODEL_ARGS)} and the "
                            "GenerateConfig knobs (inspect.signature(lopa_fast.generate))")  # fmt: skip
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
                            knob="apply_chat_template", value=True)  # fmt: skip
        self.chat_applied = True  # the templated text holds the special tokens: encode it without adding more
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    # ---- loglikelihood requests ----------------------------------------------------------------------------
    def _require_diffusion(self, what: str) -> None:
        mc = self.model.config
        if not mc.is_diffusion or self.model.mask_token_id is None:  # the family's property, not its attention
            raise NotImplementedError(
                f"lopa_fast: {what} needs a masked-diffusion model (a mask token to fill); {self.path} is "
                f"model_type={mc.model_type!r} (is_diffusion={mc.is_diffusion}, attention={self.model.attention!r}), "
                f"mask_token_id={self.model.mask_token_id!r}. Supported on it: generate_until")  # fmt: skip

    def _fit(self, context: list[int], continuation: list[int]) -> list[int]:
        """The context cut on the left so context + continuation fit `max_length` (with a warning); at least one
        context token is kept (Dream-family models predict the first continuation token from it)."""
        room = self.max_length - len(continuation)
        if room < 1:
            from lopa_fast.errors import KnobError

            raise KnobError(f"lopa_fast loglikelihood: a continuation of {len(continuation)} tokens does not fit "
                            f"max_position_embeddings={self.max_length} with at least one context token",
                            knob="continuation", value=len(continuation))  # fmt: skip
        context = list(context) or [self.prefix_token_id]
        if len(context) > room:
            warnings.warn(f"lopa_fast loglikelihood: context of {len(context)} tokens + continuation of "
                          f"{len(continuation)} exceed {self.max_length}; the context is cut on the left",
                          RuntimeWarning, stacklevel=3)  # fmt: skip
            context = context[-room:]
        return context

    def _score(self, context: list[int], continuation: list[int], greedy: bool) -> tuple[float, bool]:
        """(ELBO estimate, is_greedy) of one tokenised request, its draws seeded by `request_seed`."""
        context = self._fit(context, continuation)
        gen = torch.Generator().manual_seed(request_seed(self.seed, context, continuation))
        with threads.scoped(self.model):  # the thread policy of generate (lopa_fast.threads)
            ll = mc_loglikelihood(self.model, context, continuation, mc_num=self.mc_num,
                                  batch_size=self.mc_batch_size, generator=gen)  # fmt: skip
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
            if hasattr(self, "cache_hook"):
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
                                                max_seq_len=self.max_length - 1, context_len=1)  # fmt: skip
            total = sum(self._score(*make_disjoint_window(w), greedy=False)[0] for w in windows)
            out.append(total)
            if hasattr(self, "cache_hook"):
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def _unknown(self, text: str) -> list[str]:
        from lopa_fast.text import unknown_words

        return unknown_words(self.tok, text) if text else []

    def _warn_unknown(self, missing: list[str], where: str) -> None:
        if missing:  # reported, never silently mapped
            warnings.warn(f"lopa_fast: {len(missing)} word(s) of the {where} unknown to the tokenizer: "
                          + ", ".join(repr(w) for w in missing[:20]), UserWarning, stacklevel=3)  # fmt: skip

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
                          f"{', '.join(SAMPLING_KWARGS)})", RuntimeWarning, stacklevel=2)  # fmt: skip
        if isinstance(until, str):
            until = [until]
        return knobs, [u for u in (until or []) if u]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        import lopa_fast
        from lopa_fast.text import answer_text, check_text_prompt, split_stops

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
            })  # fmt: skip
            out_texts.append(text)
            if hasattr(self, "cache_hook"):
                self.cache_hook.add_partial("generate_until", req.args, text)
        return out_texts

    def summary(self) -> dict:
        """What the result dict records for this model: the model args (defaults included) and the totals."""
        args = {"path": self.path, **({"verifier": self.verifier_path} if self.verifier_path else {}), **self.knobs,
                **self.estimator()}
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

    def estimator(self) -> dict:
        """The loglikelihood estimator's settings (recorded with the results: an ELBO estimate depends on them)."""
        return {"mc_num": self.mc_num, "mc_batch_size": self.mc_batch_size, "seed": self.seed,
                "check_greedy": self.check_greedy}  # fmt: skip

    def totals(self) -> dict:
        """Tokens, forwards and TPF over every generate_until request so far (TPF = all generated tokens / all
        forwards)."""
        tokens = sum(r["generated_tokens"] for r in self.records)
        forwards = sum(r["forwards"] for r in self.records)
        return {"requests": len(self.records), "generated_tokens": tokens, "forwards": forwards,
                "tpf": tokens / forwards if forwards else 0.0}  # fmt: skip


# ---- running lm-eval through its Python API -----------------------------------------------------------------------
def _results_dir(tracker) -> Path:
    """The directory lm-eval's EvaluationTracker saved this run's results file in (its own rule: a `.json`
    output_path is a file name, anything else a directory with one subdirectory per model)."""
    p = Path(tracker.output_path)
    return p.parent if p.suffix == ".json" else p / str(tracker.general_config_tracker.model_name_sanitized)


def evaluate(model, tasks, *, output_path: str | None = None, log_samples: bool = False, model_args=None,
             hf_hub_log_args: dict | None = None, wandb_args: dict | None = None,
             wandb_config_args: dict | None = None, trackio_args: dict | None = None, show_config: bool = False,
             **simple_evaluate_kwargs) -> dict | None:  # fmt: skip
    """`lm_eval.simple_evaluate(model, tasks=tasks, ...)` on a model instance (a `LopaFastLM`, or any lm-eval model
    or model name), lm-eval's result dict saved where asked by lm-eval's own `EvaluationTracker` (output_path: a
    directory or a .json path; with log_samples the per-task samples next to it), the lopa_fast totals added under
    "lopa_fast" and written with every generate_until request (`records`, restarted for each run) to
    lopa_fast_stats_<date>.json beside the results, the results table printed. wandb_args / trackio_args /
    hf_hub_log_args: lm-eval's loggers, as `lm-eval run` uses them. Returns the result dict (None off rank 0)."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import handle_non_serializable, make_table

    log_samples = log_samples or bool(simple_evaluate_kwargs.get("predict_only"))  # lm-eval's rule: saved apart
    hub = dict(hf_hub_log_args or {})
    if output_path:
        hub["output_path"] = output_path
    if os.environ.get("HF_TOKEN") and "token" not in hub:  # as `lm-eval run` does, for push_*_to_hub
        hub["token"] = os.environ["HF_TOKEN"]
    tracker = EvaluationTracker(**hub)
    loggers = _loggers(wandb_args, wandb_config_args, trackio_args)
    lm = model if isinstance(model, LopaFastLM) else None
    if lm is not None:  # the recorded model_args name the model directory (lm-eval's output subdirectory)
        model_args = {"pretrained": lm.path, **(model_args or {})}
        lm.records.clear()  # the stats are this run's
    results = simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=log_samples,
                              evaluation_tracker=tracker, **simple_evaluate_kwargs)  # fmt: skip
    if results is None:
        return None
    samples = results.pop("samples", None) if log_samples else None
    summary = None
    if lm is not None:  # generate_until totals, and the loglikelihood estimator's settings (defaults included)
        summary = results["lopa_fast"] = lm.summary()
    if show_config:
        print(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    _log_results(loggers, results, samples)
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task_name in results["configs"]:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    if tracker.push_results_to_hub or tracker.push_samples_to_hub:
        tracker.recreate_metadata_card()
    name = "lopa_fast" if lm is not None else results["config"]["model"]
    print(f"{name} ({model_args}), limit: {simple_evaluate_kwargs.get('limit')}, "
          f"num_fewshot: {simple_evaluate_kwargs.get('num_fewshot')}")  # fmt: skip
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if summary is not None:
        t = summary["total"]
        print(f"lopa_fast: {t['requests']} generate_until requests, {t['generated_tokens']} tokens, "
              f"{t['forwards']} forwards, TPF {t['tpf']:.2f}")  # fmt: skip
        if output_path:
            path = _results_dir(tracker) / f"lopa_fast_stats_{tracker.date_id}.json"
            path.write_text(json.dumps(dict(summary, requests=lm.records), indent=2))
            print(f"lopa_fast: wrote {path}")
    _finish(loggers)
    return results


def _loggers(wandb_args, wandb_config_args, trackio_args) -> list:
    """lm-eval's W&B / Trackio loggers for the flags given, created before the run as `lm-eval run` creates them."""
    from lm_eval.loggers import TrackioLogger, WandbLogger

    out = [WandbLogger(wandb_args, wandb_config_args or {})] if wandb_args else []
    return out + ([TrackioLogger(trackio_args)] if trackio_args else [])


def _log_results(loggers: list, results: dict, samples) -> None:
    """Each logger's results (and samples) as `lm-eval run` logs them: a failure is logged, never fatal."""
    for lg in loggers:
        try:
            lg.post_init(results)
            lg.log_eval_result()
            if samples is not None:
                lg.log_eval_samples(samples)
        except Exception as e:  # noqa: BLE001
            logging.getLogger(__name__).info("lopa_fast: logging to %s failed: %s", type(lg).__name__, e)


def _finish(loggers: list) -> None:
    for lg in loggers:
        (lg.finish if hasattr(lg, "finish") else lg.run.finish)()  # TrackioLogger.finish; W&B: its run's


def _run(args) -> int:
    """`lm-eval run` with the parsed flags: lm-eval's EvaluatorConfig (defaults, --config YAML, checks), the
    `lopa_fast` model built as an instance, then `evaluate`."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as lm-eval's run does
    log = logging.getLogger(__name__)
    with logs.step(log, "reading lm-eval's configuration", "read lm-eval's configuration", long=False):
        cfg = EvaluatorConfig.from_cli(args)
    if cfg.model == "lopa_fast":  # a model_arg wins over the flag of the same name
        # --device unnamed: lm-eval's default cuda:0 is not asked for; the model's own default (cuda when
        # available, else the CPU, without a warning) applies
        named = getattr(args, "device", None) is not None or cfg.device != LM_EVAL_DEFAULT_DEVICE
        flags = {"batch_size": cfg.batch_size, "max_batch_size": cfg.max_batch_size,
                 "device": cfg.device if named else None}
        with logs.step(log, "loading the model", "loaded the model", long=False):
            model = LopaFastLM.create_from_arg_obj(cfg.model_args, {k: v for k, v in flags.items()
                                                                    if k not in cfg.model_args})  # fmt: skip
    else:  # another lm-eval model: lm-eval builds it
        model = cfg.model
    seed = cfg.seed or [None] * 4
    with logs.step(log, "indexing lm-eval's tasks", "indexed lm-eval's tasks", long=False):
        tasks = cfg.process_tasks(cfg.metadata)
    evaluate(model, cfg.tasks, output_path=cfg.output_path, log_samples=cfg.log_samples, model_args=cfg.model_args,
             hf_hub_log_args=cfg.hf_hub_log_args, wandb_args=cfg.wandb_args, wandb_config_args=cfg.wandb_config_args,
             trackio_args=cfg.trackio_args, show_config=cfg.show_config, num_fewshot=cfg.num_fewshot,
             batch_size=cfg.batch_size, max_batch_size=cfg.max_batch_size,
             device=str(model._device) if isinstance(model, LopaFastLM) else cfg.device,
             use_cache=cfg.use_cache, cache_requests=cfg.cache_requests.get("cache_requests", False),
             rewrite_requests_cache=cfg.cache_requests.get("rewrite_requests_cache", False),
             delete_requests_cache=cfg.cache_requests.get("delete_requests_cache", False), limit=cfg.limit,
             samples=cfg.samples, check_integrity=cfg.check_integrity, write_out=cfg.write_out,
             system_instruction=cfg.system_instruction, apply_chat_template=cfg.apply_chat_template,
             fewshot_as_multiturn=cfg.fewshot_as_multiturn, gen_kwargs=cfg.gen_kwargs,
             task_manager=tasks, predict_only=cfg.predict_only, random_seed=seed[0],
             numpy_random_seed=seed[1], torch_random_seed=seed[2], fewshot_random_seed=seed[3],
             confirm_run_unsafe_code=cfg.confirm_run_unsafe_code, metadata=cfg.metadata)  # fmt: skip
    return 0


def prepare() -> None:
    """Import what `main` needs (lm-eval's command line, its evaluator, torch): the slow part of a start, done
    under the CLI's progress line."""
    import lm_eval._cli  # noqa: F401
    import lm_eval.evaluator  # noqa: F401
    import torch  # noqa: F401


def main(argv: list[str]) -> int:
    """`python -m lopa_fast lm-eval ARGS`: ARGS parsed by lm-eval's own command-line parser (its `run`, `ls`,
    `validate`; flags without a subcommand mean `run`, as in `lm-eval`); `run` goes through `_run` (the Python
    API), the others run as lm-eval runs them."""
    from lm_eval._cli import HarnessCLI

    cli = HarnessCLI()
    argv = list(argv)
    if len(argv) > 1 and argv[0] not in cli._subparsers.choices:  # lm-eval's legacy rule (HarnessCLI.parse_args)
        argv.insert(0, "run")
    elif argv == ["run"]:  # a bare `run`: its help, as lm-eval prints it
        argv.append("--help")
    args = cli._parser.parse_args(argv)
    if args.command != "run":
        cli.execute(args)
        return 0
    return _run(args)
