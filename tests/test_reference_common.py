"""Shared helpers of the reference decoders (confidence formulas, shift) and the stub model the hand-worked
decoder tests use (importable from the other test files: `from test_reference_common import StubModel`)."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from lopa_fast.models.config import FAMILIES
from lopa_fast.models.kv_cache import KVCache
from lopa_fast.reference.common import shift_logits, token_stats, top_k_filter, top_p_filter


# ---------------------------------------------------------------------------------------------------
# A stub model: logits come from a Python rule, the cache bookkeeping is the real KVCache's.
# ---------------------------------------------------------------------------------------------------
def peaked(vocab: int, token: int, prob: float) -> torch.Tensor:
    """Logits [V] whose softmax puts `prob` on `token` and spreads the rest evenly."""
    rest = (1.0 - prob) / (vocab - 1)
    row = torch.full((vocab,), math.log(rest) if rest > 0 else -1e9, dtype=torch.float32)
    row[token] = math.log(prob)
    return row


class StubModel:
    """Duck-typed DecoderLM for hand-worked decoding cases.

    rule(ctx) -> (token, prob) gives the prediction for ONE target position, where ctx is a namespace with
    pos (absolute target position), tokens (the branch's window tokens as a list), start (window start),
    call (0-based forward index) and branch (index in the batch). For Dream-style models (shift=True) the
    raw row j of a window predicts position start+j+1 (so the decoder's shift/last_logit rules apply); for
    LLaDA-style (shift=False) row j predicts position start+j.
    Every forward is recorded in .calls (start, n, cache_len, tokens).
    """

    def __init__(self, rule, *, vocab=8, mask=7, eos=6, shift=True, max_pos=512):
        self.rule = rule
        kind = "dream" if shift else "llada"
        self.config = SimpleNamespace(
            kind=kind, vocab_size=vocab, max_position_embeddings=max_pos,
            num_layers=1, num_kv_heads=1, head_dim=2, eos_token_ids=[eos],
            **dataclasses.asdict(FAMILIES[kind]),  # the family's properties (lopa_fast.models.config.Family)
        )
        self.logits_shift = shift
        self.attention = "full"
        self.mask_token_id, self.eos_token_id = mask, eos
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.calls = []

    def new_cache(self, max_len):
        return KVCache(1, max_len, 1, 2)

    def forward_window(self, tokens, *, cache=None, start=None, mask=None, block_ids=None, commit=0, **kw):
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, n = tokens.shape
        clen = 0 if cache is None else cache.length
        start = clen if start is None else start
        if cache is not None and start >= clen:
            cache.reserve_window(B, n)
        call = len(self.calls)
        self.calls.append(SimpleNamespace(start=start, n=n, cache_len=clen, tokens=tokens.clone(), mask=mask))
        out = torch.empty(B, n, self.config.vocab_size)
        for b in range(B):
            toks = tokens[b].tolist()
            for j in range(n):
                pos = start + j + (1 if self.logits_shift else 0)
                ctx = SimpleNamespace(pos=pos, tokens=toks, start=start, call=call, branch=b)
                out[b, j] = peaked(self.config.vocab_size, *self.rule(ctx))
        if commit:
            cache.commit_window(0, commit)
        return out

    __call__ = forward_window


# ---------------------------------------------------------------------------------------------------
def test_token_stats_formulas_hand_worked():
    # probs of row 0: [0.5, 0.3, 0.2]; row 1: [0.1, 0.1, 0.8]
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    logits = probs.log()
    conf, x0, p = token_stats(logits, sampling_strategy="default")
    assert x0.tolist() == [0, 2]
    torch.testing.assert_close(p, torch.tensor([0.5, 0.8]))
    torch.testing.assert_close(conf, p)
    conf, _, _ = token_stats(logits, sampling_strategy="margin")
    torch.testing.assert_close(conf, torch.tensor([0.2, 0.7]))
    conf, _, _ = token_stats(logits, sampling_strategy="neg_entropy")
    want = [sum(q * math.log(q + 1e-10) for q in row) for row in probs.tolist()]
    torch.testing.assert_close(conf, torch.tensor(want))
    assert conf.dtype == torch.float32 and bool((conf <= 0).all())


def test_token_stats_ties_take_first_index_and_suppress_mask():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    _, x0, _ = token_stats(logits)
    assert x0.tolist() == [1]
    _, x0, p = token_stats(torch.tensor([[0.0, 0.0, 0.0, 5.0]]), suppress_token=3)
    assert x0.tolist() == [0] and abs(p.item() - 1 / 3) < 1e-6


def test_token_stats_temperature_topk_topp():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # top_k=2 keeps two entries: probability renormalised over them
    _, x0, p = token_stats(logits, top_k=2)
    assert x0.item() == 0 and abs(p.item() - 1 / (1 + math.exp(-1))) < 1e-6
    f = top_k_filter(logits, 2)
    assert f[0, 2] == torch.finfo(torch.float32).min
    # top_p=0.5: the first token alone already exceeds 0.5 -> only it survives
    g = top_p_filter(logits, 0.5)
    assert g[0, 0] == 2.0 and bool((g[0, 1:] == torch.finfo(torch.float32).min).all())
    # T > 0 samples with the generator; p is p(x0)
    gen = torch.Generator().manual_seed(0)
    _, x0, p = token_stats(logits.repeat(64, 1), temperature=1.0, generator=gen)
    probs = torch.softmax(logits[0], -1)
    torch.testing.assert_close(p, probs[x0])
    assert len(set(x0.tolist())) > 1


def test_shift_logits_stale_row():
    raw = torch.arange(12.0).reshape(3, 4)
    last = torch.full((4,), -7.0)
    s = shift_logits(raw, last)
    assert s[0].tolist() == [-7.0] * 4 and torch.equal(s[1:], raw[:2])
    assert shift_logits(raw, None)[0].tolist() == [1.0] * 4


def test_stub_model_predicts_through_shift():
    model = StubModel(lambda c: (c.pos % 5, 0.9))
    out = model.forward_window(torch.tensor([[1, 2, 3]]), cache=None, start=0)
    assert out.argmax(-1).tolist() == [[1, 2, 3]]  # raw row j predicts position j+1
    with pytest.raises(ValueError):
        KVCache(1, 0, 1, 2)
