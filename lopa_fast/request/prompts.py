"""The prompt of a request: what `generate` accepts as input_ids, checked and turned into a LongTensor [P] on the
model's device (`prepare_prompt`), and the checks that need the bound config too (`check_prompt`: ids in the
vocabulary, no mask token, prompt + generation within the model's positions). Every error names the value and
what is allowed."""
from __future__ import annotations

import torch

from lopa_fast.config import GenerateConfig
from lopa_fast.errors import KnobError


def prepare_prompt(model, input_ids) -> torch.Tensor:
    """Validate the prompt and return it as a LongTensor [P] on model.device.

    Accepts a LongTensor [P] or [1, P] (int64 or int32) on the model's device, or a list of ints.
    """
    device = model.device
    if isinstance(input_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise TypeError("input_ids: a list must hold only ints")
        big = next((i for i, t in enumerate(input_ids) if not -(2**63) <= t < 2**63), None)
        if big is not None:  # torch.tensor would overflow without naming the id
            vocab = model.config.vocab_size
            raise KnobError(f"input_ids contains token id {input_ids[big]} (at position {big}); allowed: ids in "
                            f"[0, vocab_size={vocab})", knob="input_ids", value=input_ids[big])
        ids = torch.tensor(list(input_ids), dtype=torch.long, device=device)
    elif isinstance(input_ids, torch.Tensor):
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids.dtype={input_ids.dtype}; allowed: torch.int64 or torch.int32 token ids")
        if input_ids.device != device:
            raise ValueError(
                f"input_ids.device={input_ids.device} but the model is on {device}; move the ids to the model's device"
            )
        ids = input_ids
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"input_ids has batch size {ids.shape[0]} (shape {tuple(ids.shape)}); allowed: batch 1 "
                    "([P] or [1, P]); for several prompts pass a list of prompts (one output each)"
                )
            ids = ids[0]
        elif ids.dim() != 1:
            raise ValueError(f"input_ids has shape {tuple(ids.shape)}; allowed: [P] or [1, P]")
        ids = ids.to(torch.long)
    else:
        raise TypeError(f"input_ids: {type(input_ids).__name__}; allowed: a LongTensor [P] / [1, P] or a list of ints")
    if ids.numel() == 0:
        raise ValueError("input_ids is empty (P=0); allowed: a prompt of at least one token")
    return ids.contiguous()


def check_prompt(model, ids: torch.Tensor, cfg: GenerateConfig) -> None:
    """Checks that need both the prompt [P] and the bound config: ids in the vocabulary, no mask token, the prompt +
    max_new_tokens within max_position_embeddings. (The request's memory estimate is checked beside it:
    lopa_fast.api.check_prompt runs both.)"""
    vocab = model.config.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"input_ids contains token id {bad}; allowed: ids in [0, vocab_size={vocab})")
    if bool((ids == cfg.mask_token_id).any()):
        pos = int((ids == cfg.mask_token_id).nonzero()[0, 0])
        raise ValueError(
            f"input_ids contains the mask token id {cfg.mask_token_id} (first at position {pos}); "
            "a prompt must not contain masks"
        )
    P = ids.numel()
    limit = model.config.max_position_embeddings
    total = P + cfg.max_new_tokens
    if total > limit:
        raise ValueError(
            f"prompt length {P} + max_new_tokens {cfg.max_new_tokens} = {total} exceeds the model's "
            f"max_position_embeddings={limit}"
        )


def is_batch(input_ids) -> bool:
    """A list / tuple of prompts (tensors or lists of ids) is a batch; a list of ints is one prompt."""
    return isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and all(
        isinstance(p, (torch.Tensor, list, tuple)) for p in input_ids
    )


def is_text(input_ids) -> bool:
    """A str prompt, or a list of them (generate encodes them with the tokenizer)."""
    return isinstance(input_ids, str) or (isinstance(input_ids, (list, tuple)) and len(input_ids) > 0
                                          and all(isinstance(p, str) for p in input_ids))


def prompt_lens(input_ids) -> list[int] | None:
    """The prompt lengths of generate's input_ids (one prompt: one length), for max_length=; None when the input is
    not a prompt (prepare_prompt names what is wrong with it)."""
    prompts = list(input_ids) if is_batch(input_ids) else [input_ids]
    lens = []
    for p in prompts:
        if isinstance(p, torch.Tensor):
            lens.append(int(p.shape[-1]) if p.dim() else 0)
        elif isinstance(p, (list, tuple)):
            lens.append(len(p))
        else:
            return None
    return lens
