"""Static, preallocated KV cache shared by every branch of a request.

Layout (the op contracts of `lopa_fast.ops.branch_attention` build on it):

    k, v      [num_layers, max_len, Hkv, D]   committed prefix; rows [0, length) are valid
    win_k/v   [num_layers, max_batch, max_window, Hkv, D]  scratch: the K/V of the last window forward

Keys are cached **after RoPE**. Positions are absolute and contiguous (the window always starts at the
cache end, or overwrites positions in place for Fast-dLLM's dual cache), so rotating once before the
cache is exactly equivalent to Fast-dLLM's "cache pre-RoPE keys and re-rotate every call", and saves
the re-rotation of L keys per layer per step.

The cache is allocated once per request. Branches never copy it: a batched window forward reads the
shared prefix and keeps its own K/V in the scratch buffer; `commit_window(branch, u)` copies the first
`u` window positions of one branch (the LoPA winner) into the prefix. `branch` may be a 0-d device
tensor so the winner never travels to the host.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_len <= 0:
            raise ValueError(f"KVCache: max_len={max_len} must be > 0")
        self.num_layers, self.max_len = num_layers, max_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.length = 0
        self.win_k = torch.empty((num_layers, 0, 0, num_kv_heads, head_dim), dtype=dtype, device=self.device)
        self.win_v = torch.empty_like(self.win_k)
        self.win_batch = 0
        self.win_len = 0

    # ---- window scratch -------------------------------------------------------------------------
    def reserve_window(self, batch: int, n: int) -> None:
        """Make the scratch hold at least [batch, n] window positions (grows geometrically, rarely)."""
        _, cb, cn, _, _ = self.win_k.shape
        if batch > cb or n > cn:
            nb, nn = max(batch, cb), max(n, cn, 2 * cn if n > cn else cn)
            shape = (self.num_layers, nb, nn, self.num_kv_heads, self.head_dim)
            self.win_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.win_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.win_batch, self.win_len = batch, n

    def window_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [B, n, Hkv, D] of the current window's K/V for one layer."""
        return (
            self.win_k[layer, : self.win_batch, : self.win_len],
            self.win_v[layer, : self.win_batch, : self.win_len],
        )

    # ---- commits --------------------------------------------------------------------------------
    def commit_window(self, branch, u: int) -> None:
        """Append the first `u` positions of window `branch` to the committed prefix.

        branch: int or 0-d LongTensor (device-resident winner index; no host sync).
        """
        if u <= 0:
            return
        if u > self.win_len:
            raise ValueError(f"commit_window: u={u} exceeds the window length {self.win_len}")
        if self.length + u > self.max_len:
            raise ValueError(f"commit_window: cache overflow ({self.length}+{u} > max_len={self.max_len})")
        if isinstance(branch, torch.Tensor):
            idx = branch.reshape(1).to(self.device, torch.long)
            k_span = self.win_k[:, : self.win_batch].index_select(1, idx)[:, 0, :u]
            v_span = self.win_v[:, : self.win_batch].index_select(1, idx)[:, 0, :u]
        else:
            if not 0 <= branch < self.win_batch:
                raise ValueError(f"commit_window: branch={branch} not in [0, {self.win_batch})")
            k_span, v_span = self.win_k[:, branch, :u], self.win_v[:, branch, :u]
        self.k[:, self.length : self.length + u] = k_span
        self.v[:, self.length : self.length + u] = v_span
        self.length += u

    def window_span(self, branch: int, u: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies [num_layers, u, Hkv, D] of a branch's first u window K/V (for per-branch reference code)."""
        return self.win_k[:, branch, :u].clone(), self.win_v[:, branch, :u].clone()

    def append(self, k_span: torch.Tensor, v_span: torch.Tensor) -> None:
        """Append spans [num_layers, u, Hkv, D] (from `window_span`) to the committed prefix."""
        u = k_span.shape[1]
        if self.length + u > self.max_len:
            raise ValueError(f"append: cache overflow ({self.length}+{u} > max_len={self.max_len})")
        self.k[:, self.length : self.length + u] = k_span
        self.v[:, self.length : self.length + u] = v_span
        self.length += u

    def truncate(self, length: int) -> None:
        """Drop committed positions >= length (Fast-dLLM prefix cache refresh, APD crop)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate: length={length} not in [0, {self.length}]")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.win_k, self.win_v))
