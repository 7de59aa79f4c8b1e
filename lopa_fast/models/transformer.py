"""The decoder core shared by both families (pre-norm RMSNorm, rotate-half RoPE, GQA, SwiGLU).

Families differ only in parameter names (kept identical to the HF checkpoints, so loading, LoRA
merging and saving are plain state-dict operations) and in small numeric conventions:

- Qwen2 family (Dream, DiffuCoder, D2F, Qwen2.5): RoPE cos/sin computed in fp32 and cast to the model
  dtype before rotating (as HF Qwen2 does); q/k/v have biases.
- LLaDA: RoPE applied in fp32 and cast back (`rope_full_precision`); no biases.

Forwards: `model(input_ids)` is the cache-free forward under the family's own attention; `forward_window` is
the plain layer over a `KVCache` (the reference decoders'); the fast path's fused forwards (`forward_static`,
`forward_requests`, `forward_dual`: Fast-dLLM's dual-cache step) live in static_forward.py (mixed in).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lopa_fast import ops
from lopa_fast.reference.attention_modes import ATTENTION_MODES
from lopa_fast.models.config import ModelConfig
from lopa_fast.models.kv_cache import KVCache
from lopa_fast.models.static_forward import FusedForwards


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back, then scale (HF Qwen2 / LLaDA order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class LayerWeights:
    """Views of one layer's parameters under engine names (nn.Linear weights are [out, in])."""

    attn_norm: torch.Tensor
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    mlp_norm: torch.Tensor
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear


@dataclass
class FusedLayer:
    """One layer's inference view for the fast forward: q/k/v and gate/up weights merged so each is ONE
    GEMM. The HF-named parameters are re-pointed as views into the merged tensors (what `state_dict`,
    LoRA merging and training see is unchanged; no second copy of the weights is held)."""

    attn_norm: torch.Tensor
    qkv_w: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    qkv_b: torch.Tensor | None  # [(Hq + 2 Hkv) * D] or None
    o_w: torch.Tensor  # the o projection's weight [H, Hq * D] and bias (or None): its Parameters, read directly (an
    o_b: torch.Tensor | None  # nn.Module attribute costs ~1 us a read on CPU, 8 reads a tiny forward)
    mlp_norm: torch.Tensor
    gate_up_w: torch.Tensor  # [2 * I, H]: gate rows first
    down_w: torch.Tensor  # the down projection's weight [H, I] and bias (or None)
    down_b: torch.Tensor | None


@torch.no_grad()
def _merge_as_views(params: list[torch.Tensor]) -> torch.Tensor:
    """cat(params, 0) once, then make every param's .data a view of its rows of the result.

    The buffer is made outside inference mode even when the first decode runs under it: the parameters become
    views of it, and an inference-mode buffer would make them unusable for autograd afterwards ("Inference
    tensors cannot be saved for backward": a model could not be trained after a `lopa_fast.generate`)."""
    with torch.inference_mode(False), torch.no_grad():
        merged = torch.cat([p.data for p in params], 0)
        off = 0
        for p in params:
            rows = p.shape[0]
            p.data = merged[off : off + rows]
            off += rows
    return merged


class DecoderLM(FusedForwards, nn.Module):
    """Base class; subclasses define the parameters under HF names and `layer(i)` / `embed` / `head`."""

    config: ModelConfig
    rope_in_fp32: bool = False
    # the checkpoint directory, set by lopa_fast.load_model (None for a model built in memory); a class default so
    # that reading it never goes through nn.Module.__getattr__'s AttributeError (~10 us, once a request)
    name_or_path: str | None = None

    # ---- family properties: the config's, read off the model by the decoders ------------------------
    attention = property(lambda self: self.config.attention)  # "full" (Dream, DiffuCoder, LLaDA), "causal" (Qwen AR)
    logits_shift = property(lambda self: self.config.logits_shift)  # True: the raw logit at j predicts token j + 1
    mask_token_id = property(lambda self: self.config.mask_token_id)
    eos_token_id = property(lambda self: self.config.eos_token_id)
    pad_token_id = property(lambda self: self.config.pad_token_id)
    bos_token_id = property(lambda self: self.config.bos_token_id)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight().dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight().device

    def embed_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def final_norm_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def layer(self, i: int) -> LayerWeights:
        raise NotImplementedError

    def fused_layers(self) -> list[FusedLayer]:
        """The merged-weight inference view of every layer, built on first use and rebuilt if the weights
        were replaced since (e.g. `model.to(...)`): a check of one pointer per layer."""
        cached = getattr(self, "_fused", None)
        if cached is not None and all(
            fl.qkv_w.data_ptr() == self.layer(i).q.weight.data_ptr() for i, fl in enumerate(cached)
        ):
            return cached
        out = []
        for i in range(self.config.num_layers):
            w = self.layer(i)
            qkv_w = _merge_as_views([w.q.weight, w.k.weight, w.v.weight])
            biases = [w.q.bias, w.k.bias, w.v.bias]
            qkv_b = _merge_as_views(biases) if all(b is not None for b in biases) else None
            if qkv_b is None and any(b is not None for b in biases):
                raise ValueError(f"layer {i}: q/k/v biases must be all present or all absent to merge")
            gate_up_w = _merge_as_views([w.gate.weight, w.up.weight])
            out.append(FusedLayer(w.attn_norm, qkv_w, qkv_b, w.o.weight, w.o.bias, w.mlp_norm, gate_up_w,
                                  w.down.weight, w.down.bias))
        self._fused = out
        # layer 0's q projection (in a tuple: an attribute holding a Module would register it as a submodule): the
        # per-forward check reads its weight's pointer in ~1 us instead of building `layer(0)` (~20 us on CPU)
        self._fused_q0 = (self.layer(0).q,)
        return out

    # ---- RoPE -----------------------------------------------------------------------------------
    def rope_inv_freq(self, device) -> torch.Tensor:
        """RoPE's inverse frequencies [D / 2] fp32 on `device`: 1 / theta ** (arange(0, D, 2) / D), kept on the model
        after the first call (a normal tensor even under inference mode; not while dynamo traces: a compiled round
        reads the kept one). Per call it was 6 kernels of every captured GPU round (6 graph nodes)."""
        kept = self.__dict__.get("_inv_freq")  # (the instance dict: no nn.Module __getattr__)
        if kept is not None and kept.device == torch.device(device):
            return kept
        cfg = self.config
        d = cfg.head_dim

        def formula():
            return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))

        if torch.compiler.is_compiling():  # in the graph, nothing kept
            return formula()
        with torch.inference_mode(False):
            inv_freq = self.__dict__["_inv_freq"] = formula()
        return inv_freq

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables cos, sin [n, D] in fp32 for int positions [n] (computed per call: n is a window, D
        small; the inverse frequencies kept, `rope_inv_freq`)."""
        inv_freq = self.rope_inv_freq(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rope_window(self, start: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables` of positions start .. start + n - 1 (host ints: an eager round) as slices of a table kept on
        the model: computed once for positions [0, 2^k) covering start + n (doubling; a Dream-7B head of 128 at 4,096
        positions: 4 MiB), so a round reads two views instead of ~9 ops (~50 us of a ~1 ms tiny CPU forward).
        Each entry is the formula's value at that position (elementwise; cos / sin may differ from a per-window
        call in the last bit where torch's vectorised and scalar tails differ: within the fast path's tolerance)."""
        table = getattr(self, "_rope_window", None)
        end = start + n
        if table is None or table[0].shape[0] < end or table[0].device != torch.device(device):
            size = 1 << max(8, (end - 1).bit_length())
            table = self.rope_tables(torch.arange(size, device=device))
            self._rope_window = table
        return table[0][start:end], table[1][start:end]

    def _apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B, n, H, D]; cos/sin: [n, D]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        if self.rope_in_fp32:
            xf = x.float()
            return (xf * c + rotate_half(xf) * s).to(x.dtype)
        c, s = c.to(x.dtype), s.to(x.dtype)
        return x * c + rotate_half(x) * s

    # ---- cache ----------------------------------------------------------------------------------
    def new_cache(self, max_len: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """A static KV cache for one request of up to `max_len` positions."""
        cfg = self.config
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"new_cache: max_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}"
            )
        return KVCache(
            cfg.num_layers,
            max_len,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=dtype or self.dtype,
            device=device or self.device,
        )

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, mask: str | None = None, block_ids=None, **kw) -> torch.Tensor:
        """Cache-free forward: raw (unshifted) logits [B, n, V] under the family's attention
        (or `mask` if given: "full" | "block_causal" (needs block_ids [B, n]) | "causal")."""
        return self.forward_window(input_ids, mask=mask, block_ids=block_ids, **kw)

    def forward_window(
        self,
        tokens: torch.Tensor,
        *,
        cache: KVCache | None = None,
        start: int | None = None,
        mask: str | None = None,
        block_ids: torch.Tensor | None = None,
        win_lens: torch.Tensor | None = None,
        commit: int = 0,
        rows: torch.Tensor | None = None,
        output: str = "logits",
    ) -> torch.Tensor:
        """Forward a window of tokens (one or several branches) over a shared static KV cache.

        tokens:    LongTensor [B, n] (or [n]) -- B branch windows, padded to a common n.
        cache:     KVCache or None. Positions are `start + arange(n)`; `start` defaults to cache.length.
                   * start == cache.length (append mode): queries attend to cache[:length] plus their own
                     window (the window's K/V go to the cache's scratch, `cache.window_kv(layer)`).
                   * start < cache.length (in-place mode, Fast-dLLM dual cache; B must be 1 and
                     start + n <= cache.length): the window's K/V overwrite cache positions
                     [start, start+n) and queries attend to the whole cache[:length] with full attention.
        mask:      "full" | "block_causal" | "causal" for the window part (the prefix is always visible);
                   default: the family's attention. block_causal needs block_ids [B, n] (int, the block
                   index of each window position; query i sees key j iff block_ids[j] <= block_ids[i]).
        win_lens:  LongTensor [B] valid lengths of ragged windows (keys beyond are masked), or None.
        commit:    u > 0 appends the first u window positions of branch 0 to the cache after the forward. The
                   decoder may instead call `cache.commit_window(branch, u)` itself once it knows the winner.
        rows:      LongTensor [R] of flat row indices into the B*n window rows: compute the output only
                   for these rows (the LM head on the rows a round needs). None = all rows.
        output:    "logits" (raw, unshifted; [B, n, V] or [R, V]) or "hidden" (final-normed hidden states,
                   [B, n, H] or [R, H]).
        """
        cfg = self.config
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2:
            raise ValueError(f"forward_window: tokens must be [B, n], got shape {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"forward_window: tokens.dtype={tokens.dtype}; expected an integer tensor")
        B, n = tokens.shape
        mask = mask or self.attention
        if mask not in ATTENTION_MODES:
            raise ValueError(f"forward_window: mask={mask!r}; allowed: {ATTENTION_MODES}")
        if mask == "block_causal" and block_ids is None:
            raise ValueError("forward_window: mask='block_causal' needs block_ids [B, n]")
        if output not in ("logits", "hidden"):
            raise ValueError(f"forward_window: output={output!r}; allowed: 'logits', 'hidden'")
        if block_ids is not None and block_ids.dim() == 1:
            block_ids = block_ids[None].expand(B, n)
        cache_len = 0 if cache is None else cache.length
        start = cache_len if start is None else int(start)
        inplace = cache is not None and start < cache_len
        if cache is None and start != 0:
            raise ValueError(f"forward_window: start={start} without a cache; positions start at 0")
        if cache is not None and start > cache_len:
            raise ValueError(f"forward_window: start={start} is past the cache end {cache_len} (positions are "
                             "contiguous)")
        if inplace and (B != 1 or start + n > cache_len or mask != "full"):
            raise ValueError(
                f"forward_window: in-place mode (start={start} < cache.length={cache_len}) needs B=1, "
                f"start+n <= cache.length and mask='full'; got B={B}, n={n}, mask={mask!r}"
            )
        if start + n > cfg.max_position_embeddings:
            raise ValueError(
                f"forward_window: positions up to {start + n} exceed max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        if cache is not None and not inplace:
            if cache_len + n > cache.max_len:
                raise ValueError(f"forward_window: window end {cache_len + n} exceeds cache.max_len={cache.max_len}")
            cache.reserve_window(B, n)
        if commit and cache is None:
            raise ValueError("forward_window: commit > 0 needs a cache")

        positions = torch.arange(start, start + n, device=tokens.device)
        Hkv, D = cfg.num_kv_heads, cfg.head_dim
        empty = torch.zeros((0, Hkv, D), dtype=self.dtype, device=tokens.device)

        def attend(i, q, k, v):
            if cache is None:
                return ops.branch_attention(q, empty, empty, 0, k, v, win_lens, block_ids, mask)
            if inplace:
                cache.k[i, start : start + n] = k[0]
                cache.v[i, start : start + n] = v[0]
                no_window = torch.zeros(1, dtype=torch.long, device=tokens.device)
                return ops.branch_attention(q, cache.k[i], cache.v[i], cache_len, k, v, no_window, None, "full")
            kw, vw = cache.window_kv(i)
            kw.copy_(k)
            vw.copy_(v)
            return ops.branch_attention(q, cache.k[i], cache.v[i], cache_len, kw, vw, win_lens, block_ids, mask)

        h = self._layers(tokens, positions, attend)
        if rows is not None:
            h = h.reshape(B * n, -1).index_select(0, rows)
        h = rms_norm(h, self.final_norm_weight(), cfg.rms_norm_eps)
        if commit:
            cache.commit_window(0, commit)
        if output == "hidden":
            return h
        return F.linear(h, self.head_weight())

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor | None, attend, rope=None) -> torch.Tensor:
        """Embedding + every decoder layer for tokens [B, n] at positions [n]; returns h [B, n, H].

        attend(layer, q [B, n, Hq, D], k, v [B, n, Hkv, D]) -> o [B, n, Hq, D] (keys post-RoPE) is where the
        callers differ (forward_window's cache-free / in-place / append modes).
        rope: (cos, sin) [n, D] given instead of positions (several requests' windows packed in one row, each
        table computed at its own positions)."""
        cfg = self.config
        B, n = tokens.shape
        cos, sin = self.rope_tables(positions) if rope is None else rope
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.embedding(tokens, self.embed_weight())
        for i in range(cfg.num_layers):
            w = self.layer(i)
            x = rms_norm(h, w.attn_norm, cfg.rms_norm_eps)
            q = w.q(x).view(B, n, Hq, D)
            k = w.k(x).view(B, n, Hkv, D)
            v = w.v(x).view(B, n, Hkv, D)
            q, k = self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin)
            attn = attend(i, q, k, v)
            h = h + w.o(attn.reshape(B, n, Hq * D))
            x = rms_norm(h, w.mlp_norm, cfg.rms_norm_eps)
            h = h + w.down(F.silu(w.gate(x)) * w.up(x))
        return h
