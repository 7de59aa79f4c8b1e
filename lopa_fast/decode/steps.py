"""Shared machinery of the fast vanilla and threshold decoders: the forwards over a static KV cache, the
device-side numerics guard, the one host read per step, the commit rules as tensor ops.

The block loop of vanilla / threshold decoding is host-driven by nature (block boundaries, step counts and
caches are Python constants of the request), so the fast decoders keep the loop in Python and move the
*step* to the device: candidates, token statistics, the commit rule and the counters are tensors, and each
step ends in ONE host read of a small head (the first non-finite row, the first mask, whether the block
is full). The reference decoders (lopa_fast.reference.{vanilla,threshold}) read the state several times per
step (`int(cand.sum())`, `.tolist()` of sorted confidences, `bool(...)` checks).

Forwards (`StepForward`), all over ONE static cache buffer [num_layers, L, Hkv, D] allocated per request:
  full(tokens [B, L], rows)       cache-free forward of the whole sequence (`model.forward_static`, the fused
                                  layer); rows: flat row indices that get the LM head
  refresh(x [L], rows, keep)      the same, and its keys / values of positions [0, keep) become the cache
                                  (Fast-dLLM's refresh: keep = block start for "prefix", L for "dual")
  prefix(win [n], s, rows)        window x[s:s+n] over the cached prefix [0, s) (append mode, nothing stored)
  dual(win [n], s, rows)          window x[s:s+n] whose K/V overwrite cache rows [s, s+n) in place, attending
                                  to the whole cache [0, L) (Fast-dLLM's dual cache: the model's in-place
                                  mode, the plain layer with the cache write inside the layer loop)
Row helpers map aligned positions to raw rows: with Dream's shift (upstream's `cat(l[:1], l[:-1])` over a
window), aligned row i is raw row i - 1, except the window's first row, which keeps its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lopa_fast import ops
from lopa_fast.errors import NonFiniteLogitsError
from lopa_fast.models.transformer import rms_norm
from lopa_fast.sampling import is_on


class StepForward:
    """The forwards of one request of L positions (see the module docstring). model: DecoderLM."""

    def __init__(self, model, L: int, cache: bool):
        from lopa_fast.ops import _backend

        self.model = model
        c = model.config
        dev = model.device
        self.L = L
        shape = (c.num_layers, L if cache else 1, c.num_kv_heads, c.head_dim)
        self.cache_k = torch.zeros(shape, dtype=model.dtype, device=dev)
        self.cache_v = torch.zeros(shape, dtype=model.dtype, device=dev)
        self.backend = _backend.resolve("branch_attention", None, dev)
        self.zero = torch.zeros((), dtype=torch.long, device=dev)
        model.fused_layers()  # the merged-weight view, built or checked once per request

    def _static(self, tokens: torch.Tensor, start: int, prefix: int, rows: torch.Tensor):
        B, n = tokens.shape
        win_lens = torch.full((B,), n, dtype=torch.long, device=tokens.device)
        return self.model.forward_static(tokens, self.zero + start, self.cache_k, self.cache_v, prefix, win_lens,
                                         None, "full", rows, attn_backend=self.backend)  # fmt: skip

    def full(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Cache-free forward of tokens [B, L]; raw logits [R, V] of the flat rows [R]."""
        return self._static(tokens, 0, 0, rows)[0]

    def refresh(self, x: torch.Tensor, rows: torch.Tensor, keep: int) -> torch.Tensor:
        """Cache-free forward of x [L]; K/V of positions [0, keep) become the cache; raw logits [R, V]."""
        logits, k, v = self._static(x[None], 0, 0, rows)
        self.cache_k[:, :keep] = k[:, 0, :keep]
        self.cache_v[:, :keep] = v[:, 0, :keep]
        return logits

    def prefix(self, win: torch.Tensor, s: int, rows: torch.Tensor) -> torch.Tensor:
        """Window win [n] at positions s.. over the cached prefix [0, s); raw logits [R, V]."""
        return self._static(win[None], s, s, rows)[0]

    def dual(self, win: torch.Tensor, s: int, rows: torch.Tensor) -> torch.Tensor:
        """Window win [n] at positions s.., its K/V written over cache rows [s, s + n) in place, attending to the
        whole cache [0, L) (`forward_window`'s in-place mode on the request's buffer); raw logits [R, V]."""
        part = dict(tokens=win[None], start=s, cache_k=self.cache_k, cache_v=self.cache_v, prefix_len=self.L, rows=rows)
        return dual_forwards(self.model, [part])[0]


def dual_forwards(model, parts: list[dict]) -> list[torch.Tensor]:
    """Fast-dLLM's dual-cache step for one or several requests in ONE packed forward of the plain layer.

    parts[r]: tokens [1, n_r] at positions start_r + arange(n_r) (start_r: an int, or a 0-d long tensor in a
    compiled / captured batched step, lopa_fast.decode.compiled_batch: then the rows are written with index_copy_
    and nothing is checked on the host; its part also names the attention backend, attn_backend), cache_k / cache_v
    [num_layers,
    L_r, Hkv, D] (the request's cache: layer by layer, the window's K/V overwrite its rows [start_r, start_r + n_r)
    in place before the window's queries attend to the whole cache [0, prefix_len_r)), rows [R_r] (the raw rows
    that get the LM head). Every op but attention is row-wise over the packed rows, the RoPE table is computed per
    request at its own positions, and attention runs per request in the shapes of its solo step, so a request's
    logits are those of running it alone (StepForward.dual is this with one part). Returns raw logits [R_r, V]."""
    dev = parts[0]["tokens"].device
    ns = [p["tokens"].shape[1] for p in parts]
    offs = [sum(ns[:r]) for r in range(len(ns))]
    tokens = torch.cat([p["tokens"].reshape(-1) for p in parts])[None]  # [1, T]
    static = [torch.is_tensor(p["start"]) for p in parts]
    pos = [p["start"] + torch.arange(n, device=dev) if st else torch.arange(p["start"], p["start"] + n, device=dev)
           for p, n, st in zip(parts, ns, static)]  # fmt: skip
    ropes = [model._rope(q) for q in pos]
    rope = (torch.cat([c for c, _ in ropes]), torch.cat([s_ for _, s_ in ropes]))
    no_window = torch.zeros(1, dtype=torch.long, device=dev)

    def attend(i, q, k, v):
        outs = []
        for p, off, n, st, dst in zip(parts, offs, ns, static, pos):
            sl, s = slice(off, off + n), p["start"]
            ck, cv = p["cache_k"][i], p["cache_v"][i]
            if st:  # a device start: no host int to slice with
                ck.index_copy_(0, dst, k[0, sl])
                cv.index_copy_(0, dst, v[0, sl])
            else:
                ck[s : s + n] = k[0, sl]
                cv[s : s + n] = v[0, sl]
            outs.append(ops.branch_attention(q[:, sl], ck, cv, p["prefix_len"], k[:, sl], v[:, sl], no_window, None,
                                             "full", check=not st, backend=p.get("attn_backend")))  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    h = model._layers(tokens, None, attend, rope=rope)[0]
    h = h.index_select(0, torch.cat([off + p["rows"] for p, off in zip(parts, offs)]))
    h = rms_norm(h, model.final_norm_weight(), model.config.rms_norm_eps)
    logits = F.linear(h, model.head_weight())
    return list(logits.split([p["rows"].shape[0] for p in parts]))


@dataclass(frozen=True)
class DualForward:
    """`dual_forwards` as a `forward_requests` for the batch scheduler (lopa_fast.decode.batch groups a round's
    forwards by (this, mask, backend): equal for every request of one model). Returns (logits, None, None) per
    request: the window's K/V are already in each request's cache."""

    model: Any

    def forward_requests(self, parts: list[dict], mode: str, attn_backend=None, pool=None) -> list[tuple]:
        return [(logits, None, None) for logits in dual_forwards(self.model, parts)]


def raw_rows(lo: int, hi: int, win_start: int, shift: bool, device) -> torch.Tensor:
    """Raw window rows [hi - lo] whose (aligned) logits predict positions [lo, hi) of a window starting at
    win_start: position q reads raw row q - win_start - 1 under Dream's shift (row 0 keeps its own)."""
    r = torch.arange(lo - win_start, hi - win_start, device=device)
    return (r - 1).clamp(min=0) if shift else r


def first_bad_row(logits: torch.Tensor, read: torch.Tensor, temperature) -> torch.Tensor:
    """0-d long: the first row r with read[r] whose logits [n, V] hold NaN / inf (or overflow when divided
    by the temperature, T > 0: a float, or a 0-d tensor knob, `sampling.is_on`), else -1. No host read."""
    x = logits.float()
    ok = torch.isfinite(x).all(-1)
    if is_on(temperature):
        ok = ok & torch.isfinite(x / temperature).all(-1)
    bad = read & ~ok
    idx = torch.arange(bad.numel(), device=bad.device)
    return torch.where(bad.any(), torch.where(bad, idx, bad.numel()).min(), -1)


def refuse(logits_row: torch.Tensor, position: int, step: int, strategy: str, temperature: float):
    """Raise NonFiniteLogitsError for one raw logits row [V] (the value: the first NaN / inf entry, else the
    largest magnitude that the temperature overflows, as the reference's guard reports it)."""
    row = logits_row.float()
    bad = row[~torch.isfinite(row)]
    value = float(bad[0]) if bad.numel() else f"{float(row.abs().max())} / temperature {temperature}"
    raise NonFiniteLogitsError(strategy=strategy, round=step, position=position, value=value)


def first_mask(x: torch.Tensor, mask_id: int) -> torch.Tensor:
    """0-d long: the first position of x [L] holding the mask id, L when none."""
    m = x == mask_id
    return torch.where(m.any(), m.long().argmax(), x.numel())


def rank_desc(key: torch.Tensor) -> torch.Tensor:
    """rank [n] long of each entry in a descending stable sort of key [n] (0 = the largest; exact ties: the
    lower index first)."""
    order = torch.sort(key, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(key.numel(), device=key.device))


def read_head(*fields: torch.Tensor) -> list[int]:
    """The step's one device-to-host read: 0-d integer tensors -> ints."""
    return torch.stack([f.reshape(()).long() for f in fields]).tolist()


def threshold_select(conf: torch.Tensor, ent: torch.Tensor, cand: torch.Tensor, cfg) -> torch.Tensor:
    """bool [n]: the candidates (cand [n]) this step commits, from conf [n] and entropy [n] (no host read).

    Rank 1 (the highest conf, or the lowest entropy; first index on exact ties) is always committed; the rule
    adds the others: threshold: conf >= tau (upstream drops conf < tau, so equality commits; tau compared in
    conf's dtype, as upstream's tensor-vs-float comparison); entropy_threshold: H <= h; factor: the top
    `count` ranks, count = the first 0-based rank b with c(b) < 1 - f/(b+2) (rank 0's threshold is -1), or
    every candidate when there is none or b is the last rank (upstream's edge case), in float64.
    cfg: a GenerateConfig (its three rule knobs; `select_by_rule` takes them as values)."""
    return select_by_rule(conf, ent, cand, cfg.factor, cfg.entropy_threshold, cfg.threshold)


def select_by_rule(conf: torch.Tensor, ent: torch.Tensor, cand: torch.Tensor, factor=None, entropy_threshold=None,
                   threshold=None) -> torch.Tensor:
    """`threshold_select` with the rule knobs as values: floats, or 0-d float64 tensors (a compiled step's runtime
    inputs, lopa_fast.decode.static_steps); the formulas round a tensor exactly as they round a float."""
    any_c = cand.any()
    idx = torch.arange(cand.numel(), device=cand.device)
    if factor is not None:
        c = torch.where(cand, conf, float("-inf"))
        rank = rank_desc(c)
        desc = torch.sort(c, descending=True, stable=True).values.double()
        n = cand.sum()
        # (idx + 2).reciprocal() * f: what `f / tensor` computes for a Python float f (Tensor.__rtruediv__), written
        # out so that a tensor f (a true division otherwise) rounds the same
        th = torch.where(idx == 0, -1.0, 1 - (idx + 2).double().reciprocal() * factor)
        viol = (desc < th) & (idx < n)
        b = torch.where(viol.any(), viol.long().argmax(), n)
        count = torch.where(b < n - 1, b, n)
        return cand & (rank < count)
    if entropy_threshold is not None:
        first = idx == torch.where(cand, ent, float("inf")).argmin()
        keep = cand & ~(ent > entropy_threshold)
    else:
        first = idx == torch.where(cand, conf, float("-inf")).argmax()
        keep = cand & ~(conf < threshold)
    return (keep | (first & cand)) & any_c
