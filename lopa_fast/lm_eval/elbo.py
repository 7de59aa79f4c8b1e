"""The masked-diffusion ELBO of a continuation (lm-eval's loglikelihood on a dLLM) and LLaDA's greedy check
(is_greedy): plain torch over a loaded lopa_fast model, no lm-eval."""
from __future__ import annotations

import hashlib

import torch

MC_NUM = 128  # LLaDA's eval default (mc_num=128)
MC_BATCH = 32  # LLaDA's eval default batch (its batch_size=32)


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
                     generator: torch.Generator) -> float:
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
             for m in (draw_masks(length, batch_size, generator) for _ in range(mc_num // batch_size))]
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
