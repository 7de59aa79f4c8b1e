"""Batches of the embedded task for training and evaluation: right-padded token rows with the
generation region right after each prompt, as the decoders lay them out at inference.

Row layout (one problem): [bos, prompt..., solution..., EOS...] with exactly `gen_len` generation
positions after the prompt, then EOS padding up to the batch's longest row. `lens[b]` is the valid
length P_b + gen_len; keys beyond it are masked via the model's `win_lens`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lopa_fast import tasks


@dataclass
class Batch:
    """ids [B, n] int64 (clean tokens), prompt_lens [B], lens [B] (valid length = P + gen_len),
    answers: list[int]."""

    ids: torch.Tensor
    prompt_lens: torch.Tensor
    lens: torch.Tensor
    answers: list


def make_batch(problems, tok, gen_len: int) -> Batch:
    """Encode `problems` (list of tasks.arith.Problem) with `tok` (a tokenizers.Tokenizer)."""
    rows, plens = [], []
    for p in problems:
        prompt, target = tasks.encode_problem(tok, p, gen_len)
        rows.append(prompt + target)
        plens.append(len(prompt))
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), tasks.EOS_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    plens_t = torch.tensor(plens)
    return Batch(ids, plens_t, plens_t + gen_len, [p.answer for p in problems])


def block_ids_for(prompt_lens: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """[B, n] block index: 0 on the prompt, 1 + (j - P) // block_size on generated positions (the
    D2F block table, block 0 = prompt). Positions past the valid length get their block id too; they
    are masked as keys by win_lens."""
    j = torch.arange(n)[None, :]
    gen = (j - prompt_lens[:, None]).clamp(min=-1)
    return torch.where(gen < 0, torch.zeros_like(gen), 1 + gen // block_size)
