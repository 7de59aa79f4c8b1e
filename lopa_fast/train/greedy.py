"""A self-contained one-token-per-forward greedy decoder, used to monitor training and as the
quality-bar check: the generation region starts fully masked; each forward (full attention over
prompt + the whole region, Dream's vanilla layout) fills the single masked position whose
prediction has the highest max-probability (alg="max_prob") or the lowest entropy (alg="entropy", Dream's
alg="entropy", the eval's vanilla row; the dParallel teacher) with its argmax, or the leftmost masked position
(alg="left_to_right": the order an autoregressive model writes in). gen_len forwards per problem.

This is deliberately independent of lopa_fast.generate (which it cross-checks).
"""
from __future__ import annotations

import torch

from lopa_fast import tasks
from lopa_fast.train.data import Batch, make_batch

ALGS = ("max_prob", "entropy", "left_to_right")


@torch.no_grad()
def greedy_fill(model, batch: Batch, gen_len: int, alg: str = "max_prob", given: torch.Tensor | None = None,
                observe=None) -> torch.Tensor:
    """Decode the generation regions of `batch` -> generated ids [B, gen_len] (mask-free).

    Dream alignment: the raw logit at position j - 1 predicts token j. alg: which masked position a forward
    fills, "max_prob" (highest max-probability), "entropy" (lowest entropy), "left_to_right" (the leftmost);
    ties go to the leftmost. given: optional bool [B, gen_len], positions that start with their clean token from
    `batch` instead of a mask (train.diagnose gives the true EOS tail this way). observe: `_fill`'s hook
    (train.certainty reads the confidences of the still-masked positions from it).
    """
    return _fill(model, batch, gen_len, alg, given, teacher_forced=False, who="greedy_fill", observe=observe)[0]


def _fill(model, batch: Batch, gen_len: int, alg: str, given: torch.Tensor | None, teacher_forced: bool,
          who: str, observe=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-fill-per-forward loop of greedy_fill and fill_orders -> (region ids [B, gen_len], visiting order
    [B, gen_len]: the region offset filled at each step, -1 where a row had nothing left). teacher_forced: every
    fill writes the clean token of `batch` instead of the argmax. observe: called after each forward as
    observe(step, prob_max [B, gen_len], still [B, gen_len] bool: the positions masked before this fill)."""
    if alg not in ALGS:
        raise ValueError(f"{who}: alg={alg!r}; allowed: {ALGS}")
    ids = batch.ids.clone()
    B, n = ids.shape
    gen_pos = batch.prompt_lens[:, None] + torch.arange(gen_len)[None, :]  # [B, gen_len]
    rows = torch.arange(B)[:, None]
    if given is not None and tuple(given.shape) != (B, gen_len):
        raise ValueError(f"{who}: given has shape {tuple(given.shape)}; expected {(B, gen_len)}")
    clean = ids[rows, gen_pos]
    masks = torch.full_like(clean, tasks.MASK_ID)
    ids[rows, gen_pos] = masks if given is None else torch.where(given, clean, masks)
    order = torch.full((B, gen_len), -1, dtype=torch.long)
    for step in range(gen_len):  # exactly one fill per forward; gen_len forwards (fewer when positions are given)
        still = ids[rows, gen_pos] == tasks.MASK_ID  # [B, gen_len]
        if not still.any():
            break
        logits = model(ids, mask="full", win_lens=batch.lens).float()  # [B, n, V]
        pred = logits[rows, gen_pos - 1]  # [B, gen_len, V]: predictions for the region
        prob = pred.softmax(-1)
        p_max, x0 = prob.max(-1)
        if observe is not None:
            observe(step, p_max, still)
        if alg == "entropy":  # confidence = negative entropy (nats)
            p_max = (prob * prob.clamp_min(1e-30).log()).sum(-1)
        elif alg == "left_to_right":  # the leftmost masked position wins
            p_max = -torch.arange(gen_len, dtype=p_max.dtype).expand_as(p_max)
        p_max = p_max.masked_fill(~still, -float("inf"))
        pick = p_max.argmax(-1)  # [B]
        has = still.any(-1)
        b = torch.arange(B)[has]
        order[b, step] = pick[b]
        ids[b, gen_pos[b, pick[b]]] = (clean if teacher_forced else x0)[b, pick[b]]
    return ids[rows, gen_pos], order


def accuracy(model, problems, tok, gen_len: int, batch_size: int = 64) -> tuple[float, list[str]]:
    """Exact-match accuracy of greedy_fill on `problems`, and the decoded texts."""
    correct, texts = 0, []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        batch = make_batch(chunk, tok, gen_len)
        out = greedy_fill(model, batch, gen_len)
        for p, row in zip(chunk, out.tolist()):
            text = tok.decode(row, skip_special_tokens=True)
            texts.append(text)
            correct += int(tasks.extract_answer(text) == p.answer)
    return correct / max(1, len(problems)), texts


@torch.no_grad()
def fill_orders(model, batch: Batch, gen_len: int, alg: str = "entropy") -> torch.Tensor:
    """The order in which `alg` visits the positions of `batch`'s generation regions when every fill writes the
    clean token of `batch` (teacher forcing: the state stays a true rendering's) -> [B, gen_len] int64, the
    region offsets in visiting order. gen_len forwards. `train.d2f`'s "full_policy" view cuts these orders to
    train on the states this decoder visits."""
    return _fill(model, batch, gen_len, alg, None, teacher_forced=True, who="fill_orders")[1]
