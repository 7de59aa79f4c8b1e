"""The fast path's forwards of `DecoderLM` (a mixin: the fused layer stack and the static / batched forwards
built on it), beside transformer.py's plain layer (`forward_window`, the reference decoders').

* `forward_static`: one request's window (B branch rows) over a static KV cache; shapes depend only on the bucket
  (capturable / compilable: no host read, no input check).
* `forward_requests`: several requests' windows packed in one row batch (lopa_fast.decode.batch), each request
  attending over its own cache (or, pooled, over the KV pool in one launch per layer).
* `forward_dual`: Fast-dLLM's dual-cache step for one or several requests (each window's K/V written into its
  cache in place, then attention over the whole cache).
* `_fused_stack`: the fused decoder layers all three run (q/k/v and gate/up as one GEMM each over merged weights).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from lopa_fast import ops
from lopa_fast.reference.attention_modes import window_key_mask
from lopa_fast.ops import _backend as ops_backend
from lopa_fast.ops.branch_attention import branch_attention_sdpa, sdpa_mask, window_in_cache_sdpa
from lopa_fast.ops.rms_norm import cpp_norms, torch_rms_norm
from lopa_fast.ops.rope import rope_cpp_heads, rope_heads, rope_rotation


class FusedForwards:
    """The fused forwards of a `DecoderLM` (mixed into it: they read its config, weights, `fused_layers` and
    `rope_tables`)."""

    def forward_static(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor | int,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        cache_len: torch.Tensor | int,
        win_lens: torch.Tensor,
        block_ids: torch.Tensor | None,
        mask: str,
        rows: torch.Tensor,
        attn_backend: str | None = None,
        output: str = "logits",
        dense: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A window forward whose shapes depend only on the bucket, never on a per-round value.

        tokens [B, n] at positions start + arange(n) (start: 0-d long tensor, or an int); the committed prefix is
        cache_k/v [num_layers, Lc, Hkv, D] rows [0, cache_len) (cache_len: 0-d long tensor, or an int when
        the caller knows it on the host; rows [0, cache_len) are never written here: only one dense row over a
        host-int prefix writes its window into rows [cache_len, cache_len + n), `in_cache` below); win_lens [B] valid
        window lengths; block_ids [B, n] for block_causal; rows [R] flat row indices that get the LM head.
        No host read, no input check (callers validate once per request), so the call can be captured as a
        CUDA graph or compiled with fullgraph=True.
        The fused layer (the fast path's, while `forward_window` keeps the plain readable one): q/k/v and
        gate/up as one GEMM each over merged weights (`fused_layers`), RoPE on q and k in one pass, the
        rms_norm / rope / silu_mul ops (Triton on CUDA; on CPU their torch backends, bitwise the plain
        layer's formulas), and attention masks built once per forward instead of once per layer.
        output: "logits" (the raw logits [R, V]) or "hidden" (the final-normed rows [R, H], for a caller that
        applies the head itself: the fused `ops.head_confidence`, which never materialises [R, V]).
        dense: the caller knows every row's window spans all n columns (win_lens all n): under mask "full" with a
        host-int cache_len the torch attention then runs without a key mask, under "block_causal" its mask is the
        block rule alone (`_torch_keys`).
        Returns (raw logits [R, V] (or the hidden rows), window keys and values [num_layers, B, n, Hkv, D],
        post-RoPE).
        """
        cfg = self.config
        B, n = tokens.shape
        dev = tokens.device
        b = attn_backend or ops_backend.resolve("branch_attention", None, dev)
        h = F.embedding(tokens, self.embed_weight())
        lops = _layer_ops(_layer_backend(b, dev), cfg.rms_norm_eps, h.dtype, dev, self.rope_in_fp32)
        positions = None
        if isinstance(start, int):  # an eager round: slices of the model's table
            cos, sin = self.rope_window(start, n, dev)
        else:  # a device start (compiled / captured): no host read; the tables when the layer loop needs them
            cos = sin = None  # (`_fused_stack`: the Triton norm_linear forms them inside its kernel)
            positions = start + torch.arange(n, device=dev)
        if b == "torch":  # masks once per forward (the torch attention takes them precomputed)
            keys = _torch_keys(n, win_lens, block_ids, mask, B, cache_len, cache_k.shape[1], dev, dense)
        # one dense row over a host-int prefix (an eager D2F / LoPA k = 1 round): each layer's window K/V are written
        # into the cache rows after the prefix, [cache_len, cache_len + n) (the C++ RoPE writes k there directly), and
        # attention reads the cache's first cache_len + n rows (the same keys as the concatenation, bitwise, without
        # copying the prefix every layer); the returned K/V are views of those rows, so the commit of the first u of
        # them has nothing left to copy. Rows past the committed ones are never read (the next prefix length slices
        # them off) and are overwritten next round.
        end = cache_len + n if isinstance(cache_len, int) else None
        in_cache = b == "torch" and dense and B == 1 and end is not None and end < cache_k.shape[1]
        if in_cache:  # per forward, the views each layer reads (a select a layer instead of ~5 view ops)
            kv_into = (cache_k[:, cache_len:end], cache_v[:, cache_len:end])  # [layers, n, Hkv, D]
            seen_k, seen_v = (c[:, :end].unsqueeze(1).transpose(2, 3) for c in (cache_k, cache_v))  # [L, 1, Hkv, e, D]

            def attend(i, q, k, v):
                return window_in_cache_sdpa(q, seen_k[i], seen_v[i], keys)
        else:
            kv_into = None

            def attend(i, q, k, v):
                if b == "torch":
                    return branch_attention_sdpa(q, cache_k[i], cache_v[i], cache_len, k, v, keys)
                return ops.branch_attention(q, cache_k[i], cache_v[i], cache_len, k, v, win_lens, block_ids, mask,
                                            check=False, backend=b)

        h, ks, vs = self._fused_stack(h, cos, sin, lops, attend, kv_into, positions)
        if in_cache:
            ks, vs = kv_into[0].unsqueeze(1), kv_into[1].unsqueeze(1)
        h = lops.norm(h.reshape(B * n, -1).index_select(0, rows), self.final_norm_weight())
        return (h if output == "hidden" else F.linear(h, self.head_weight())), ks, vs

    def forward_dual(self, parts: list[dict]) -> list[torch.Tensor]:
        """Fast-dLLM's dual-cache step for one or several requests in ONE packed forward of the fused layer stack
        (`_fused_stack`, as forward_static / forward_requests: merged q/k/v and gate/up GEMMs, the CPU's C++ norms and
        RoPE, the Triton layer kernels on a GPU).

        parts[r]: tokens [1, n_r] at positions start_r + arange(n_r) (start_r: an int, or a 0-d long tensor in a
        compiled / captured step: then the rows are written with index_copy_ and nothing is checked on the host),
        cache_k / cache_v [num_layers, L_r, Hkv, D] (the request's cache: layer by layer, the window's K/V
        overwrite its rows [start_r, start_r + n_r) in place before the window's queries attend to the whole cache
        [0, prefix_len_r)), prefix_len (an int), rows [R_r] (the raw rows that get the LM head), attn_backend
        (optional: the attention backend), output (optional: "logits", the default, or "hidden": the final-normed
        rows [R_r, H], for the fused head). Every op but attention is row-wise over the packed rows, the RoPE table
        is computed per request at its own positions, and attention runs per request in the shapes of its solo
        step, so a request's result is that of running it alone. Returns raw logits [R_r, V] (or hidden rows) per
        request."""
        cfg = self.config
        dev = parts[0]["tokens"].device
        ns = [p["tokens"].shape[1] for p in parts]
        offs = [sum(ns[:r]) for r in range(len(ns))]
        tokens = torch.cat([p["tokens"].reshape(-1) for p in parts])[None]  # [1, T]
        static = [torch.is_tensor(p["start"]) for p in parts]
        pos = [p["start"] + torch.arange(n, device=dev) if st else torch.arange(p["start"], p["start"] + n, device=dev)
               for p, n, st in zip(parts, ns, static)]
        b = parts[0].get("attn_backend") or ops_backend.resolve("branch_attention", None, dev)
        h = F.embedding(tokens, self.embed_weight())
        lops = _layer_ops(_layer_backend(b, dev), cfg.rms_norm_eps, h.dtype, dev, self.rope_in_fp32)
        cos = sin = positions = None
        if lops.norm_linear is not None and all(static):  # the Triton layer forms the tables from the positions
            positions = torch.cat(pos)
        else:  # per request at its own positions (an int start: slices of the model's table, as forward_static)
            ropes = [self.rope_window(p["start"], n, dev) if not st else self.rope_tables(q)
                     for p, n, st, q in zip(parts, ns, static, pos)]
            cos, sin = torch.cat([c for c, _ in ropes]), torch.cat([s_ for _, s_ in ropes])  # [T, D]
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
                P = p["prefix_len"]
                if b == "torch" and isinstance(P, int):  # every key valid (the window sits in the cache): one SDPA
                    # call over the cache's first P rows, no mask (the split formula's ~20 ops a layer: 2x the step)
                    seen_k, seen_v = (c[None, :P].transpose(1, 2) for c in (ck, cv))  # [1, Hkv, P, D]
                    outs.append(window_in_cache_sdpa(q[:, sl], seen_k, seen_v, None))
                else:
                    outs.append(ops.branch_attention(q[:, sl], ck, cv, P, k[:, sl], v[:, sl], no_window, None, "full",
                                                     check=False, backend=b))
            return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

        h = self._fused_stack(h, cos, sin, lops, attend, positions=positions, keep_kv=False)[0]
        h = h[0].index_select(0, torch.cat([off + p["rows"] for p, off in zip(parts, offs)]))
        return self._head_rows(lops.norm(h, self.final_norm_weight()), parts)

    def _head_rows(self, hs: torch.Tensor, parts: list[dict]) -> list[torch.Tensor]:
        """Per part, its final-normed LM-head rows of hs [sum R_r, H] (packed in the parts' order): raw logits
        [R_r, V], or the rows themselves for a part with output="hidden" (the fused head's); the logits parts' rows
        go through ONE head GEMM (all of hs when no part asks for hidden rows)."""
        hidden = [p.get("output", "logits") == "hidden" for p in parts]
        rows = hs.split([p["rows"].shape[0] for p in parts])
        want = [r for r, hid in zip(rows, hidden) if not hid]
        if want:
            logits = F.linear(hs if len(want) == len(rows) else torch.cat(want), self.head_weight())
            logits = iter(logits.split([r.shape[0] for r in want]))
        return [r if hid else next(logits) for r, hid in zip(rows, hidden)]

    def _fused_stack(self, h: torch.Tensor, cos, sin, lops: "LayerOps", attend, kv_into: tuple | None = None,
                     positions: torch.Tensor | None = None, keep_kv: bool = True) -> tuple:
        """Every fused decoder layer over h [B, n, H] (forward_static, forward_requests): the pre-norm, ONE q/k/v
        GEMM over the merged weights, RoPE on q and k (cos / sin [n, D] or [B, n, D]), attend(layer, q [B, n, Hq, D],
        k, v [B, n, Hkv, D]) -> o [B, n, Hq, D] (where the callers differ), the o-projection, the MLP pre-norm, ONE
        gate/up GEMM, SwiGLU, down; lops: the layer ops chosen once per forward (`_layer_ops`). On the Triton layer ops
        (up to NORM_LINEAR_MAX_ROWS rows, no kv_into) the same layer in 5 kernels: `_norm_linear_stack`.
        kv_into: None, or (k, v) [num_layers, n, Hkv, D] (B = 1): each layer's post-RoPE k and its v are written there
        (forward_static's in-cache round) instead of being collected. positions (int [n] or [B, n], with cos = sin =
        None): the window's positions, from which the tables are formed (`rope_tables`), or, on the norm_linear
        path, formed by its kernel (6 graph nodes a captured round less). keep_kv=False: the caller has the K/V
        already (forward_dual's attend writes them into the caches): nothing stacked, None and None returned.
        Returns (h [B, n, H], keys, values [num_layers, B, n, Hkv, D], post-RoPE; None and None with kv_into)."""
        cfg = self.config
        B, n = h.shape[:2]
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # the view built (or checked) by the caller at the request start; per call, only layer 0's pointer is
        # re-checked (weights are replaced all together, e.g. by .to()), and nothing under torch.compile
        layers = getattr(self, "_fused", None)
        if not torch.compiler.is_compiling() and (
            layers is None or layers[0].qkv_w.data_ptr() != self._fused_q0[0].weight.data_ptr()
        ):
            layers = self.fused_layers()
        if lops.norm_linear is not None and kv_into is None and B * n <= NORM_LINEAR_MAX_ROWS:
            rope = dict(cos=cos, sin=sin) if cos is not None else \
                dict(positions=positions, inv_freq=self.rope_inv_freq(h.device))
            return self._norm_linear_stack(h, rope, lops, attend, layers, keep_kv)
        if cos is None:
            cos, sin = (t.reshape(*positions.shape, -1) for t in self.rope_tables(positions.reshape(-1)))
        table = lops.rope_table(cos, sin)
        k_into, v_into = kv_into if kv_into is not None else (None, None)
        ks, vs = [], []
        norm, add_norm, silu_mul, rope = lops.norm, lops.add_norm, lops.silu_mul, lops.rope
        last = len(layers) - 1
        # the residual adds ride in the next pre-norm (`ops.add_rms_norm`: one kernel instead of two on a GPU, 2 graph
        # nodes a layer; on the torch backend the same add and norm, so the CPU path keeps its bits)
        x = norm(h, layers[0].attn_norm)
        for i, w in enumerate(layers):
            qkv = F.linear(x, w.qkv_w, w.qkv_b).view(B, n, Hq + 2 * Hkv, D)
            q, k = rope(qkv, table, Hq, Hkv, None if k_into is None else k_into[i])
            v = qkv[:, :, Hq + Hkv :]
            if v_into is not None:
                v_into[i].copy_(v[0])
            elif keep_kv:
                ks.append(k)
                vs.append(v)
            attn = attend(i, q, k, v)
            # o + h is h + o bit for bit (IEEE addition commutes)
            # F.linear on the layer's tensors: the nn.Module call costs ~4 us more a projection on CPU
            o = F.linear(attn.reshape(B, n, Hq * D), w.o_w, w.o_b)
            x, h = add_norm(o, h, w.mlp_norm)
            down = F.linear(silu_mul(*F.linear(x, w.gate_up_w).chunk(2, dim=-1)), w.down_w, w.down_b)
            if i < last:
                x, h = add_norm(down, h, layers[i + 1].attn_norm)
            else:  # the final norm is the caller's, on the LM-head rows only
                h = h + down
        return (h, torch.stack(ks), torch.stack(vs)) if ks else (h, None, None)

    def _norm_linear_stack(self, h: torch.Tensor, rope: dict, lops: "LayerOps", attend, layers,
                           keep_kv: bool = True) -> tuple:
        """`_fused_stack` on the Triton layer ops at up to NORM_LINEAR_MAX_ROWS rows: 5 kernels and attention a layer
        (was 8 and attention). The residual add and the pre-norm ride in the q/k/v GEMM's prologue with RoPE as its
        epilogue, the add and the MLP pre-norm in the gate/up GEMM's prologue with SwiGLU as its epilogue
        (`ops.norm_linear`); the o and down projections stay cuBLAS. h [B, n, H]; rope: norm_linear's RoPE arguments
        (dict(cos=, sin=) tables, or dict(positions=, inv_freq=)); returns as `_fused_stack` (q, k, v are column views
        of the one [B, n, Hq + 2 Hkv, D] projection: the attention reads them by stride, the stacks copy k and v)."""
        cfg = self.config
        B, n = h.shape[:2]
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nl = lops.norm_linear
        ks, vs = [], []
        down = None  # the previous layer's down projection: added to h in this layer's q/k/v prologue
        for i, w in enumerate(layers):
            qkv, s = nl(h if down is None else down, w.qkv_w, "rope", w.attn_norm, None if down is None else h,
                        w.qkv_b, rope, Hq + Hkv)
            h = h if s is None else s
            qkv = qkv.view(B, n, Hq + 2 * Hkv, D)
            q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hkv], qkv[:, :, Hq + Hkv :]
            if keep_kv:
                ks.append(k)
                vs.append(v)
            o = F.linear(attend(i, q, k, v).reshape(B, n, Hq * D), w.o_w, w.o_b)
            act, h = nl(o, w.gate_up_w, "swiglu", w.mlp_norm, h)
            down = F.linear(act, w.down_w, w.down_b)
        return (h + down, torch.stack(ks), torch.stack(vs)) if ks else (h + down, None, None)

    def forward_requests(self, parts: list[dict], mode: str, attn_backend: str | None = None,
                         pool: tuple | None = None) -> list[tuple]:
        """`forward_static` for several requests in ONE batched forward (lopa_fast.decode.batch): every
        request's window rows are packed into one row batch, so each layer's projections, norms and MLP run once
        for all requests and over real rows only (no padding to the widest window), and RoPE tables are computed
        per request at its own positions. Attention takes one of two paths:

        * per request (the torch backend, i.e. CPU; and any call without a pool): over its own prefix cache and its
          own window, in the same shapes as when it runs alone, so its sums are bitwise the solo ones (the CPU
          batch is token-, forward- and stats-exact with solo runs: tests/test_batch.py). B launches per layer.
        * pooled (triton / cuda with `pool`): ONE `ops.branch_attention(..., cache_index=...)` per layer for every
          request's windows over the KV pool (lopa_fast.decode.kv_pool): one launch per layer instead of B (a GPU
          round of small windows is launch-bound). Windows are padded to the widest Nb for this call only
          (win_lens masks the padding keys; padding queries are dropped). Each row's prefix is split as in a
          B = 1 call (the kernels' pooled contract), so a request's result does not depend on its neighbours; it
          equals the per-request path up to float summation order in the window part (logits within the kernels'
          tolerance, tokens equal on the parity grid: tests/test_kv_pool.py).

        parts[r]: dict(tokens [NB_r, Nb_r], start (int or 0-d long tensor, the window start), cache_k / cache_v
        [num_layers, Lc_r, Hkv, D], prefix_len (committed rows: an int, or a 0-d long tensor in a compiled /
        captured batched step, lopa_fast.decode.compiled_batch: no host read), win_lens [NB_r], bids [NB_r, Nb_r] or
        None, rows [Rb_r] (flat rows slot * Nb_r + column that get the LM head), and with a pool: slot (int, the
        request's pool slot; its cache_k / cache_v are views of it)). pool: None or (k, v) [num_layers, S, Lp, Hkv,
        D]. Every op outside attention is row-wise, so neighbours never enter a request's sums.
        A part may carry dense=True (`forward_static`'s: no key mask on the torch attention) and output="hidden"
        (default "logits"): its rows come back final-normed [Rb_r, H], without the
        head (the fused head path of lopa_fast.strategies.lopa.round); the other parts' rows still share ONE head GEMM.
        Returns per request (raw logits [Rb_r, V] (or hidden rows), window keys and values [num_layers, NB_r, Nb_r,
        Hkv, D]). One request without a pool (a solo round, a group of one) is its `forward_static` call."""
        if len(parts) == 1 and pool is None:  # one request: its solo forward (the same shapes and sums, without
            p = parts[0]  # packing: a solo request's eager round was ~8 % slower through the packed path on CPU)
            return [self.forward_static(p["tokens"], p["start"], p["cache_k"], p["cache_v"], p["prefix_len"],
                                        p["win_lens"], p["bids"], mode, p["rows"], attn_backend=attn_backend,
                                        output=p.get("output", "logits"), dense=p.get("dense", False))]
        cfg = self.config
        Hq, D = cfg.num_heads, cfg.head_dim
        dev = parts[0]["tokens"].device
        b = attn_backend or ops_backend.resolve("branch_attention", None, dev)
        shapes = [tuple(p["tokens"].shape) for p in parts]  # (NB_r, Nb_r)
        offs, o = [], 0
        for NBr, Nbr in shapes:
            offs.append(o)
            o += NBr * Nbr
        # o packed rows: request r's rows [offs[r], offs[r] + NB_r * Nb_r), slot-major as its flat rows
        tokens = torch.cat([p["tokens"].reshape(-1) for p in parts])[None]  # [1, T]
        h = F.embedding(tokens, self.embed_weight())  # [1, T, H]
        lops = _layer_ops(_layer_backend(b, dev), cfg.rms_norm_eps, h.dtype, dev, self.rope_in_fp32)
        cos = sin = positions = None
        if lops.norm_linear is not None and all(not isinstance(p["start"], int) for p in parts):
            # a compiled / captured batched step on the Triton layer ops: every row's position (the kernel forms
            # its tables: `_fused_stack`)
            positions = torch.cat([(p["start"] + torch.arange(Nbr, device=dev)).repeat(NBr)
                                   for p, (NBr, Nbr) in zip(parts, shapes)])[None]  # [1, T]
        else:  # RoPE tables per request at its own positions and window length (the solo call's values), per row
            cos_rows, sin_rows = [], []
            for p, (NBr, Nbr) in zip(parts, shapes):
                st0 = p["start"]
                c, s_ = (self.rope_window(st0, Nbr, dev) if isinstance(st0, int)
                         else self.rope_tables(st0 + torch.arange(Nbr, device=dev)))
                cos_rows.append(c.repeat(NBr, 1))
                sin_rows.append(s_.repeat(NBr, 1))
            cos, sin = torch.cat(cos_rows)[None], torch.cat(sin_rows)[None]  # [1, T, D]
        if pool is not None and b != "torch":
            attend = _pooled_attend(parts, shapes, mode, b, pool, Hq, D, dev)
        else:
            # a prefix length given as a 0-d device tensor (a compiled / captured batched step) masks the static
            # buffer's rows past it, as forward_static does; a host int slices exactly the committed rows
            masks = [_torch_keys(Nbr, p["win_lens"], p["bids"], mode, NBr, p["prefix_len"], p["cache_k"].shape[1], dev,
                                 p.get("dense", False)) if b == "torch" else None
                     for p, (NBr, Nbr) in zip(parts, shapes)]

            def attend(i, q, k, v):  # per request, over its own keys, in the shapes of its solo round
                outs = []
                for p, off, (NBr, Nbr), keys in zip(parts, offs, shapes, masks):
                    sl = slice(off, off + NBr * Nbr)
                    qr = q[0, sl].reshape(NBr, Nbr, Hq, D)
                    kr, vr = (t[0, sl].reshape(NBr, Nbr, t.shape[2], D) for t in (k, v))
                    if b == "torch":
                        a = branch_attention_sdpa(qr, p["cache_k"][i], p["cache_v"][i], p["prefix_len"], kr, vr, keys)
                    else:
                        a = ops.branch_attention(qr, p["cache_k"][i], p["cache_v"][i], p["prefix_len"], kr, vr,
                                                 p["win_lens"], p["bids"], mode, check=False, backend=b)
                    outs.append(a.reshape(NBr * Nbr, Hq, D))
                return torch.cat(outs)[None]

        h, K, V = self._fused_stack(h, cos, sin, lops, attend, None, positions)  # K, V: [layers, 1, T, Hkv, D]
        # the LM-head rows of every request: its flat rows, offset to its packed block
        hs = h[0].index_select(0, torch.cat([off + p["rows"] for p, off in zip(parts, offs)]))
        heads = self._head_rows(lops.norm(hs, self.final_norm_weight()), parts)
        out = []
        for head, off, (NBr, Nbr) in zip(heads, offs, shapes):
            kv = [t[:, 0, off : off + NBr * Nbr].reshape(t.shape[0], NBr, Nbr, t.shape[3], D) for t in (K, V)]
            out.append((head, kv[0], kv[1]))
        return out


def _layer_backend(b: str, dev) -> str:
    """The layer ops' backend beside attention backend b: b itself for torch / triton, else the norms' auto choice
    ("torch" for the CPU forms: `_layer_ops` picks the C++ norms itself)."""
    if b in ("torch", "triton"):
        return b
    lb = ops_backend.resolve("rms_norm", None, dev)
    return "torch" if lb == "cpp" else lb


class LayerOps(NamedTuple):
    """The layer loop's small ops on one backend, chosen once per forward (`_layer_ops`)."""

    norm: Callable  # (x, w) -> rms_norm(x) * w
    add_norm: Callable  # (x, residual, w) -> (rms_norm(x + residual) * w, x + residual)
    silu_mul: Callable  # (gate, up) -> silu(gate) * up
    rope_table: Callable  # (cos, sin) -> the per-forward table `rope` reads
    # (qkv [B, n, Hq + 2 Hkv, D], table, Hq, Hkv, k_into) -> (q [B, n, Hq, D] contiguous, k [B, n, Hkv, D]); k_into:
    # None, or the [n, Hkv, D] rows (B = 1) that receive k (then returned as k)
    rope: Callable
    # Triton only (else None): (x, weight, epilogue, norm_weight, residual, bias=None, rope=None, rot_heads=0) ->
    # `ops.norm_linear`'s (out, s) with the model's eps and RoPE precision (`_norm_linear_stack`); rope: dict(cos=,
    # sin=) or dict(positions=, inv_freq=)
    norm_linear: Callable | None = None


def _layer_ops(lb: str, eps: float, dtype: torch.dtype, dev, fp32: bool) -> LayerOps:
    """The layer loop's ops on backend lb (fp32: the model rotates in float32, LLaDA), chosen once per forward: the
    public ops (`ops.rms_norm`, `ops.add_rms_norm`, `ops.silu_mul`, `ops.norm_linear`, `ops.rope`) with their
    backend, or on "torch" their CPU forms called directly (the wrappers' dispatch costs ~2 us a call, ~25 calls a
    tiny CPU forward): float32 and eager with lopa_fast._C built, the C++ norms (one call each instead of 7-8 ops:
    ~17 -> ~5 us; within ~2 ulp of the formula, `rms_norm_cpp`) and the C++ rope (bitwise), else the torch formulas
    (bitwise; the rope as `rope_heads`, q and k rotated together from a table built once per forward: 7 ops a layer
    instead of 14)."""
    if torch.compiler.is_compiling():  # the torch formulas (the C++ kernels take raw pointers: not traceable); a
        return _make_layer_ops(lb, eps, dtype, fp32, False)  # graph is traced once: no memo for dynamo to guard on
    # memoised by everything the choice depends on: the arguments and $LOPA_FAST_BACKEND (which `resolve` reads; the
    # rest of its inputs are fixed in a process): the same functions every forward, and no backend resolution (fresh
    # closures and a resolve cost a tiny CPU forward ~20 us between its torch calls)
    key = (lb, eps, dtype, dev, fp32, ops_backend.env_value(ops_backend.ENV))
    made = _LAYER_OPS.get(key)
    if made is None:
        cpp = lb == "torch" and dtype == torch.float32 and ops_backend.resolve("rms_norm", None, dev) == "cpp"
        made = _LAYER_OPS[key] = _make_layer_ops(lb, eps, dtype, fp32, cpp)
    return made


_LAYER_OPS: dict = {}  # `_layer_ops`' choices by (backend, eps, dtype, device, fp32, $LOPA_FAST_BACKEND)
# Rows up to which the Triton layer ops take `ops.norm_linear` (the q/k/v and gate/up GEMMs with the add + norm as
# their prologue, RoPE / SwiGLU as their epilogue: `_norm_linear_stack`). Its win is launches and bytes, in the
# weight-bandwidth-bound regime: 2 * rows FLOPs per 2-byte weight element, so past ~184 rows (the H200's ridge,
# 790 TFLOP/s / 4.3 TB/s) the GEMMs are compute-bound, where cuBLAS's tuned tiles are the safer choice until
# bench/gpu_check.sh measures both (bench_ops' norm_linear rows). 256 covers LoPA k <= 7 at block 32 (k = 4: 160 rows).
NORM_LINEAR_MAX_ROWS = 256


def _make_layer_ops(lb: str, eps: float, dtype: torch.dtype, fp32: bool, cpp: bool) -> LayerOps:
    """`_layer_ops`' choice, built: the C++ norms and rope (cpp), the torch formulas (lb "torch"), else the public ops
    on backend lb (Triton: with `norm_linear`)."""
    silu_mul = (lambda gate, up: F.silu(gate) * up) if lb == "torch" else \
        (lambda g, u: ops.silu_mul(g, u, check=False, backend=lb))
    if cpp:
        def rope(qkv, table, Hq, Hkv, k_into):
            return rope_cpp_heads(qkv, Hq, Hkv, table[0], table[1], k_into)

        return LayerOps(*cpp_norms(eps), silu_mul, lambda cos, sin: (cos, sin), rope)
    if lb == "torch":
        norm = functools.partial(torch_rms_norm, eps=eps)

        def add_norm(x, residual, weight):
            s = x + residual
            return norm(s, weight), s

        def rope(qkv, rot, Hq, Hkv, k_into):
            # a contiguous q, as the reference's rope returns it (the attention's layout); k is copied by the
            # attention's concatenation and the stack (or into k_into) anyway
            q, k = rope_heads(qkv[:, :, : Hq + Hkv], rot).split([Hq, Hkv], dim=2)
            if k_into is not None:
                k = k_into.copy_(k[0])
            return q.contiguous(), k

        return LayerOps(norm, add_norm, silu_mul, lambda cos, sin: rope_rotation(cos, sin, dtype, fp32), rope)

    def rope(qkv, table, Hq, Hkv, k_into):
        q, k = ops.rope(qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hkv], table[0], table[1], fp32, check=False, backend=lb)
        return q, (k if k_into is None else k_into.copy_(k[0]))

    def norm_linear(x, weight, epilogue, norm_weight, residual, bias=None, rope=None, rot_heads=0):
        return ops.norm_linear(x, weight, epilogue, norm_weight=norm_weight, residual=residual, eps=eps, bias=bias,
                               rot_heads=rot_heads, rope_fp32=fp32, check=False, backend=lb, **(rope or {}))

    return LayerOps(lambda x, w: ops.rms_norm(x, w, eps, check=False, backend=lb),
                    lambda x, r, w: ops.add_rms_norm(x, r, w, eps, check=False, backend=lb),
                    silu_mul, lambda cos, sin: (cos, sin), rope, norm_linear if lb == "triton" else None)


def _torch_keys(n: int, win_lens, block_ids, mode: str, B: int, cache_len, lmax: int, dev, dense: bool = False):
    """The torch attention's key mask (`sdpa_mask`), or None when every key is visible: full attention, no window
    padding (dense, or win_lens None: every row's window is all n columns) and a host-int prefix (its rows sliced
    exactly). SDPA without a mask is bitwise SDPA with an all-True one (a 0 added to every score: measured) and
    skips ~11 ops a forward. dense under block_causal: the mask is the block rule alone."""
    if mode == "full" and (dense or win_lens is None) and not torch.is_tensor(cache_len):
        return None
    if dense and mode == "block_causal":  # no padding keys: window_key_mask's block rule alone (1 op instead of ~8)
        return sdpa_mask(block_ids[:, None, :] <= block_ids[:, :, None], cache_len, lmax)
    return sdpa_mask(window_key_mask(n, win_lens, block_ids, mode, B, dev), cache_len, lmax)


# padding block id of the pooled call's padding queries: they see every valid key of their row (their output is
# dropped; a query that saw no key at all would be a 0/0 row, harmless but noisy under a NaN checker)
_PAD_BLOCK = 1 << 30


def _pooled_attend(parts: list[dict], shapes: list[tuple], mode: str, b: str, pool: tuple, Hq: int, D: int, dev):
    """The pooled path of `DecoderLM.forward_requests`: attend(layer, q [1, T, Hq, D], k, v [1, T, Hkv, D]) ->
    o [1, T, Hq, D] as ONE pooled `ops.branch_attention` call over the pool (k, v [layers, S, Lp, Hkv, D]).

    The call's batch is every request's branch rows (B = sum NB_r) at the widest window nmax = max Nb_r: with equal
    windows the packed rows are that batch already (a view); otherwise one index_copy_ per tensor scatters the packed
    rows into a zero [B * nmax] buffer and one index_select gathers the real rows back. The per-call tables (slot
    per row, prefix length per slot, window lengths, block ids) are built once per forward, not per layer, with one
    host-to-device copy (a GPU round of small windows is launch- and sync-bound: every copy counts)."""
    k_pool, v_pool = pool
    S = k_pool.shape[1]
    B = sum(NBr for NBr, _ in shapes)
    nmax = max(Nbr for _, Nbr in shapes)
    lens = [0] * S
    slot_rows, dest, r0 = [], [], 0
    for p, (NBr, Nbr) in zip(parts, shapes):
        lens[p["slot"]] = int(p["prefix_len"])
        slot_rows += [p["slot"]] * NBr
        for a in range(NBr):  # packed row -> its row of the padded [B * nmax] batch
            base = (r0 + a) * nmax
            dest += range(base, base + Nbr)
        r0 += NBr
    padded = any(Nbr != nmax for _, Nbr in shapes)
    # one host-to-device copy per forward: [S] prefix lengths (unused slots 0, never indexed), [B] slot per row,
    # then (padded windows only) [T] the packed rows' places in the padded batch
    table = torch.tensor(lens + slot_rows + (dest if padded else []), dtype=torch.long, device=dev)
    cache_len, cache_index = table[:S], table[S : S + B]
    dest = table[S + B :] if padded else None
    win_lens = torch.cat([p["win_lens"].reshape(-1).long() for p in parts])  # [B]
    bids = None
    if mode == "block_causal":
        bids = torch.cat([torch.nn.functional.pad(p["bids"].long(), (0, nmax - Nbr), value=_PAD_BLOCK)
                          for p, (_, Nbr) in zip(parts, shapes)])

    def pad(t):  # [1, T, H, D] -> [B, nmax, H, D]
        if dest is None:
            return t.reshape(B, nmax, t.shape[2], D)
        return t.new_zeros(B * nmax, t.shape[2], D).index_copy_(0, dest, t[0]).view(B, nmax, t.shape[2], D)

    def attend(i, q, k, v):
        o = ops.branch_attention(pad(q), k_pool[i], v_pool[i], cache_len, pad(k), pad(v), win_lens, bids, mode,
                                 check=False, backend=b, cache_index=cache_index)
        o = o.reshape(B * nmax, Hq, D)
        return (o if dest is None else o.index_select(0, dest))[None]

    return attend
