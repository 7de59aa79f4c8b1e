"""The exact posterior of an `arith-var` solution given some of its tokens: soft training targets and a probe.

An `arith-var` problem has at most 5,832 rendering choices (`arith_var.n_choices()`), all known. So for any
state of a generation region (some positions hold tokens, the others are masks) the true distribution of
every masked token is computable exactly: keep the renderings that agree with every visible token, weight
them by the generator's probabilities, and count, per position, the tokens they put there.

Two uses:
- **Soft targets** (`train.d2f --soft-targets`): the masked-diffusion loss with the clean token as a hard
  label is an unbiased one-sample estimate of the cross-entropy to this posterior marginal; training on the
  marginal itself is the same objective with the sampling noise of the label removed (Rao-Blackwellised).
  For arith-var that noise is large: after the first few pivots a far position can hold any of several
  tokens, and the hard label names one of them at random.
- **The calibration probe** (`train.diagnose --posterior`): along a decode, how often does a model commit a
  token the true posterior gives low probability, and was that position still uncertain (posterior entropy)
  when the model chose it?

Layout: as `train.data.make_batch` lays out the region, gen_len positions: the solution's token ids, then EOS
up to gen_len. Everything runs on CPU with int64 / float64 tensors; one table is about 5,832 x 96 ids.
"""
from __future__ import annotations

import functools
import math

import torch

from lopa_fast import tasks
from lopa_fast.tasks import arith_var, tokenizer_var


@functools.cache
def _vocab() -> dict[str, int]:
    return tokenizer_var.vocab()


def _ids(text: str) -> list[int]:
    v = _vocab()
    return [v[t] for t in arith_var.tokens(text)]


def rendering_table(problem, gen_len: int = arith_var.GEN_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rendering choice of `problem`'s parameters as token rows -> (ids [R, gen_len] int64, the solution
    then EOS padding; weights [R] float64, summing to 1: the generator's probability of each choice).

    R = `arith_var.n_choices()` (equal texts from different choices stay separate rows; their weights add up in
    any marginal). Built slot by slot: each slot's options are written at every row's current length."""
    return _table(tuple(problem.numbers), gen_len)


def _table(numbers: tuple, gen_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rendering_table of the parameters (a, b, c, d): the solutions never name the prompt's person, item or
    container, so the numbers fix every rendering."""
    f = arith_var._fields(*numbers, "Lily", "She", "apples", "boxes")
    tail = _ids(f"#### {f['r']}")
    tables, weights = [], []
    for plan in arith_var.PLANS:
        slots = arith_var._PLAN_SLOTS[plan]
        sizes = arith_var.slot_sizes(plan)
        n = math.prod(sizes)
        ids = torch.full((n, gen_len), tasks.EOS_ID, dtype=torch.long)
        cur = torch.zeros(n, dtype=torch.long)  # every row's length so far
        stride = n
        for slot, size in zip(slots, sizes):
            stride //= size  # rows r choose option (r // stride) % size: the same order as all_choices()
            opt_of_row = (torch.arange(n) // stride) % size
            for k in range(size):
                toks = _ids(arith_var._slot_text(slot, k, f))
                if not toks:
                    continue
                rows = (opt_of_row == k).nonzero()[:, 0]
                cols = cur[rows, None] + torch.arange(len(toks))[None, :]
                if int(cols.max()) >= gen_len:
                    raise ValueError(f"rendering_table: a rendering is longer than gen_len={gen_len}")
                ids[rows[:, None], cols] = torch.tensor(toks)
                cur[rows] += len(toks)
        cols = cur[:, None] + torch.arange(len(tail))[None, :]
        if int(cols.max()) >= gen_len:  # the EOS after the tail needs a position too
            raise ValueError(f"rendering_table: a rendering is longer than gen_len={gen_len}")
        ids[torch.arange(n)[:, None], cols] = torch.tensor(tail)
        tables.append(ids)
        weights.append(torch.full((n,), 1.0 / (len(arith_var.PLANS) * n), dtype=torch.float64))
    return torch.cat(tables), torch.cat(weights)


def posterior(table: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, visible: torch.Tensor,
              vocab_size: int) -> tuple[torch.Tensor | None, float]:
    """The exact token distribution at every position given the visible tokens.

    table [R, L] / weights [R]: `rendering_table`; state [L] token ids (any value where not visible);
    visible bool [L]. Returns (probs [L, vocab_size] float64, or None when no rendering agrees with the visible
    tokens; the prior mass of the agreeing renderings)."""
    agree = ((table == state[None, :]) | ~visible[None, :]).all(1)
    w = weights * agree
    mass = float(w.sum())
    if mass <= 0.0:
        return None, 0.0
    L = table.shape[1]
    probs = torch.zeros(L, vocab_size, dtype=torch.float64)
    probs.scatter_add_(1, table.T, (w / mass)[None, :].expand(L, -1))
    return probs, mass


# every train tuple fits (1,948 of them; uint8 tables of 5,832 x 96 ids: ~0.55 MB each, ~1.1 GB in all)
@functools.lru_cache(maxsize=2048)
def _cached_table(params: tuple, gen_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rendering_table keyed by (a, b, c, d), ids stored as uint8 (the vocabulary has 127 ids)."""
    if len(_vocab()) > 256:
        raise ValueError(f"posterior: {len(_vocab())} ids do not fit the uint8 cache")
    table, w = _table(params, gen_len)
    return table.to(torch.uint8), w


def table_for(problem, gen_len: int = arith_var.GEN_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """`rendering_table` of `problem` (ids [R, gen_len] int64, weights [R]), cached on its numbers."""
    table, w = _cached_table(tuple(problem.numbers), gen_len)
    return table.long(), w


def soft_targets(problems, noisy: torch.Tensor, masked: torch.Tensor, prompt_lens: torch.Tensor, lens: torch.Tensor,
                 gen_len: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior marginals at the masked positions of a training batch (full attention: every visible token
    of the region conditions every masked one).

    noisy [B, n] ids with MASK_ID where masked; masked bool [B, n]; lens [B] the rows' window ends (positions
    from lens on are outside the sequence, as in the "full_pipe" view: neither visible nor targets). Returns (targets
    [M, vocab_size] float32 in `masked.nonzero()` order, valid bool [M]: False for rows whose visible tokens agree with
    no rendering, which cannot happen for a clean batch's own masks but does for states a model wrote)."""
    rows_t, rows_v = [], []
    for i, p in enumerate(problems):
        P = int(prompt_lens[i])
        region = noisy[i, P:P + gen_len]
        vis = ~masked[i, P:P + gen_len] & (torch.arange(P, P + gen_len) < int(lens[i]))
        table, w = table_for(p, gen_len)
        probs, _ = posterior(table, w, region, vis, vocab_size)
        m = masked[i, P:P + gen_len]
        k = int(m.sum())
        if probs is None:
            rows_t.append(torch.zeros(k, vocab_size))
            rows_v.append(torch.zeros(k, dtype=torch.bool))
        else:
            rows_t.append(probs[m].float())
            rows_v.append(torch.ones(k, dtype=torch.bool))
    return torch.cat(rows_t), torch.cat(rows_v)
