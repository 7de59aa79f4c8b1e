"""Reference APD (Adaptive Parallel Decoding): a Dream-family dLLM drafts, a small causal AR model verifies.

Semantics of the public `apd_sample` (docs/semantics.md section "APD"; knobs in docs/decoding.md):

    x = [prompt | MASK x max_new_tokens]; curr = P (the first masked position)
    per step:
      right = min(curr + M, L) (M = max_lookahead; None: right = L, the whole canvas)
      left  = 0 on the first step or when kv_window W is None (no dLLM cache), else
              max(curr - W - num_accept + 1, 0)  (curr already advanced: previous curr - W + 1)
      dLLM cache cropped to [0, left); one full-attention forward of x[left:right] over it (the window's
              K/V are appended: the cache holds [0, right) after the step). Positions < left keep K/V
              computed while later positions were masks (the approximation of the cache).
      logits shifted (Dream): window row i takes raw row i-1, row 0 keeps its own
      draft x0 = sample over the masked window rows (Gumbel-max in float64 of logits / T with noise
              (-log U)^T: temperature applied twice, quirk Q1; plain argmax at T = 0)
      verifier (apd_mixture_weight R not None): first step: a causal forward of x[:right] with x0 written
              into [curr, right) (AR logits = its outputs at curr-1 .. right-2); later steps: a forward of x0
              only, at positions [curr, right), over the AR cache, AR logits = [prev_logits ; outputs[:-1]]
      target = argmax(R * l_D[:, :V_ar] + (1 - R) * l_AR) (raw logits, no noise: quirk Q2)
      num_accept = length of the longest prefix where x0 == target, at least 1 (the first always accepted)
      prev_logits = l_AR[num_accept] if num_accept < len(x0) else l_AR[-1] (off by one when all are
              accepted: quirk Q3); AR cache rolled back (truncated) to curr + num_accept
      leftright baseline (R None, no verifier): num_accept = tokens_per_step (K, default 1)
      x[curr : curr + num_accept] = x0[:num_accept]; curr += num_accept
      stop when no mask is left or the EOS id appears anywhere in x (the whole accepted batch is kept,
      tokens after the EOS included; the prompt is scanned too)

generated_ids = x[P : curr] (every committed position; the unreached tail is not returned).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from lopa_fast import keyed
from lopa_fast.output.progress import after_step
from lopa_fast.output import GenerateOutput, finalize_stats
from lopa_fast.strategies.apd.spec import check_apd_pair as check_models  # noqa: F401  (shared with the spec)
from lopa_fast.reference.common import Clock, check_finite, request_noise, round_cap_hit, top_k_filter, top_p_filter

# the verifier's logits are never divided by the temperature (the target is the mixture's raw argmax, quirk Q2):
# its numerics guard checks finiteness only
_RAW = SimpleNamespace(temperature=0.0)


# ---- the pieces ----------------------------------------------------------------------------------
def draft_tokens(mask_logits: torch.Tensor, cfg, generator=None, keys=None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The dLLM draft over the masked window rows [n, V] -> (noise [n, V] float64 or None, x0 [n]).

    logits / T (T > 0), then top-p / top-k filters, then argmax(exp(l) / noise) in float64 with
    noise = (-log U)^T: temperature applied twice (Q1: sampling at T^2). single_temperature=True draws
    noise = -log U (sampling from softmax(l / T)). T = 0: plain argmax, no noise.
    U: upstream's `torch.rand` from `generator` (sampler="upstream"), or, with keys [n] (sampler="keyed"), the keyed
    uniform of (row key, vocab id) (lopa_fast.keyed.row_exponentials): the same draws on the fast backend.
    """
    logits = mask_logits
    if cfg.suppress_mask_token:
        logits = logits.clone()
        logits[:, cfg.mask_token_id] = float("-inf")
    T = cfg.temperature
    if T > 0:
        logits = logits / T
    if cfg.top_p is not None and cfg.top_p < 1:
        logits = top_p_filter(logits, cfg.top_p)
    if cfg.top_k is not None:
        logits = top_k_filter(logits, cfg.top_k)
    if T == 0:
        return None, torch.argmax(logits, dim=-1)
    l64 = logits.to(torch.float64)
    if keys is not None:
        noise = keyed.row_exponentials(keys, l64.shape[-1])
    else:
        u = torch.rand(l64.shape, dtype=torch.float64, device=l64.device, generator=generator)
        noise = -torch.log(u)
    if not cfg.single_temperature:
        noise = noise**T
    return noise, torch.argmax(l64.exp() / noise, dim=-1)


def accept_count(x0: torch.Tensor, l_dllm: torch.Tensor, l_ar: torch.Tensor, R: float, noise=None, cfg=None) -> int:
    """Number of draft tokens accepted: the longest prefix with x0 == target (at least 1).

    x0 [n]; l_dllm [n, V_ar] (the drafter's raw logits restricted to the verifier's vocabulary); l_ar [n, V_ar]
    (row i: the verifier's logits for draft position i). target = argmax(R * l_dllm + (1 - R) * l_ar) (Q2);
    with coupled_gumbel=True and T > 0 the target reuses the draft's noise: argmax(exp(mix / T) / noise).
    """
    mix = R * l_dllm + (1 - R) * l_ar
    if cfg is not None and cfg.coupled_gumbel and noise is not None:
        T = cfg.temperature
        target = torch.argmax((mix / T).to(torch.float64).exp() / noise[:, : mix.shape[-1]], dim=-1)
    else:
        target = torch.argmax(mix, dim=-1)
    agree = x0 == target
    agree[0] = True
    return min(int(torch.cumprod(agree.to(torch.long), 0).sum()), x0.numel())


def dllm_window_logits(model, cache, x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Shifted logits [right-left, V] of the drafter's window x[left:right] (cache=None: no cache, left = 0).

    With a cache: crop it to [0, left), forward the window with full attention over cache + window, append
    the window's K/V (the cache holds [0, right) afterwards)."""
    tokens = x[left:right][None]
    if cache is None:
        raw = model.forward_window(tokens, mask="full")[0]
    else:
        cache.truncate(left)
        raw = model.forward_window(tokens, cache=cache, start=left, mask="full", commit=right - left)[0]
    return torch.cat([raw[:1], raw[:-1]], dim=0)


# ---- the loop -----------------------------------------------------------------------------------
def generate(model, prompt: torch.Tensor, cfg, verifier=None, on_round=None) -> GenerateOutput:
    """APD / leftright decoding. prompt: LongTensor [P] on model.device; cfg: bound GenerateConfig; on_round:
    the progress hook (lopa_fast.output.progress.report_round), called after every step. A stop sequence (`stop=`)
    in the committed prefix x[P:curr] ends decoding after the step that completed it."""
    check_models(model, verifier, cfg)
    P, L = prompt.numel(), prompt.numel() + cfg.max_new_tokens
    mask_id, eos_id = cfg.mask_token_id, cfg.eos_token_id
    R, W, M = cfg.apd_mixture_weight, cfg.kv_window, cfg.max_lookahead
    K = cfg.tokens_per_step if cfg.tokens_per_step is not None else 1
    gen = request_noise(cfg, prompt.device)  # keyed: KeyedNoise; upstream: a torch.Generator or None
    x = torch.cat([prompt, prompt.new_full((cfg.max_new_tokens,), mask_id)])
    dcache = model.new_cache(L) if W is not None else None
    vcache = verifier.new_cache(L) if verifier is not None else None
    Vq = verifier.config.vocab_size if verifier is not None else None
    curr, num_accept, first = P, 0, True
    prev_logits = None
    counts: list[int] = []
    stats = {"forwards": 0, "model_calls": 0, "dllm_forwards": 0, "verifier_forwards": 0}
    trace = [] if cfg.return_trace else None
    eos_detected = False
    with Clock(prompt.device) as clock:
        while curr < L:
            if stats["forwards"] >= cfg.max_rounds:
                round_cap_hit(cfg, stats, "apd")
                break
            right = min(curr + M, L) if M is not None else L
            left = 0 if (W is None or first) else max(curr - W - num_accept + 1, 0)
            logits = dllm_window_logits(model, dcache, x, left, right)
            stats["dllm_forwards"] += 1
            mask_rows = (x[left:right] == mask_id).nonzero(as_tuple=True)[0]
            if mask_rows.numel() != right - curr:
                raise RuntimeError(
                    f"apd: the window [{left}, {right}) holds {mask_rows.numel()} masks but {right - curr} are ahead "
                    "of the decoding position: the drafter emitted the mask token as a draft token (upstream's "
                    "apd_sample misaligns the draft here). Pass suppress_mask_token=True"
                )
            mask_logits = logits[mask_rows]
            check_finite(mask_logits, curr, cfg, stats["forwards"] + 1, "apd")  # row i predicts position curr + i
            if isinstance(gen, keyed.KeyedNoise):  # rows keyed by (seed, step = this dLLM forward, position)
                rows = curr + torch.arange(mask_logits.shape[0], device=prompt.device)
                noise, x0 = draft_tokens(mask_logits, cfg, keys=gen.keys(keyed.TOKEN, stats["dllm_forwards"], 0, rows))
            else:
                noise, x0 = draft_tokens(mask_logits, cfg, gen)
            if R is not None:
                if int(x0.max()) >= Vq:
                    bad = int(x0.max())
                    raise RuntimeError(
                        f"apd: the drafter drafted token id {bad}, outside the verifier's vocabulary [0, {Vq}) "
                        "(upstream's verifier cannot embed it either)"
                    )
                if first:
                    draft = x[:right].clone()
                    draft[curr:right] = x0
                    out = verifier.forward_window(draft[None], cache=vcache, start=0, mask="causal", commit=right)[0]
                    l_ar = out[curr - 1 : -1]
                else:
                    out = verifier.forward_window(x0[None], cache=vcache, start=curr, mask="causal",
                                                  commit=right - curr)[0]
                    l_ar = torch.cat([prev_logits[None], out[:-1]], dim=0)
                stats["verifier_forwards"] += 1
                check_finite(torch.cat([l_ar, out[-1:]]) if cfg.exact_prev_logits else l_ar, curr, _RAW,
                             stats["forwards"] + 1, "apd")  # the rows read (out[-1]: prev_logits when exact)
                num_accept = accept_count(x0, mask_logits[:, :Vq], l_ar, R, noise, cfg)
                if num_accept < l_ar.shape[0]:
                    prev_logits = l_ar[num_accept]
                else:  # all accepted: upstream reuses the prediction for right-1 (Q3)
                    prev_logits = out[-1] if cfg.exact_prev_logits else l_ar[-1]
                vcache.truncate(curr + num_accept)
            else:
                num_accept = K
            first = False
            stats["forwards"] += 1
            n_written = min(num_accept, L - curr)
            x[curr : curr + n_written] = x0[:n_written]
            if trace is not None:
                trace.append({
                    "round": stats["forwards"], "window_start": left - P, "window_len": right - left,
                    "draft": x0.tolist(), "num_accept": num_accept,
                    "accepted": [[curr + i - P, int(x0[i])] for i in range(n_written)],
                })
            curr += num_accept
            counts.append(num_accept)
            no_mask = not bool((x == mask_id).any())
            has_eos = eos_id is not None and bool((x == eos_id).any())
            if has_eos:
                eos_detected = True
            # the hook; a stop sequence in the committed prefix x[P:curr] ends decoding too
            if after_step(x[P:], cfg, stats, on_round) or no_mask or has_eos:
                break
    ids = x[P : min(curr, L)].tolist()
    stats["model_calls"] = stats["dllm_forwards"] + stats["verifier_forwards"]
    stats["acceptance_counts"] = counts
    stats["mean_accepted"] = sum(counts) / len(counts) if counts else 0.0
    stats["eos_detected"] = eos_detected
    finalize_stats(stats, ids, eos_id, mask_id, clock.seconds, steps_plus_one=False)
    return GenerateOutput(ids, stats, trace)
