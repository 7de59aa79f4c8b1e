"""The fast D2F / LoPA decoder: every branch of a round in ONE batched forward, round state on the device.

Semantics are exactly those of `lopa_fast.reference.{d2f,lopa}` (docs/semantics.md sections 2-3); this
module only changes *how* a round is computed:

* Geometry is static per request. Positions [0, P) are the prompt (block 0); generated block j >= 1
  covers [P + (j-1)*bs, P + j*bs). The token rows `x[slot, L]` (L = P + max_new_tokens) are allocated
  once and pre-filled with the mask id, so appending a block is `nblk += 1` (no concatenation).
* Branches live in slots of fixed tensors (NB = k+1 slots for branching_factor k >= 2, one for k = 1):
  slots [0, n_look) hold the lookaheads in rank order and slot n_look the anchor, which is exactly the
  order upstream verifies them in (lookaheads by branch id, anchor last), so "first maximum" is
  upstream's tie rule for the winner. Alive slots are always a prefix [0, nA).
* Block tables are small tensors: nblk [NB] (generated blocks present), state [NB, G+1] (0 active,
  1 to_cache, 2 in_cache), complete [NB, G+1] (is_complete), eos [NB], creation confidence [NB].
  Mask counts are recounted from x (they equal upstream's recorded counts: x only changes at a fill /
  spawn, after which upstream recounts every active block).
* A round: grow / activation / done / shared-prefix end / to-cache span on the device -> ONE host read
  of a 7-int plan (done flag, alive branches, window start, cached span u, window length, LM-head rows,
  ragged flag) -> one `forward_window` over all branches with the LM head only on the rows whose
  (shifted) prediction lands on a masked position plus row u-1 (the next `last_logit`) -> token stats
  on those rows -> threshold accept, fallback, branch scores, winner, anchor fill, lookahead spawn and
  the to_cache transitions as tensor ops -> `cache.commit_window(winner, u)` from the forward's own K/V.
  No Python loop runs over branches, blocks or positions inside a round.

The static KV cache holds the committed prefix once; branches never copy it. Under full attention the
to-cache span's K/V is branch-specific and only the winner's is committed (Commit-Winner-Cache); under
the block-causal mask the span only sees the prefix and itself, so every branch computes the same K/V
and committing the winner's is the same as committing anyone's.
"""
from __future__ import annotations

import os

import torch

from lopa_fast.decode.syncs import round_scope
from lopa_fast.output import Clock, GenerateOutput, finalize_stats, round_cap_hit
from lopa_fast.contracts import lowest_k_table

ACTIVE, TO_CACHE, IN_CACHE = 0, 1, 2


def token_stats(logits: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(conf [R] fp32, x0 [R] int64, p [R] fp32) for logits rows [R, V] at temperature 0.

    CPU (and any top-p / top-k run): the reference decoders' own row-wise formulas
    (lopa_fast.reference.common.token_stats: fp32 softmax, argmax/max, the sampling_strategy confidence),
    so the fast path is token-exact with them. On CUDA the fused `lopa_fast.ops.confidence` kernel
    computes the same statistics (p = exp(x - lse): within ~1e-6 of softmax, not bitwise, which is why the
    CPU parity path does not use it); set LOPA_FAST_DECODE_OPS=0 to keep the reference formulas on GPU.
    """
    use_ops = os.environ.get("LOPA_FAST_DECODE_OPS", "1") != "0"
    if logits.is_cuda and use_ops and cfg.top_p is None and cfg.top_k is None:
        from lopa_fast import ops

        c = ops.confidence(logits, suppress_token=cfg.mask_token_id if cfg.suppress_mask_token else None)
        conf = {"default": c.p_max, "margin": c.margin, "neg_entropy": c.neg_entropy}[cfg.sampling_strategy]
        return conf, c.token, c.p_max
    from lopa_fast.sampling import token_stats as _ref_stats

    return _ref_stats(
        logits,
        temperature=0.0,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        sampling_strategy=cfg.sampling_strategy,
        suppress_token=cfg.mask_token_id if cfg.suppress_mask_token else None,
    )


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[i] for a 0-d device index without a host read (indexing with a 0-d tensor would call .item())."""
    return t.index_select(0, i.reshape(1)).squeeze(0)


class FastDecoder:
    """One request of D2F (k = 1) or LoPA (k >= 2) decoding with all branches batched.

    model: DecoderLM; prompt: LongTensor [P] on model.device; cfg: a bound GenerateConfig.
    `run()` returns a GenerateOutput equal (tokens, forwards) to the reference backend's.
    """

    def __init__(self, model, prompt: torch.Tensor, cfg, branching_factor: int, name: str):
        self.model, self.cfg, self.name = model, cfg, name
        dev = prompt.device
        self.dev = dev
        self.P = P = prompt.numel()
        self.bs = bs = cfg.block_size
        self.G = G = cfg.max_new_tokens // bs
        self.L = L = P + G * bs
        self.k = k = branching_factor
        self.n_look = k if k >= 2 else 0  # lookaheads spawned per round (upstream: branching_factor)
        self.NB = NB = self.n_look + 1
        self.mask_id = cfg.mask_token_id
        self.eos_id = cfg.eos_token_id
        self.shift = bool(model.logits_shift)
        self.mode = "full" if cfg.use_full_attention else "block_causal"

        # static geometry tables
        j = torch.arange(G + 1, device=dev)
        self.jidx = j
        self.bstart = torch.where(j == 0, 0, P + (j - 1) * bs)
        self.bend = torch.where(j == 0, P, P + j * bs)
        self.btotal = self.bend - self.bstart
        p = torch.arange(L, device=dev)
        self.pos = p
        self.pos_block = torch.where(p < P, 0, 1 + (p - P).div(bs, rounding_mode="floor"))
        self.onehot = self.pos_block[:, None] == j[None, :]  # [L, G+1]
        self.slot = torch.arange(NB, device=dev)
        self.ktable = lowest_k_table(L, cfg.branch_topp).to(dev, torch.long)
        # decoded-fraction tests as lookup tables over a block's mask count, computed with Python floats
        # exactly as upstream ((total - mc) / total >= tau). The prompt block has mc = 0 -> fraction 1.0,
        # the same entry as a full generated block, so one table of bs+1 entries serves every block.
        frac = [(bs - c) / bs for c in range(bs + 1)]
        self.tab_add = torch.tensor([f >= cfg.block_add_threshold for f in frac], device=dev)
        self.tab_act = torch.tensor([f >= cfg.decoded_token_threshold for f in frac], device=dev)

        # round state (device)
        self.x = torch.full((NB, L), self.mask_id, dtype=torch.long, device=dev)
        self.x[:, :P] = prompt
        self.nblk = torch.zeros(NB, dtype=torch.long, device=dev)
        self.state = torch.zeros(G + 1, dtype=torch.long, device=dev)  # shared by every branch (see _plan)
        self.state[0] = TO_CACHE
        self.complete = torch.zeros(NB, G + 1, dtype=torch.bool, device=dev)
        self.complete[:, 0] = True
        self.eos = torch.zeros(NB, dtype=torch.bool, device=dev)
        self.alive = self.slot == 0  # round 1: the prompt-only anchor
        self.cconf = torch.ones(NB, dtype=torch.float64, device=dev)
        self.look_pos = torch.full((NB,), -1, dtype=torch.long, device=dev)  # lookahead position, -1 anchor
        self.last_logit = None  # [V] raw logit saved with the last committed span
        self.cache = model.new_cache(L)

        # device counters (read once at the end)
        z = lambda: torch.zeros((), dtype=torch.long, device=dev)  # noqa: E731
        self.c_thresh, self.c_fallback, self.c_eos_fills = z(), z(), z()
        self.c_multi, self.c_look_wins, self.c_growth_split, self.c_ragged = z(), z(), z(), z()
        self.c_winner_grew, self.c_max_branches = z(), z()
        self.host_reads = 0

    # ------------------------------------------------------------------------------------------------
    def _plan(self):
        """Grow, activation, termination, shared-prefix end and the to-cache span, all on the device.

        Returns a dict of device tensors and the host plan [done, nA, s, u, n, R, ragged] (one read).
        """
        G, bs, P = self.G, self.bs, self.P
        alive, nblk, state = self.alive, self.nblk, self.state
        ismask_all = self.x == self.mask_id  # [NB, L]; positions past a row's length hold masks too
        mc = torch.nn.functional.pad(ismask_all[:, P:].view(self.NB, G, bs).sum(-1), (1, 0))  # [NB, G+1]
        # 1. grow: the last block's decoded fraction >= tau_add (lookup table, exact Python float maths)
        last_mc = mc.gather(1, nblk[:, None]).squeeze(1)
        grow = alive & (nblk < G) & ~self.eos & self.tab_add[last_mc]
        nblk = self.nblk = nblk + grow
        exists = self.jidx[None, :] <= nblk[:, None]  # [NB, G+1]
        # 2. activation: block j >= tau_act decoded -> block j+1 fully activated (sticky, per branch)
        self.complete[:, 1:] |= self.tab_act[mc[:, :-1]] & exists[:, 1:]
        # 3. done: no mask and no active block
        active = exists & (state == ACTIVE)[None, :]
        lens = P + nblk * bs
        ismask = ismask_all & (self.pos[None, :] < lens[:, None]) & alive[:, None]
        done = alive & ~ismask.any(1) & ~active.any(1)
        rem = alive & ~done
        # 4. shared-prefix end: the leading run of non-active blocks. The block-state row is shared by all
        # branches (every new branch gets the same table at spawn; growth appends active blocks), and a
        # non-active block never holds a mask, so upstream's min over branches is this one run.
        lead = (state != ACTIVE).cumprod(0).sum()
        spe = self.bend[lead - 1]
        # 5. the to-cache span: to_cache blocks (all end <= spe), contiguous from the cache end
        tc = state == TO_CACHE
        has_tc = tc.any()
        s = torch.where(has_tc, torch.where(tc, self.bstart, self.L).min(), spe)
        u = torch.where(has_tc, torch.where(tc, self.bend, 0).max() - s, 0)
        wl = lens - s
        n = torch.where(rem, wl, 0).max()
        # the layout branch (the anchor if still running, else the first running one): its row length
        # tells branch-specific growth apart (counters only, updated in _round: a capped round counts none)
        nA = alive.sum()
        first_rem = torch.where(rem, self.slot, self.NB - 1).min()
        lay = torch.where(_at(rem, nA - 1), nA - 1, first_rem)
        ragged = (torch.where(alive, wl, n) != n).any()
        # LM-head rows: raw row q is needed iff it predicts a masked position (q+1 with the Dream shift,
        # q without), or q = s+u-1, the last cached position (its logit becomes last_logit); q >= s.
        if self.shift:
            last = (self.pos == s + u - 1) & (u > 0)
            need = (torch.nn.functional.pad(ismask[:, 1:], (0, 1)) | last[None, :]) & alive[:, None]
            need &= (self.pos >= s)[None, :]
        else:
            need = ismask
        R = need.sum()
        head = torch.stack([~rem.any(), nA, s, u, n, R, ragged])
        self.host_reads += 1
        plan = head.tolist()  # the round's one device-to-host read
        return dict(exists=exists, active=active, rem=rem, done=done, spe=spe, tc=tc, need=need,
                    ismask=ismask, lens=lens, wl=wl, lay=lay), plan

    # ------------------------------------------------------------------------------------------------
    def _round(self, d, nA: int, s: int, u: int, n: int, R: int, ragged: bool, trace):
        cfg = self.cfg
        dev = self.dev
        win = slice(s, s + n)
        tokens = self.x[:nA, win]
        rem, lens = d["rem"], d["lens"]
        self.c_growth_split += (rem & (lens != _at(lens, d["lay"]))).any()
        self.c_max_branches = torch.maximum(self.c_max_branches, rem.sum())
        bids = None
        if self.mode == "block_causal":
            bids = self.pos_block[win][None, :].expand(nA, n)
        win_lens = d["wl"][:nA] if ragged else None
        need_flat = d["need"][:nA, win].reshape(-1)
        # the needed rows in ascending flat order, without a host read: a stable sort puts them first
        rows = torch.sort((~need_flat).to(torch.uint8), stable=True).indices[:R]
        logits = self.model.forward_window(
            tokens, cache=self.cache, start=s, mask=self.mode, block_ids=bids, win_lens=win_lens, rows=rows
        )  # [R, V] raw
        V = logits.shape[-1]
        # stats table row 0 = the stale last_logit (predicts window position 0 under the shift)
        if self.shift:
            first = self.last_logit if self.last_logit is not None else logits.new_ones(V)
            table = torch.cat([first[None, :], logits], 0)
        else:
            table = logits
        conf, x0, p = token_stats(table, cfg)
        csum = need_flat.long().cumsum(0).view(nA, n)  # 1-based rank of each needed raw row
        if self.shift:
            sidx = torch.zeros(nA, n, dtype=torch.long, device=dev)
            sidx[:, 1:] = csum[:, :-1]
        else:
            sidx = (csum - 1).clamp(min=0)
        c_w = conf[sidx]  # [nA, n]: the confidence predicting window position i, per branch

        # ---- branch scores (every alive branch): mean of the lowest k = max(1, int(m * topp)) confidences
        # over all its masks (all >= spe); 1.0 with none; 1.0 outright with nothing past spe
        i = self.pos[:n]
        masked = d["ismask"][:nA, win]
        m = masked.sum(1)
        kk = self.ktable[m]
        asc = torch.sort(torch.where(masked, c_w, float("inf")), dim=1).values
        low = torch.where(i[None, :] < kk[:, None], asc, 0.0).sum(1) / kk
        future = torch.where(m > 0, low.double(), 1.0)
        alpha = float(max(0.0, min(1.0, cfg.selection_conf_alpha)))
        score = future if alpha == 0.0 else alpha * self.cconf[:nA] + (1.0 - alpha) * future
        score = torch.where(d["lens"][:nA] <= d["spe"], 1.0, score)
        keyw = torch.where(d["rem"][:nA], score, float("-inf"))
        W = torch.where(keyw == keyw.max(), self.slot[:nA], nA).min()  # first max = upstream's tie order

        # ---- commit the winner's span from this forward's K/V; its raw row u-1 is the next last_logit
        if u > 0:
            self.cache.commit_window(W, u)
            if self.shift:
                self.last_logit = _at(table, _at(csum[:, u - 1], W))

        # ---- the D2F fill rule on the winner only (its own block states and logits)
        W1 = W.reshape(1)
        sW, mW = torch.stack([sidx, masked.long()]).index_select(1, W1).unbind(0)
        sW, mW = sW[0], mW[0].bool()
        cW, tokW, pW = conf[sW], x0[sW], p[sW]  # [n]
        actWb = d["active"].index_select(0, W1)[0]  # [G+1]
        onehot = self.onehot[win]  # [n, G+1]: window position i lies in block j
        candW = mW & actWb[self.pos_block[win]]
        thr = candW & (pW > cfg.skip_threshold)  # strict, as upstream
        # fallback: a fully activated active block with masks and no accept fills its most confident
        # mask (first index on exact ties)
        cand_b = candW[:, None] & onehot
        key = torch.where(cand_b, cW[:, None], float("-inf"))
        best = key.max(0).values
        firstpos = torch.where(cand_b & (key == best), i[:, None], n).min(0).values  # [G+1]
        need_fb = _at(self.complete, W) & actWb & cand_b.any(0) & ~(thr[:, None] & onehot).any(0)
        fb = ((firstpos[None, :] == i[:, None]) & need_fb[None, :]).any(1)
        accW = thr | fb
        xW = self.x.index_select(0, W1)[0]
        xW[s : s + n] = torch.where(accW, tokW, xW[s : s + n])
        eos_hit = accW & (tokW == self.eos_id) if self.eos_id is not None else torch.zeros_like(accW)
        eosW = self.eos.index_select(0, W1)[0] | eos_hit.any()
        self.c_thresh += thr.sum()
        self.c_fallback += fb.sum()
        self.c_eos_fills += eos_hit.sum()
        is_look = W != nA - 1
        self.c_winner_grew += _at(d["lens"], W) != _at(d["lens"], d["lay"])
        self.c_look_wins += is_look.long()
        # tokens accepted this round: the anchor-rule fills plus the winning lookahead's token
        self.c_multi += ((accW.sum() + is_look.long()) >= 2).long()

        # ---- winner's block table after the fill
        nblkW, stW, cpW = self.nblk.index_select(0, W1), self.state, self.complete.index_select(0, W1)
        existsW = d["exists"].index_select(0, W1)[0]
        mcW = torch.nn.functional.pad((xW[self.P :] == self.mask_id).view(self.G, self.bs).sum(-1), (1, 0))
        base_done = actWb & (mcW == 0)  # upstream's base_completed_blocks

        # ---- spawn: lookaheads at the winner's top-n_look remaining masks (ranked by c, stable)
        NB, L = self.NB, self.L
        x_new = xW[None, :].expand(NB, L).clone()
        eos_new = eosW.expand(NB).clone()
        cconf_new = torch.ones(NB, dtype=torch.float64, device=dev)
        if self.n_look > 0:
            rest = candW & ~accW
            keyl = torch.where(rest, cW, float("-inf"))
            order = torch.sort(keyl, descending=True, stable=True).indices[: self.n_look]
            valid = rest[order]
            if order.numel() < self.n_look:  # fewer window positions than lookaheads
                pad = self.n_look - order.numel()
                order = torch.cat([order, order.new_zeros(pad)])
                valid = torch.cat([valid, valid.new_zeros(pad)])
            n_valid = valid.sum()
            lpos = s + order
            ltok = tokW[order]
            # scatter the lookahead tokens (flat index slot * L + pos; an invalid slot rewrites its own
            # token). scatter_ instead of x[slot, pos] = ...: index_put costs ~0.4 ms here on CPU
            flat = self.slot[: self.n_look] * L + lpos
            x_flat = x_new.view(-1)
            x_flat.scatter_(0, flat, torch.where(valid, ltok, x_flat.gather(0, flat)))
            cconf_new[: self.n_look] = torch.where(valid, cW[order].double(), 1.0)
            if self.eos_id is not None:
                eos_new[: self.n_look] |= valid & (ltok == self.eos_id)
        else:
            n_valid = torch.zeros((), dtype=torch.long, device=dev)
        alive_new = self.slot <= n_valid

        # ---- new block tables: cached span -> in_cache; a block becomes to_cache only if the anchor rule
        # completed it (base_done), it has no mask, and every lower block is non-active after its own
        # update (upstream's in-order loop = a cumulative AND). A lookahead token always lands on a mask of
        # a block the anchor did NOT complete, so every new branch gets the same table: compute it once.
        st = torch.where(d["tc"], IN_CACHE, stW) if u > 0 else stW
        act = existsW & (st == ACTIVE)
        retire = act & base_done
        chain = (~act | retire).long().cumprod(0).bool()
        st = torch.where(retire & chain, TO_CACHE, st)

        self.x = x_new
        self.state = st
        self.nblk = nblkW.expand(NB).clone()
        self.complete = cpW.expand(NB, -1).clone()
        self.eos = eos_new
        self.cconf = cconf_new
        self.alive = alive_new

        if trace is not None:  # host reads, only when a trace is asked for
            lens = d["wl"][:nA].tolist()
            look = [None if q < 0 else q - self.P for q in self.look_pos[:nA].tolist()]
            acc = [[s + q - self.P, t] for q, t in zip(accW.nonzero()[:, 0].tolist(), tokW[accW].tolist())]
            w = int(W)
            if look[w] is not None:
                acc.append([look[w], int(xW[look[w] + self.P])])
            trace.append({
                "round": None, "window_start": s - self.P, "cached": u,
                "branches": [{"score": float(score[b]), "lookahead": look[b], "window_len": lens[b]}
                             for b in range(nA)],
                "winner": w, "accepted": sorted(acc),
            })
        if trace is not None:  # the lookahead position of each new branch, for the next round's trace
            lp = torch.full((NB,), -1, dtype=torch.long, device=dev)
            if self.n_look > 0:
                lp[: self.n_look] = torch.where(valid, lpos, -1)
            self.look_pos = lp

    # ------------------------------------------------------------------------------------------------
    def run(self) -> GenerateOutput:
        cfg = self.cfg
        stats = {"forwards": 0, "model_calls": 0}
        trace = [] if cfg.return_trace else None
        out_slot = 0
        with Clock(self.dev) as clock:
            while True:
                with round_scope():
                    d, (done, nA, s, u, n, R, ragged) = self._plan()
                    if done:
                        # every alive branch finished in the same round (lookaheads always keep an
                        # active block, so a finished round holds just the anchor): upstream returns
                        # the first finished branch in list order
                        out_slot = int(torch.where(d["done"], self.slot, self.NB).min()) if nA > 1 else 0
                        break
                    if stats["forwards"] >= cfg.max_rounds:
                        round_cap_hit(cfg, stats, self.name)
                        out_slot = int(d["lay"])  # the running anchor (else the first running branch)
                        break
                    self._round(d, nA, s, u, n, R, bool(ragged), trace)
                    stats["forwards"] += 1
                    stats["model_calls"] += 1
                    if trace is not None:
                        trace[-1]["round"] = stats["forwards"]
                        if ragged:
                            self.c_ragged += 1
                    elif ragged:
                        self.c_ragged += 1
        length = self.P + int(self.nblk[out_slot]) * self.bs
        ids = self.x[out_slot, self.P : length].tolist()
        stats.update(
            accepted_by_threshold=int(self.c_thresh),
            fallback_fills=int(self.c_fallback),
            eos_fills=int(self.c_eos_fills),
            multi_token_rounds=int(self.c_multi),
            eos_detected=bool(self.eos[out_slot]),
        )
        if self.name == "lopa":
            stats.update(
                lookahead_wins=int(self.c_look_wins),
                branch_growth=int(self.c_growth_split),
                winner_grew=int(self.c_winner_grew),
                max_branches=int(self.c_max_branches),
                ragged_rounds=int(self.c_ragged),
            )
        stats["host_reads"] = self.host_reads
        stats["host_reads_per_round"] = self.host_reads / max(1, stats["forwards"])
        # memory: the prefix cache is allocated once (independent of k); only the window scratch grows with k
        c = self.cache
        stats["kv_prefix_bytes"] = c.k.numel() * c.k.element_size() * 2
        stats["kv_window_bytes"] = c.win_k.numel() * c.win_k.element_size() * 2
        if self.dev.type == "cuda":
            stats["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.dev)
        finalize_stats(stats, ids, cfg.eos_token_id, self.mask_id, clock.seconds, steps_plus_one=True)
        return GenerateOutput(ids, stats, trace)


def run_fast(model, prompt, cfg, branching_factor: int, name: str) -> GenerateOutput:
    """Run one request on the fast decoder (cfg bound and covered: lopa_fast.api checked both)."""
    return FastDecoder(model, prompt, cfg, branching_factor, name).run()
