"""The fast APD decoder: draft, verify and accept on the device, both KV caches static, ONE host read per step.

Semantics are exactly those of the APD reference (docs/semantics.md "APD"; upstream `apd_sample`); this
module only changes *how* a step is computed. Per step (curr = the first undecided position, n_d = right - curr
drafted positions):

    drafter   one full-attention forward of x[left:right] over its static cache rows [0, left): the cache is
              never cropped or copied; "crop to left" is just the prefix length the next forward reads, and the
              window's K/V are written in place at rows [left, right) (the next step reads [0, left'), left' =
              curr - W + 1 <= curr, so every row it reads was written by an earlier step). W = None: no cache.
              The LM head runs on the n_d rows that predict the window's masks only (Dream's shift: row m-1
              predicts position m; a mask at window row 0 keeps its own row, as upstream).
    draft     x0 = argmax of those rows (mask id suppressed / top-p / top-k filtered as the reference does)
    verifier  first step: a causal forward of x[:right] with x0 written in; later steps: a causal forward of x0
              at positions [curr, right) over its static cache rows [0, curr). Rollback to the accepted length
              is again just the next step's prefix length (no copy); the K/V of every drafted position is
              written in place and the rejected ones are overwritten by the next step.
    accept    target = argmax(R * l_D[:, :V_ar] + (1 - R) * l_AR) (quirk Q2), the longest agreeing prefix,
              at least 1; prev_logits kept on the device (quirk Q3 unless exact_prev_logits)
    leftright apd_mixture_weight = None: no verifier, tokens_per_step accepted per step
    end       curr >= L, the EOS id anywhere in x (the prompt too, as upstream), a stop sequence in the committed
              prefix, or the round cap (max_rounds -> hit_round_cap, finish_reason "round_cap")

Every step ends in the 11-int `head` (HEAD_FIELDS) the host reads once: the accepted count, the new curr and the
next window [left, right) (the shapes of the next step), the end flags and the error flags (non-finite logits
of either model, a drafted mask id committed, a drafted id outside the verifier's vocabulary), which the host
turns into the reference's errors before returning anything.

Shapes: eager steps use the exact window (Nb = right - left columns, Db = n_d draft rows) and pass the prefix
lengths as host ints, so attention slices exactly the reference's keys; a compiled step (compile=True) rounds
(Nb, Db) up to buckets and masks the padding (window keys past n are masked, padded draft rows never agree,
their K/V and tokens go to a trash row / column Lb).

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

from lopa_fast import keyed
from lopa_fast.decode.shapes import divided, knob, pow2_bucket, quantized_length, scaled, stop_table
from lopa_fast.decode.syncs import round_scope
from lopa_fast.errors import NonFiniteLogitsError
from lopa_fast.output import Clock, GenerateOutput, finalize_stats, round_cap_hit
from lopa_fast.progress import report_round
from lopa_fast.sampling import top_k_filter, top_p_filter

HEAD_FIELDS = ("accepted", "curr", "left", "right", "eos", "done", "stop", "nonfinite_drafter",
               "nonfinite_verifier", "mask_committed", "outside_vocab")  # fmt: skip


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


def apd_knobs(cfg) -> dict[str, float | None]:
    """A request's float knobs, the step's runtime inputs (tables; None: off, stored as 0.0): the mixture weight R,
    the draft's temperature and top_p."""
    return {"R": cfg.apd_mixture_weight, "temperature": cfg.temperature, "top_p": cfg.top_p}


def next_window(curr: int, accepted: int, L: int, geo: ApdGeometry, first: bool) -> tuple[int, int]:
    """(left, right) of the step that starts at `curr` after `accepted` tokens were accepted (host ints)."""
    right = min(curr + geo.M, L) if geo.M is not None else L
    left = 0 if (geo.W is None or first) else max(curr - geo.W - accepted + 1, 0)
    return left, right


def _stop_hit(x: torch.Tensor, T: dict, geo: ApdGeometry) -> torch.Tensor:
    """0-d bool: a stop sequence lies in the committed prefix x[P : first mask) (the prompt holds no mask, so the
    first mask of the whole row ends it). One static loop over the few, short sequences."""
    dev = x.device
    if not geo.stop_lens:
        return torch.zeros((), dtype=torch.bool, device=dev)
    row = x[: geo.Lb]
    masks = row == geo.mask_id
    end = torch.where(masks.any(), masks.long().argmax(), geo.Lb)
    hit = torch.zeros((), dtype=torch.bool, device=dev)
    for j, ln in enumerate(geo.stop_lens):
        if ln > geo.Lb:
            continue
        start = torch.arange(geo.Lb - ln + 1, device=dev)
        match = (row.unfold(0, ln, 1) == T["stops"][j, :ln][None, :]).all(1)
        hit = hit | (match & (start >= T["P"]) & (start + ln <= end)).any()
    return hit


def _first_bad(logits: torch.Tensor, read: torch.Tensor, curr: torch.Tensor) -> torch.Tensor:
    """0-d long: the sequence position (curr + row) of the first read row holding NaN / inf, or -1."""
    bad = read & ~torch.isfinite(logits).all(-1)
    rows = torch.arange(bad.shape[0], device=bad.device)
    return torch.where(bad.any(), curr + torch.where(bad, rows, bad.shape[0]).min(), -1)


def apd_step(drafter, verifier, st: dict, T: dict, geo: ApdGeometry, Nb: int, Db: int, first: bool,
             prefix: tuple[int, int] | None = None) -> tuple[dict, dict]:  # fmt: skip
    """One APD step on the bucket (Nb window columns >= right - left, Db draft rows >= right - curr).

    first: the prefill step (the verifier runs over the whole draft x[:right]); prefix: (drafter, verifier)
    committed prefix lengths as host ints (eager: exact key slices), or None (compiled: masked static buffers).
    Reads and replaces the tensors of `st` (the caches are written in place); returns (st, info) with info the
    step's draft x0 [Db] (read by the host only for a trace). No host read.

    The step is stages around its two forwards: `draft_inputs` -> the drafter -> `drafted` -> `verify_inputs` ->
    the verifier -> `verified` -> `commit` (no verifier, leftright: straight to `commit`). Solo, this function
    runs them with `forward_static`; the batch scheduler runs the same stages (FastApd's driver methods) with each
    forward shared by every live request (`forward_requests`)."""
    a = draft_inputs(st, geo, Nb, Db, first, prefix)
    l_d, k_win, v_win = drafter.forward_static(
        a["tokens"], a["start"], st["dk"], st["dv"], a["prefix_len"], a["win_lens"], None, "full", a["rows"],
        attn_backend=geo.attn_backend,
    )  # fmt: skip
    drafted(st, T, geo, a, l_d, k_win, v_win)
    if geo.verify:
        v = verify_inputs(st, geo, a, first, prefix)
        l_v, vk_win, vv_win = verifier.forward_static(
            v["tokens"], v["start"], st["vk"], st["vv"], v["prefix_len"], v["win_lens"], None, "causal", v["rows"],
            attn_backend=geo.attn_backend,
        )  # fmt: skip
        verified(st, T, geo, a, first, l_v, vk_win, vv_win)
    return commit(st, T, geo, a)


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
        left if geo.W is not None else torch.zeros((), dtype=torch.long, device=dev))  # fmt: skip
    raw_row = (curr - left + j - 1).clamp(min=0)  # Dream's shift; a mask at window row 0 keeps its own row
    # every gather index is in range by construction, whatever the state (a captured graph's warm-up runs on
    # the workspace's last state, possibly a finished request's: an out-of-range index would be a device assert)
    raw_row = torch.where(dvalid, raw_row, 0).clamp(max=Nb - 1)
    return dict(tokens=tokens, start=left, prefix_len=d_prefix, win_lens=(right - left).reshape(1), rows=raw_row,
                j=j, n_d=n_d, dvalid=dvalid, wcol=wcol)  # fmt: skip


def drafted(st: dict, T: dict, geo: ApdGeometry, a: dict, l_d: torch.Tensor, k_win: torch.Tensor,
            v_win: torch.Tensor) -> None:  # fmt: skip
    """After the drafter's forward (logits l_d [Db, V_D], window K/V [layers, 1, Nb, Hkv, D]): the window's K/V into
    the drafter's cache, the non-finite guard and the draft x0 [Db] (the reference's draft_tokens: filters, then
    argmax, or the keyed draw at T > 0). Adds l_d, nf_d, x0, noise to `a`."""
    curr, j, dvalid = st["curr"], a["j"], a["dvalid"]
    if geo.W is not None:  # the window's K/V at rows [left, right): the next step's prefix reads [0, left')
        st["dk"].index_copy_(1, a["wcol"], k_win[:, 0])
        st["dv"].index_copy_(1, a["wcol"], v_win[:, 0])
    nf_d = _first_bad(l_d, dvalid, curr)

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
                    rows=vrows)  # fmt: skip
    a["vdst"] = torch.where(dvalid, curr + j, Lb)
    return dict(tokens=vtok[None], start=curr, prefix_len=prefix[1] if prefix is not None else curr,
                win_lens=n_d.reshape(1), rows=j)  # fmt: skip


def verified(st: dict, T: dict, geo: ApdGeometry, a: dict, first: bool, l_v: torch.Tensor, vk_win: torch.Tensor,
             vv_win: torch.Tensor) -> None:  # fmt: skip
    """After the verifier's forward (logits l_v [Db + 1 (first) or Db, V_ar], window K/V): its K/V into the
    verifier's cache, the acceptance rule (target = argmax(R * l_D[:, :V_ar] + (1 - R) * l_AR), quirk Q2; the
    longest agreeing prefix, at least 1) and prev_logits (Q3 unless exact_prev). Adds accepted, nf_v to `a`."""
    dev = st["x"].device
    j, n_d, dvalid, x0, l_d, noise = a["j"], a["n_d"], a["dvalid"], a["x0"], a["l_d"], a["noise"]
    Db, Vq, Tmp = j.shape[0], geo.V_ar, T["temperature"]
    ext = l_v if first else torch.cat([st["prev"][None].to(l_v.dtype), l_v], 0)  # row 0: the prediction kept
    st["vk"].index_copy_(1, a["vdst"], vk_win[:, 0])
    st["vv"].index_copy_(1, a["vdst"], vv_win[:, 0])
    er = torch.arange(Db + 1, device=dev)
    read = (er < n_d) | ((er == n_d) & geo.exact_prev)
    nf_v = _first_bad(ext, read, st["curr"])
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
    stop = _stop_hit(x, T, geo)
    right = torch.minimum(curr + geo.M, T["L"]) if geo.M is not None else T["L"]
    left = (curr - geo.W - accepted + 1).clamp(min=0) if geo.W is not None else zero
    st.update(x=x, curr=curr, left=left, right=right)
    st["head"] = torch.stack([accepted, curr, left, right, eos, done, stop, a["nf_d"], nf_v, mask_committed,
                              outside]).long()  # fmt: skip
    return st, {"x0": x0}


def compiled_step(drafter, verifier, geo: ApdGeometry, Nb: int, Db: int):
    """apd_step after the prefill with the bucket's constants bound, with its own code object, for
    CompiledRounds.run (compile=True: one graph per (verifier, geometry, Nb, Db))."""
    from lopa_fast.decode.compiled import unique_code

    def step(st: dict, T: dict) -> tuple[dict, dict]:
        return apd_step(drafter, verifier, st, T, geo, Nb, Db, first=False)

    return unique_code(step, f"apd_step_{Nb}x{Db}")


def cache_rows(prompt_len: int, cfg) -> int:
    """Rows of the drafter's static cache of one request (kv_window given: its buffer Lb + the trash row; None:
    one unused row), e.g. a batch's KV pool slot (the APD spec's `cache_rows`)."""
    return quantized_length(prompt_len + cfg.max_new_tokens) + 1 if cfg.kv_window is not None else 1


class FastApd:
    """One APD / leftright request on the fast machinery. drafter: a Dream-family DecoderLM; verifier: a causal
    qwen2 DecoderLM or None; prompt: LongTensor [P] on drafter.device; cfg: bound, validated and checked by
    lopa_fast.api (knobs, prompt, the drafter / verifier pair); cache: None (the request allocates the drafter's
    static cache) or (k, v) views [num_layers, cache_rows(P, cfg), Hkv, D] of a batch's KV pool slot, zeroed.
    `run()` equals the reference's output.

    It is also the batch scheduler's driver (lopa_fast.decode.batch; the APD spec's `driver`): begin / next_bucket /
    prepare / forward_args / finish / read_head / after_round / result, with a round of two forwards (`forwards`:
    the drafter's, then, with a verifier, the verifier's over the drafts), each shared by every live request. Solo,
    `run()` steps through the same stages with the step in one call (`apd_step`, eager or compiled)."""

    name = "apd"
    mode = "full"  # the drafter forward's attention (the batch's first forward)

    def __init__(self, drafter, prompt: torch.Tensor, cfg, verifier=None, cache=None):
        from lopa_fast.ops import _backend

        self.drafter, self.verifier, self.cfg = drafter, verifier, cfg
        dev = self.dev = prompt.device
        P, L = prompt.numel(), prompt.numel() + cfg.max_new_tokens
        self.P, self.L = P, L
        Lb = quantized_length(L)
        R = cfg.apd_mixture_weight
        self.geo = ApdGeometry(
            Lb=Lb, W=cfg.kv_window, M=cfg.max_lookahead, verify=R is not None,
            K=cfg.tokens_per_step if cfg.tokens_per_step is not None else 1,
            V_ar=verifier.config.vocab_size if verifier is not None else 0, mask_id=cfg.mask_token_id,
            eos_id=cfg.eos_token_id, exact_prev=bool(cfg.exact_prev_logits),
            suppress_mask=bool(cfg.suppress_mask_token),
            nucleus=cfg.top_p is not None and cfg.top_p < 1, top_k=cfg.top_k,
            stop_lens=tuple(len(q) for q in cfg.stop or ()),
            attn_backend=_backend.resolve("branch_attention", None, dev),
            sampling=cfg.temperature > 0, single_temperature=bool(cfg.single_temperature),
            coupled_gumbel=bool(cfg.coupled_gumbel),
        )  # fmt: skip
        seed = keyed.resolve_seed(cfg.seed) if keyed.needs_draws(cfg) else 0  # as the reference's KeyedNoise
        self.tables = {"P": torch.tensor(P, device=dev), "L": torch.tensor(L, device=dev),
                       "stops": stop_table(cfg.stop, dev, min_rows=1), "seed": torch.tensor(seed, device=dev),
                       **{name: knob(v, dev) for name, v in apd_knobs(cfg).items()}}  # fmt: skip
        x = torch.full((Lb + 1,), cfg.mask_token_id, dtype=torch.long, device=dev)
        x[:P] = prompt
        self.st = {"x": x, "step": torch.zeros((), dtype=torch.long, device=dev)}  # step: dLLM forwards (keys)
        if cache is None:
            self.st.update(_cache("d", drafter, cache_rows(P, cfg)))
        else:
            self.use_cache(*cache)
        drafter.fused_layers()  # the merged-weight views, built or checked once per request (outside any graph)
        if R is not None:
            self.st.update(_cache("v", verifier, Lb + 1))
            self.st["prev"] = torch.zeros(verifier.config.vocab_size, dtype=verifier.dtype, device=dev)
            verifier.fused_layers()
        self.host_reads = 0
        self.compiled = self.cview = None
        from lopa_fast.decode.compiled import CompiledRounds, compile_wanted

        if compile_wanted(cfg, dev):  # alone: `_step`; in a batch (a pool slot): `batch_step`
            self.compiled = CompiledRounds.for_model(drafter, cfg)
            self.cview = self.compiled.view()

    @property
    def attn_backend(self) -> str:
        return self.geo.attn_backend

    def forwards(self, w: dict) -> tuple:
        """The forwards of the step `w` (`prepare`'s), in order, as (model, attention mask, attention backend): the
        drafter's, then (with a verifier) the verifier's, whose tokens are the drafter's drafts
        (lopa_fast.decode.batch runs each for every live request at once)."""
        out = ((self.drafter, "full", self.geo.attn_backend),)
        return out if not self.geo.verify else out + ((self.verifier, "causal", self.geo.attn_backend),)

    def use_cache(self, cache_k, cache_v) -> None:
        """The drafter's static cache: a batch's pool slot views (re-pointed when the pool grows)."""
        self.st["dk"], self.st["dv"] = cache_k, cache_v

    def _step(self, first: bool, curr: int, left: int, right: int) -> None:
        n, n_d = right - left, right - curr
        if self.compiled is not None and not first:
            Nb, Db = pow2_bucket(n), pow2_bucket(n_d)
            # the verifier is bound into the callable (which holds it alive), so its id keys the bucket
            key = ("apd", id(self.verifier), self.geo, Nb, Db)
            self.st, self.info = self.compiled.run(key, (Nb, Db), f"{Nb}x{Db}", lambda: compiled_step(
                self.drafter, self.verifier, self.geo, Nb, Db), self.drafter, self.st, self.tables, self.geo)
        else:  # eager (and the prefill step, whose verifier window is the whole draft)
            self.st, self.info = apd_step(self.drafter, self.verifier, self.st, self.tables, self.geo, n, n_d, first,
                                          prefix=(left, curr))  # fmt: skip

    # ---- a compiled / captured step in a batch (lopa_fast.decode.compiled_batch: one graph per bucket and batch size)
    def batch_step(self, first: bool, curr: int, left: int, right: int):
        """The coming step as a compiled batch's BatchStep (its two forwards, drafter then verifier, each shared by
        the group), or None when it runs eagerly (compile off, or the prefill step: as alone)."""
        if self.compiled is None or first:
            return None
        from lopa_fast.decode.compiled_batch import BatchStep

        if not getattr(self, "_owned", False):  # the batch copies lane results into these tensors from now on:
            self.st = {k: v if k in ("dk", "dv") else v.clone() for k, v in self.st.items()}  # own them (not the
            self._owned = True  # pool slot's drafter cache)
        geo, drafter, verifier, b = self.geo, self.drafter, self.verifier, self.geo.attn_backend
        Nb, Db = pow2_bucket(right - left), pow2_bucket(right - curr)

        def part(f: dict, k, v) -> dict:
            return dict(tokens=f["tokens"], start=f["start"], cache_k=k, cache_v=v, prefix_len=f["prefix_len"],
                        win_lens=f["win_lens"], bids=None, rows=f["rows"])  # fmt: skip

        def pre(st: dict, T: dict):
            a = draft_inputs(st, geo, Nb, Db, False, None)
            return part(a, st["dk"], st["dv"]), a

        if not geo.verify:  # leftright: the drafter's forward only

            def post(st: dict, T: dict, a: dict, l_d, k_win, v_win):
                drafted(st, T, geo, a, l_d, k_win, v_win)
                return commit(st, T, geo, a)

            mids, fwds = (), ((drafter, "full", b),)
        else:

            def mid(st: dict, T: dict, a: dict, l_d, k_win, v_win):
                drafted(st, T, geo, a, l_d, k_win, v_win)
                return part(verify_inputs(st, geo, a, False, None), st["vk"], st["vv"]), a

            def post(st: dict, T: dict, a: dict, l_v, k_win, v_win):
                verified(st, T, geo, a, False, l_v, k_win, v_win)
                return commit(st, T, geo, a)

            mids, fwds = (mid,), ((drafter, "full", b), (verifier, "causal", b))
        key = ("apd", id(verifier), geo, Nb, Db)  # as alone: the verifier is bound into the callable
        return BatchStep(self.compiled, key, (Nb, Db), f"apd_{Nb}x{Db}", ("apd", id(verifier), geo), pre, post,
                         "full", b, self.st, self.tables, self.cview, forwards=fwds, mids=mids)  # fmt: skip

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result for this request (its state, {"x0"}); then `read_head`."""
        self.st, self.info = st, info

    # ---- one eager step in stages, for lopa_fast.decode.batch (each forward shared by many requests)
    def prepare(self, first: bool, curr: int, left: int, right: int) -> dict:
        """The step's working dict on its exact window (eager shapes): the drafter's forward inputs first."""
        w = draft_inputs(self.st, self.geo, right - left, right - curr, first, (left, curr))
        w.update(first=first, prefix=(left, curr), phase=0)
        return w

    def forward_args(self, w: dict) -> dict:
        """This request's part of the coming forward's `forward_requests` (the arguments of the solo step's
        `forward_static`): the drafter's (phase 0), then the verifier's (phase 1, after `finish` of the drafter)."""
        st = self.st
        f, k, v = (w, st["dk"], st["dv"]) if w["phase"] == 0 else (w["verify"], st["vk"], st["vv"])
        return dict(tokens=f["tokens"], start=f["start"], cache_k=k, cache_v=v, prefix_len=f["prefix_len"],
                    win_lens=f["win_lens"], bids=None, rows=f["rows"])  # fmt: skip

    def finish(self, w: dict, logits, k_win, v_win) -> None:
        """After one of the step's forwards (this request's logits and window K/V): the drafter's -> the draft (and
        the verifier's inputs); the step's last forward -> the acceptance and the commit (`apd_step`'s stages)."""
        geo = self.geo
        if w["phase"] == 0:
            drafted(self.st, self.tables, geo, w, logits, k_win, v_win)
            if geo.verify:
                w["verify"], w["phase"] = verify_inputs(self.st, geo, w, w["first"], w["prefix"]), 1
                return
        else:
            verified(self.st, self.tables, geo, w, w["first"], logits, k_win, v_win)
        self.st, self.info = commit(self.st, self.tables, geo, w)

    def _read_head(self) -> list[int]:
        self.host_reads += 1
        return self.st["head"].tolist()  # the step's one device-to-host read

    def read_head(self) -> None:
        """The step's one host read (inside the caller's round_scope)."""
        self.head = dict(zip(HEAD_FIELDS, self._read_head()))

    def _refuse(self, head: dict, step: int) -> None:
        """The reference's errors, in its order, for the step just run (before any of its tokens is returned)."""
        if head["nonfinite_drafter"] >= 0:
            raise NonFiniteLogitsError(strategy="apd", round=step, position=head["nonfinite_drafter"],
                                       value="NaN/inf (drafter)")  # fmt: skip
        if head["outside_vocab"]:
            raise RuntimeError(
                f"apd: the drafter drafted a token id outside the verifier's vocabulary [0, {self.geo.V_ar}) "
                "(upstream's verifier cannot embed it either)"
            )
        if head["nonfinite_verifier"] >= 0:
            raise NonFiniteLogitsError(strategy="apd", round=step, position=head["nonfinite_verifier"],
                                       value="NaN/inf (verifier)")  # fmt: skip

    # ---- the request as a small state machine: run() drives one request, lopa_fast.decode.batch drives many
    def begin(self, on_round=None) -> None:
        """Start the clock and plan step 1. on_round: the progress hook (lopa_fast.progress.report_round), called
        after every step with the committed prefix (one extra host read per step, only with a hook)."""
        self.on_round = on_round
        self.stats = {"forwards": 0, "model_calls": 0, "dllm_forwards": 0, "verifier_forwards": 0}
        self.counts: list[int] = []
        self.trace = [] if self.cfg.return_trace else None
        self.curr, self.first, self.ended = self.P, True, False
        self.left, self.right = next_window(self.curr, 0, self.L, self.geo, self.first)
        self.eos_detected = self.mask_pending = False
        self.st.update(curr=torch.tensor(self.curr, device=self.dev), left=torch.tensor(self.left, device=self.dev),
                       right=torch.tensor(self.right, device=self.dev))  # fmt: skip
        self.clock = Clock(self.dev).__enter__()

    def next_bucket(self) -> tuple[bool, int, int, int] | None:
        """The coming step's (first, curr, left, right) (host ints), or None when the request has finished (done,
        a stop sequence, or the round cap: said in stats). Raises the reference's error when the last step
        committed a drafted mask id."""
        if self.ended:
            return None
        if self.stats["forwards"] >= self.cfg.max_rounds:
            round_cap_hit(self.cfg, self.stats, "apd")
            return None
        if self.mask_pending:  # the reference finds the committed mask in this step's window
            raise RuntimeError(
                f"apd: the window [{self.left}, {self.right}) holds more masks than the {self.right - self.curr} "
                "ahead of the decoding position: the drafter emitted the mask token as a draft token (upstream's "
                "apd_sample misaligns the draft here). Pass suppress_mask_token=True"
            )
        return self.first, self.curr, self.left, self.right

    def after_round(self) -> None:
        """Counters, the reference's errors, the trace entry, the progress hook and the end tests of the step just
        run (outside the step's scope)."""
        cfg, geo, stats, head, P, L = self.cfg, self.geo, self.stats, self.head, self.P, self.L
        curr, left, right = self.curr, self.left, self.right
        stats["dllm_forwards"] += 1
        stats["verifier_forwards"] += geo.verify
        stats["forwards"] += 1
        self._refuse(head, stats["forwards"])
        accepted = head["accepted"]
        if self.trace is not None:
            x0 = self.info["x0"][: right - curr].tolist()
            self.trace.append({
                "round": stats["forwards"], "window_start": left - P, "window_len": right - left, "draft": x0,
                "num_accept": accepted,
                "accepted": [[curr + q - P, x0[q]] for q in range(min(accepted, L - curr))],
            })  # fmt: skip
        self.counts.append(accepted)
        if self.on_round is not None:
            report_round(self.on_round, self.st["x"][P:L], geo.mask_id, cfg.max_new_tokens, stats["forwards"])
        self.curr, self.left, self.right = head["curr"], head["left"], head["right"]
        self.first = False
        self.mask_pending = bool(head["mask_committed"])
        self.eos_detected |= bool(head["eos"])
        if head["stop"]:  # a stop sequence in the committed prefix (the API cuts the output before it)
            stats["stopped"] = True
            self.ended = True
        elif head["done"]:
            self.ended = True

    def run(self, on_round=None) -> GenerateOutput:
        """Decode the request alone (see `begin` for on_round)."""
        self.begin(on_round)
        while (b := self.next_bucket()) is not None:
            with round_scope():
                self._step(*b)
                self.read_head()
            self.after_round()
        return self.result()

    def result(self) -> GenerateOutput:
        """Stop the clock; the tokens, the counters and stats, the trace."""
        self.clock.__exit__(None, None, None)
        cfg, stats, counts = self.cfg, self.stats, self.counts
        ids = self.st["x"][self.P : min(self.curr, self.L)].tolist()
        stats["model_calls"] = stats["dllm_forwards"] + stats["verifier_forwards"]
        stats["acceptance_counts"] = counts
        stats["mean_accepted"] = sum(counts) / len(counts) if counts else 0.0
        stats["eos_detected"] = self.eos_detected
        stats["host_reads"] = self.host_reads
        stats["host_reads_per_round"] = self.host_reads / max(1, stats["forwards"])
        if self.compiled is not None:
            stats.update(self.compiled.stats(self.cview))
        finalize_stats(stats, ids, cfg.eos_token_id, cfg.mask_token_id, self.clock.seconds, steps_plus_one=False)
        return GenerateOutput(ids, stats, self.trace)


def _cache(prefix: str, model, rows: int) -> dict:
    """A static K/V buffer pair {prefix}k / {prefix}v [layers, rows, Hkv, D] for one model."""
    c = model.config
    shape = (c.num_layers, rows, c.num_kv_heads, c.head_dim)
    z = lambda: torch.zeros(shape, dtype=model.dtype, device=model.device)  # noqa: E731
    return {prefix + "k": z(), prefix + "v": z()}


def generate(model, prompt: torch.Tensor, cfg, verifier=None, on_round=None) -> GenerateOutput:
    """APD / leftright on the fast backend (cfg bound and covered: temperature 0; lopa_fast.api checked the pair).
    on_round: the progress hook, called after every step (lopa_fast.progress.report_round)."""
    return FastApd(model, prompt, cfg, verifier).run(on_round)


__all__ = ["ApdGeometry", "FastApd", "HEAD_FIELDS", "apd_step", "cache_rows", "generate", "next_window"]
