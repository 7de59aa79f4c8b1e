"""The fast APD step as stages of device tensors (no host read): draft, verify and accept, both KV caches static.

Semantics are the APD reference's (docs/semantics.md "APD"); the stages, the head and the shapes: docs/internals.md.

Layout (request constants: P prompt length, L = P + max_new_tokens, the buffer length Lb >= L (L rounded up to
LENGTH_QUANTUM)):
  x          [Lb + 1] long   the canvas; column Lb is a trash column (padded writes go there)
  curr, left, right  0-d long
  dk, dv     [layers_D, Lb + 1, Hkv_D, D_D]  the drafter's static cache (W = None: one unused row)
  vk, vv     [layers_V, Lb + 1, Hkv_V, D_V]  the verifier's static cache (leftright: absent)
  prev       [V_ar]          the verifier's logits for position curr (prev_logits)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lopa_fast import keyed, ops
from lopa_fast.decode.shapes import divided, scaled, stop_in_prefix
from lopa_fast.sampling import finite_rows, top_k_filter, top_p_filter


HEAD_FIELDS = ("accepted", "curr", "left", "right", "eos", "done", "stop", "nonfinite_drafter",
               "nonfinite_verifier", "mask_committed", "outside_vocab")


@dataclass(frozen=True)
class ApdGeometry:
    """The Python constants of a request's step (baked into a compiled step; P, L and the float knobs `apd_knobs`
    are device tables: whether a knob is on is a constant here, its value a runtime input)."""

    Lb: int
    W: int | None  # kv_window (None: no drafter cache)
    M: int | None  # max_lookahead (None: the whole canvas)
    verify: bool  # apd_mixture_weight set (the value: T["R"]); False: the leftright baseline
    K: int  # tokens_per_step of the leftright baseline
    V_ar: int  # the verifier's vocabulary (0 without one)
    mask_id: int
    eos_id: int | None
    exact_prev: bool
    suppress_mask: bool
    nucleus: bool  # a top-p filter (top_p < 1; the value: T["top_p"])
    top_k: int | None
    stop_lens: tuple
    attn_backend: str
    sampling: bool = False  # T > 0: the keyed draft (sampler="keyed"; the seed and T["temperature"] are tables)
    single_temperature: bool = False
    coupled_gumbel: bool = False
    fused_head: bool = False  # both forwards end in `ops.head_confidence` (T = 0, no filters: `fused_head_wanted`)


def apd_knobs(cfg) -> dict[str, float | None]:
    """A request's float knobs, the step's runtime inputs (tables; None: off, stored as 0.0): the mixture weight R,
    the draft's temperature and top_p."""
    return {"R": cfg.apd_mixture_weight, "temperature": cfg.temperature, "top_p": cfg.top_p}


def next_window(curr: int, accepted: int, L: int, geo: ApdGeometry, first: bool) -> tuple[int, int]:
    """(left, right) of the step that starts at `curr` after `accepted` tokens were accepted (host ints)."""
    right = min(curr + geo.M, L) if geo.M is not None else L
    left = 0 if (geo.W is None or first) else max(curr - geo.W - accepted + 1, 0)
    return left, right


def _first_bad(finite: torch.Tensor, read: torch.Tensor, curr: torch.Tensor) -> torch.Tensor:
    """0-d long: the sequence position (curr + row) of the first read row holding NaN / inf (finite [rows] bool:
    False there), or -1."""
    bad = read & ~finite
    rows = torch.arange(bad.shape[0], device=bad.device)
    return torch.where(bad.any(), curr + torch.where(bad, rows, bad.shape[0]).min(), -1)


def draft_inputs(st: dict, geo: ApdGeometry, Nb: int, Db: int, first: bool, prefix: tuple[int, int] | None) -> dict:
    """The drafter's forward inputs: x[left:right] over its cache [0, left), the LM head on the rows predicting
    [curr, right). Returns the step's working dict `a`: the forward's tokens [1, Nb], start (0-d), prefix_len,
    win_lens [1], rows [Db], and the step's tables j [Db], n_d (0-d), dvalid [Db] (real draft rows), wcol [Nb]
    (window columns; padding -> the trash column Lb)."""
    dev = st["x"].device
    x, curr, left, right = st["x"], st["curr"], st["left"], st["right"]
    i = torch.arange(Nb, device=dev)
    j = torch.arange(Db, device=dev)
    n_d = right - curr
    dvalid = j < n_d  # [Db] real draft rows
    wcol = torch.where(left + i < right, left + i, geo.Lb)  # [Nb] window columns (padding -> the trash column)
    tokens = x.index_select(0, wcol)[None]
    d_prefix = (0 if geo.W is None or first else prefix[0]) if prefix is not None else (
        left if geo.W is not None else torch.zeros((), dtype=torch.long, device=dev))
    raw_row = (curr - left + j - 1).clamp(min=0)  # Dream's shift; a mask at window row 0 keeps its own row
    # every gather index is in range by construction, whatever the state (a captured graph's warm-up runs on
    # the workspace's last state, possibly a finished request's: an out-of-range index would be a device assert)
    raw_row = torch.where(dvalid, raw_row, 0).clamp(max=Nb - 1)
    return dict(tokens=tokens, start=left, prefix_len=d_prefix, win_lens=(right - left).reshape(1), rows=raw_row,
                j=j, n_d=n_d, dvalid=dvalid, wcol=wcol, output=_output(geo))


def _output(geo: ApdGeometry) -> str:
    """What a forward of the step returns: the final-normed rows (geo.fused_head: the step applies the head) or the
    logits."""
    return "hidden" if geo.fused_head else "logits"


def _head(geo: ApdGeometry, out: torch.Tensor, head: torch.Tensor | None, suppress: int | None):
    """(logits [rows, V], finite [rows] bool or None, arg-max [rows] or None) of a forward's output: geo.fused_head,
    the final-normed rows out [rows, H] through `ops.head_confidence` (the raw logits kept, the arg-max taken after
    `suppress` is set to -inf: one pass over the head, no statistics beyond these); else out is the logits, returned
    with None and None (the caller checks finiteness over the rows it reads)."""
    if not geo.fused_head:
        return out, None, None
    hc = ops.head_confidence(out, head, suppress, entropy=False, keep_logits=True, check=False)
    return hc.logits, hc.finite, hc.token


def drafted(st: dict, T: dict, geo: ApdGeometry, a: dict, l_d: torch.Tensor, k_win: torch.Tensor,
            v_win: torch.Tensor, head: torch.Tensor | None = None) -> None:
    """After the drafter's forward (logits l_d [Db, V_D]; geo.fused_head: its final-normed rows [Db, H] and head the
    drafter's LM-head weight [V_D, H]; window K/V [layers, 1, Nb, Hkv, D]): the window's K/V into the drafter's
    cache, the non-finite guard and the draft x0 [Db] (the reference's draft_tokens: filters, then argmax, or the
    keyed draw at T > 0). Adds l_d (the logits), nf_d, x0, noise to `a`."""
    curr, j, dvalid = st["curr"], a["j"], a["dvalid"]
    if geo.W is not None:  # the window's K/V at rows [left, right): the next step's prefix reads [0, left')
        st["dk"].index_copy_(1, a["wcol"], k_win[:, 0])
        st["dv"].index_copy_(1, a["wcol"], v_win[:, 0])
    l_d, finite, fused_x0 = _head(geo, l_d, head, geo.mask_id if geo.suppress_mask else None)
    nf_d = _first_bad(finite_rows(l_d) if finite is None else finite, dvalid, curr)
    if fused_x0 is not None:  # T = 0, no filters: the arg-max after the mask's suppression, from the head's pass
        a.update(l_d=l_d, nf_d=nf_d, x0=fused_x0, noise=None)
        return

    # ---- the draft (the reference's draft_tokens at T = 0: filters, then argmax)
    lg = l_d
    if geo.suppress_mask:
        lg = lg.clone()
        lg[:, geo.mask_id] = float("-inf")  # a fill kernel (no host-to-device copy: capturable)
    Tmp = T["temperature"]  # a runtime knob (read only when geo.sampling)
    if geo.sampling:
        lg = divided(lg, Tmp)
    if geo.nucleus:
        lg = top_p_filter(lg, T["top_p"])
    if geo.top_k is not None:
        lg = top_k_filter(lg, geo.top_k)
    noise = None
    if geo.sampling:  # the reference's keyed draft: rows keyed by (seed, step = this dLLM forward, position)
        st["step"] = st["step"] + 1
        keys = keyed.key(T["seed"], keyed.TOKEN, st["step"], 0, curr + j)
        noise = keyed.row_exponentials(keys, lg.shape[-1])
        if not geo.single_temperature:
            noise = keyed.knob_pow(noise, Tmp)  # quirk Q1: the temperature applied twice
        x0 = torch.argmax(lg.to(torch.float64).exp() / noise, dim=-1)
    else:
        x0 = torch.argmax(lg, dim=-1)  # [Db]
    a.update(l_d=l_d, nf_d=nf_d, x0=x0, noise=noise)


def verify_inputs(st: dict, geo: ApdGeometry, a: dict, first: bool, prefix: tuple[int, int] | None) -> dict:
    """The verifier's forward inputs (geo.verify): first step, the whole draft x[:right] (x0 written in) from
    position 0, the AR rows for curr .. right; later steps, x0 at positions [curr, right) over its cache [0, curr).
    Returns its tokens [1, Nb or Db], start (0-d), prefix_len, win_lens [1], rows; adds outside (0-d bool: a drafted
    id outside the verifier's vocabulary) and vdst (the cache rows its window's K/V go to) to `a`."""
    dev = st["x"].device
    x, curr, right = st["x"], st["curr"], st["right"]
    j, n_d, dvalid, wcol, x0 = a["j"], a["n_d"], a["dvalid"], a["wcol"], a["x0"]
    Db, Nb, Lb = j.shape[0], wcol.shape[0], geo.Lb
    zero = torch.zeros((), dtype=torch.long, device=dev)
    Vq = geo.V_ar
    a["outside"] = (dvalid & (x0 >= Vq)).any()
    vtok = x0.clamp(max=Vq - 1)  # an outside id is refused after the read; it must not index the embedding
    if first:  # the whole draft x[:right] (left = 0: the window columns are positions 0..Nb-1)
        dst = torch.where(dvalid, curr + j, Lb)
        vt = x.index_copy(0, dst, vtok).index_select(0, wcol)[None]
        er = torch.arange(Db + 1, device=dev)
        vrows = torch.where(er <= n_d, curr - 1 + er, 0).clamp(0, Nb - 1)  # AR predictions for curr .. right
        a["vdst"] = wcol
        return dict(tokens=vt, start=zero, prefix_len=0 if prefix is not None else zero, win_lens=right.reshape(1),
                    rows=vrows, output=_output(geo))
    a["vdst"] = torch.where(dvalid, curr + j, Lb)
    return dict(tokens=vtok[None], start=curr, prefix_len=prefix[1] if prefix is not None else curr,
                win_lens=n_d.reshape(1), rows=j, output=_output(geo))


def verified(st: dict, T: dict, geo: ApdGeometry, a: dict, first: bool, l_v: torch.Tensor, vk_win: torch.Tensor,
             vv_win: torch.Tensor, head: torch.Tensor | None = None) -> None:
    """After the verifier's forward (logits l_v [Db + 1 (first) or Db, V_ar]; geo.fused_head: its final-normed rows
    and head the verifier's LM-head weight [V_ar, H_V]; window K/V): its K/V into the verifier's cache, the
    acceptance rule (target = argmax(R * l_D[:, :V_ar] + (1 - R) * l_AR), quirk Q2; the longest agreeing prefix, at
    least 1) and prev_logits (Q3 unless exact_prev). Adds accepted, nf_v to `a`."""
    dev = st["x"].device
    j, n_d, dvalid, x0, l_d, noise = a["j"], a["n_d"], a["dvalid"], a["x0"], a["l_d"], a["noise"]
    Db, Vq, Tmp = j.shape[0], geo.V_ar, T["temperature"]
    l_v, finite, _ = _head(geo, l_v, head, None)
    ext = l_v if first else torch.cat([st["prev"][None].to(l_v.dtype), l_v], 0)  # row 0: the prediction kept
    if finite is None:  # the unfused logits: one pass over every row read
        finite = finite_rows(ext)
    elif not first:  # the fused head's flags, and the kept row's
        finite = torch.cat([finite_rows(ext[:1]), finite])
    st["vk"].index_copy_(1, a["vdst"], vk_win[:, 0])
    st["vv"].index_copy_(1, a["vdst"], vv_win[:, 0])
    er = torch.arange(Db + 1, device=dev)
    read = (er < n_d) | ((er == n_d) & geo.exact_prev)
    nf_v = _first_bad(finite, read, st["curr"])
    l_ar = ext[:Db]
    R = T["R"]  # a runtime knob; written as `R * l_d + (1 - R) * l_ar` with a Python float R computes it
    mix = scaled(l_d[:, :Vq], R) + scaled(l_ar, 1 - R)
    if geo.coupled_gumbel and noise is not None:  # the paper's target: the draft's noise reused
        target = torch.argmax(divided(mix, Tmp).to(torch.float64).exp() / noise[:, :Vq], dim=-1)
    else:
        target = torch.argmax(mix, dim=-1)
    agree = ((x0 == target) | (j == 0)) & dvalid
    accepted = agree.long().cumprod(0).sum()
    # prev_logits: the AR row for the first rejected position; all accepted: row n_d - 1 (Q3) or n_d (exact)
    keep = (accepted if geo.exact_prev else torch.where(accepted < n_d, accepted, n_d - 1)).clamp(0, Db)
    st["prev"] = ext.index_select(0, keep.reshape(1))[0]
    a.update(accepted=accepted, nf_v=nf_v)


def commit(st: dict, T: dict, geo: ApdGeometry, a: dict) -> tuple[dict, dict]:
    """Commit the accepted prefix (at most the drafted rows; leftright: tokens_per_step), then the end tests, the
    next window and the step's head [11] (HEAD_FIELDS). Returns (st, {"x0": the draft [Db]})."""
    dev = st["x"].device
    Lb, x, curr, j, dvalid, x0 = geo.Lb, st["x"], st["curr"], a["j"], a["dvalid"], a["x0"]
    zero = torch.zeros((), dtype=torch.long, device=dev)
    if geo.verify:
        outside, nf_v, accepted = a["outside"], a["nf_v"], a["accepted"]
    else:
        outside = torch.zeros((), dtype=torch.bool, device=dev)
        nf_v = torch.full((), -1, dtype=torch.long, device=dev)
        accepted = torch.full((), geo.K, dtype=torch.long, device=dev)
    written = dvalid & (j < accepted)
    x = x.index_copy(0, torch.where(written, curr + j, Lb), x0)
    mask_committed = (written & (x0 == geo.mask_id)).any()
    curr = curr + accepted
    eos = (x[:Lb] == geo.eos_id).any() if geo.eos_id is not None else torch.zeros((), dtype=torch.bool, device=dev)
    done = (curr >= T["L"]) | eos
    stop = stop_in_prefix(x[:Lb], T["stops"], geo.stop_lens, geo.mask_id, first=T["P"])  # the committed prefix
    right = torch.minimum(curr + geo.M, T["L"]) if geo.M is not None else T["L"]
    left = (curr - geo.W - accepted + 1).clamp(min=0) if geo.W is not None else zero
    st.update(x=x, curr=curr, left=left, right=right)
    st["head"] = torch.stack([accepted, curr, left, right, eos, done, stop, a["nf_d"], nf_v, mask_committed,
                              outside]).long()
    return st, {"x0": x0}
