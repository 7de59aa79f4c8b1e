"""One static KV pool for the requests of a batch (lopa_fast.decode.batch): every request's committed prefix in a
slot of the same two tensors, so one pooled attention call per layer can read every request's keys.

Layout: k, v [num_layers, S, Lp, Hkv, D] (one layer's pool `k[i]` is the contiguous [S, Lp, Hkv, D] that
`ops.branch_attention(..., cache_index=...)` takes). A request with buffer length Lb (its round's static cache is
[num_layers, Lb + 1, Hkv, D], row Lb its trash row: lopa_fast.strategies.lopa.round) gets slot s at admission and
decodes on the views `k[:, s, :Lb + 1]` / `v[:, s, :Lb + 1]`: each layer's part of a view is contiguous and has the
strides of a request's own cache, so the per-request torch attention (CPU) sums exactly as the solo round does, and its
commits (index_copy_ / narrow().copy_, in place) land in the pool. A finished request's slot goes back to the free list.

The pool grows on demand (more slots, longer slots) up to its caps: a new pool, the old one copied into its
corner, the live requests re-pointed at their slots of it (`ensure` returns True; the caller re-points). The
size doubles each time, so a batch sees at most about log2(S) + log2(Lp / 64) growths, and none once the pool has
reached its working size: a static pool in the steady state, with no size to guess up front. Slot and length
caps (Scheduler's `max_slots`, `slot_len`: the server's --max-num-seqs and --max-model-len) bound its memory, and
a doubling that would hold more than the live requests' own slots (`max_bytes`: what their memory estimates
reserve) grows to the exact need instead.
"""
from __future__ import annotations

import torch

# slot lengths grow in LENGTH_QUANTUM steps (request buffers are multiples of it)
from lopa_fast.decode.shapes import quantized_length


class KVPool:
    """Slots of committed K/V for the requests of one scheduler (module docstring).

    model: DecoderLM (layers, kv heads, head dim, dtype and device); the pool starts empty (no memory) and
    `ensure` sizes it. Attributes: k, v [num_layers, S, Lp, Hkv, D] (None before the first `ensure`)."""

    def __init__(self, model):
        c = model.config
        self.layers, self.hkv, self.d = c.num_layers, c.num_kv_heads, c.head_dim
        self.dtype, self.device = model.dtype, model.device
        self.k = self.v = None
        self.free: list[int] = []  # free slots, lowest first
        self.used: set[int] = set()
        self.growths = 0

    @property
    def slots(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def slot_len(self) -> int:
        """Positions per slot (a request of buffer length Lb needs Lb + 1: its trash row)."""
        return 0 if self.k is None else self.k.shape[2]

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one cache position of one slot (K and V, every layer)."""
        return 2 * self.layers * self.hkv * self.d * torch.empty((), dtype=self.dtype).element_size()

    def ensure(self, rows: int, slots: int, max_len: int | None = None, max_slots: int | None = None,
               max_bytes: int | None = None) -> bool:
        """Make room for a slot of `rows` positions with `slots` slots in use at once (grow if needed: each dimension
        at least doubles, lengths in steps of 64, never past max_len / max_slots, which the caller's caps keep >= the
        request; and, when the doubled pool would exceed `max_bytes`, only to the exact need: `slots` slots of
        max(slot_len, rows rounded up to 64) positions). Returns True when the tensors were replaced (live views are
        stale: re-point them with `views`)."""
        S, L = self.slots, self.slot_len
        if rows <= L and slots <= S:
            return False
        S2 = S if slots <= S else max(slots, 2 * S)
        L2 = L if rows <= L else max(quantized_length(rows), 2 * L)
        S2 = S2 if max_slots is None else max(slots, min(S2, max_slots))
        L2 = L2 if max_len is None else max(rows, min(L2, max_len))
        if max_bytes is not None and S2 * L2 * self.row_bytes > max_bytes:  # no doubling past what is reserved
            S2, L2 = max(S, slots), max(L, quantized_length(rows))
        shape = (self.layers, S2, L2, self.hkv, self.d)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None:  # the live slots' rows (and the free ones': cheap, and keeps the code one copy)
            k[:, :S, :L].copy_(self.k)
            v[:, :S, :L].copy_(self.v)
        self.free = sorted(set(self.free) | set(range(S, S2)))
        replaced = self.k is not None
        self.k, self.v = k, v
        self.growths += replaced
        return replaced

    def acquire(self, rows: int) -> int:
        """A free slot (the lowest) for a request of `rows` positions (<= slot_len; call `ensure` first), its rows
        zeroed (the request starts from a zero cache, as a solo one does)."""
        if not self.free or rows > self.slot_len:
            raise RuntimeError(f"KVPool.acquire: no slot of {rows} rows (free {len(self.free)}, slot_len "
                               f"{self.slot_len}); call ensure() first")
        s = self.free.pop(0)
        self.used.add(s)
        self.k[:, s, :rows].zero_()
        self.v[:, s, :rows].zero_()
        return s

    def release(self, slot: int) -> None:
        """Hand a finished request's slot back (its rows are zeroed when the slot is next acquired)."""
        if slot not in self.used:
            raise RuntimeError(f"KVPool.release: slot {slot} is not in use")
        self.used.remove(slot)
        self.free.append(slot)
        self.free.sort()

    def views(self, slot: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's cache views k, v [num_layers, rows, Hkv, D] of slot `slot` (writes land in the pool)."""
        return self.k[:, slot, :rows], self.v[:, slot, :rows]


def request_cache(model, rows: int, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's static cache (k, v) [num_layers, rows, Hkv, D] in the model's dtype: `cache` (its KV pool slot
    views, zeroed), checked, or zeros of its own when None."""
    c = model.config
    shape = (c.num_layers, rows, c.num_kv_heads, c.head_dim)
    if cache is None:
        return tuple(torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(2))
    if any(tuple(t.shape) != shape or t.dtype != model.dtype for t in cache):
        raise ValueError(f"request cache: views must be {shape} {model.dtype}, got "
                         f"{[(tuple(t.shape), t.dtype) for t in cache]}")
    return tuple(cache)
