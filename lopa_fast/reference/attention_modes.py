"""The window-attention modes: their names, the integer codes kernels receive, and the window keys' visibility.

A neutral module (torch only): the public op `lopa_fast.ops.branch_attention`, its Triton / CUDA kernels, the
model's forward and the reference ops (`lopa_fast.reference.ops`) all read the modes from here, so the fast path
never imports the reference and the reference never imports the fast path.
"""
from __future__ import annotations

import torch

# window-attention modes of `branch_attention` (the prefix is always fully visible)
ATTENTION_MODES = ("full", "block_causal", "causal")

# The integer codes kernels receive for a mode: its index above. Triton kernels compare with
# these; CUDA (.cu) sources get them as -D defines (`code_defines`), never as literals.
MODE_CODES = {m: i for i, m in enumerate(ATTENTION_MODES)}


def code_defines() -> dict[str, int]:
    """{"LOPA_MODE_FULL": 0, ...}: the codes as C preprocessor defines."""
    return {f"LOPA_MODE_{m.upper()}": c for m, c in MODE_CODES.items()}


def window_key_mask(
    n: int,
    win_lens: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    mode: str,
    batch: int,
    device,
) -> torch.Tensor:
    """Visibility of window keys: bool [B, n_query, n_key] (True = visible).

    Query (b, i) sees window key j iff j < win_lens[b] and
      full:          always
      block_causal:  block_ids[b, j] <= block_ids[b, i]
      causal:        j <= i
    Built from block ids and lengths; the prefix (cache) part is always fully visible.
    """
    j = torch.arange(n, device=device)
    if win_lens is None:
        valid = torch.ones(batch, n, dtype=torch.bool, device=device)
    else:
        valid = j[None, :] < win_lens.to(device).reshape(batch, 1)
    vis = valid[:, None, :].expand(batch, n, n)
    if mode == "causal":
        vis = vis & (j[None, :, None] >= j[None, None, :])
    elif mode == "block_causal":
        vis = vis & (block_ids[:, None, :] <= block_ids[:, :, None])
    return vis
