"""Branch parallelism's round (lopa_fast.distributed): the branch slots of a D2F / LoPA round split over ranks.

A distributed request (`generate(..., backend="fast", distributed=True)`) is decoded by every rank of the group.
Every rank holds the whole round state and the whole static prefix KV cache and runs the fast round's stages
(lopa_fast.strategies.lopa.round) with one change: the forward covers only its share of the round's alive slots
(`slot_share`: contiguous, the first nA % world ranks one more; any k, nothing dropped), and the token statistics
of the needed LM-head rows are exchanged in ONE all_gather per round (`rank_message` / `gathered_stats`: never
logits), after which every rank selects, fills, spawns and plans on the same table (`after_exchange`). Dream's
`last_logit` row stays with the winner's owner (it sends that row's statistics in its header); the winner's span
K/V is broadcast by its owner under full attention, and nothing moves under the block-causal mask (`_commit`).
The round's one host read carries the winner and the gathered error flag. Each step, the message layout, the
keyed sampler at T > 0, compile=True and its costs: docs/distributed.md. Faults (the error flag of the
all_gather, DistributedError naming the failing rank): lopa_fast.distributed.

The round is a driver of the one loop (lopa_fast.decode.driver; `DistributedDecoder`, a FastDecoder): the scheduler
(lopa_fast.decode.batch, a batch of one: distributed requests never share a forward) runs its eager round, whose one
"forward" is `_Exchange`: this rank's share, the all_gather, the selection and the span commit (`_round`); its
`finish` has nothing left to do, and `read_head` reads the head the exchange left (still one read per round).
compile=True: each decode round is two graphs per bucket around the collectives (`compiled_share`,
`after_exchange`: `CompiledRounds.call`, torch.compile also on CUDA, never captured); round 1 (the prefill) is eager.
NCCL: written (device = cuda:local_rank) but not run here (at most one GPU; NCCL refuses two ranks on one device);
the tests run gloo on CPU.
"""
from __future__ import annotations

import torch

from lopa_fast import ops
from lopa_fast.strategies.lopa import round as rnd
from lopa_fast.strategies.lopa import round_stats
from lopa_fast.strategies.lopa.driver import FastDecoder, round_key
from lopa_fast.distributed import Comm, check_group, request_fingerprint
from lopa_fast.errors import DistributedError, KnobError

# int32 words before the statistics: error flag, needed rows, first non-finite flat row (or -1), holds the
# last_logit row, that row's (conf, p, x0) under Dream's shift (zeros without)
HEADER = 7


def slot_share(n: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi): rank's contiguous share of n slots, the first n % world ranks taking one more (empty when
    rank >= n)."""
    q, r = divmod(n, world)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (rank < r)


def slot_owner(slot: int, n: int, world: int) -> int:
    """The rank whose share of n slots holds `slot`."""
    return next(r for r in range(world) if slot_share(n, world, r)[0] <= slot < slot_share(n, world, r)[1])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their int32 bit patterns (exact round trip through an int32 message)."""
    return t.float().contiguous().view(torch.int32)


# ----------------------------------------------------------------- the round's stages around the exchange
# Pure functions of device tensors (no host read; static shapes for fixed arguments): eager rounds call them
# directly, compile=True compiles `compiled_share` and `after_exchange` once per bucket (CompiledRounds.call).
def share_forward(model, st: dict, geo, w: dict, slots, valid, n_rows: int, prefix_len):
    """The forward of window slots `slots` [m] on their needed rows (valid [m]: the slots that are this rank's
    own; the others run for their K/V or as padding and contribute no row). Returns (logits [n_rows, V] (with
    geo.fused_head the final-normed hidden rows [n_rows, H]: `rank_message` applies the fused head), k_win,
    v_win [layers, m, Nb, Hkv, D], flat [n_rows]: the rows' flat window rows slot * Nb + column, the real ones
    first in ascending order, n_real: 0-d, how many are real)."""
    Nb = w["win_pos"].shape[0]
    need = w["need"].index_select(0, slots) & valid[:, None]  # [m, Nb]
    rows = torch.sort((~need.reshape(-1)).to(torch.uint8), stable=True).indices[:n_rows]
    bids = None if w["block_ids"] is None else w["block_ids"].index_select(0, slots)
    logits, k_win, v_win = model.forward_static(
        w["tokens"].index_select(0, slots), st["start"], st["cache_k"], st["cache_v"], prefix_len,
        w["win_lens"].index_select(0, slots), bids, geo.mode, rows, attn_backend=geo.attn_backend,
        output="hidden" if geo.fused_head else "logits",
    )
    flat = slots.index_select(0, rows // Nb) * Nb + rows % Nb
    return logits, k_win, v_win, flat, need.sum()


def rank_message(st: dict, T: dict, geo, cfg, Nb: int, Rmax: int, holder, logits, flat, n_real, head=None):
    """This rank's int32 message [HEADER + 3 * Rmax]: error flag 0, n_real (its needed rows), the first non-finite
    flat row of them (or -1), `holder` (bool or 0-d: it holds the last_logit row), the (conf, p, x0) of its
    last_logit row under the shift (zeros without), then (conf, p, x0) of its logits rows [n, V] (flat window
    rows `flat` [n], n <= Rmax; n may be 0). The statistics are finish_round's: the same table (row 0 =
    last_logit under the shift) and, at T > 0, the keyed sampler's keys, a function of the positions only (no
    slot field), so a rank draws for any slot's row what the single process draws. With geo.fused_head, `logits`
    are the hidden rows [n, H] and head the LM-head weight [V, H]: the statistics are `fused_head_stats`' (no fp32
    [n, V] logits), the guard reads its finite flags.
    Returns (msg, rows): rows holds the raw logits rows the winner's owner takes its next last_logit from (Dream's
    shift): `logits` itself, or with the fused head the logits it kept from its one pass over the head weight
    (model dtype; no GEMV over the head afterwards)."""
    dev = st["x"].device
    n = logits.shape[0]
    msg = torch.zeros(HEADER + 3 * Rmax, dtype=torch.int32, device=dev)
    msg[0] = 0
    msg[1] = n_real
    msg[3] = holder
    rows = logits
    if geo.fused_head:
        if n == 0 and not geo.shift:
            msg[2] = -1
            return msg, rows
        # (with no row of its own, only the last_logit row: `fused_head_stats` of the empty hidden rows)
        fused = round_stats.fused_head_stats(st, cfg, geo, logits, head)
        msg[2] = ops.first_bad(fused.finite, flat, n_real, geo.NB * Nb, check=False) if n else -1
        conf, x0, p = fused.table
        rows = fused.logits if geo.shift else logits
    else:
        table = torch.cat([st["last_logit"][None, :].to(logits.dtype), logits], 0) if geo.shift else logits
        t = round_stats.temperature(T, cfg)
        msg[2] = ops.first_nonfinite(logits, flat, n_real, geo.NB * Nb, t) if n else -1
        if table.shape[0] == 0:
            return msg, rows
        # None at T = 0; with no row of its own a rank still keys its last_logit row (row_keys' row 0)
        keys = round_stats.row_keys(st, T, flat if n else flat.new_zeros(1), st["start"], Nb, geo.shift, cfg)
        keys = None if keys is None else keys[: table.shape[0]]
        conf, x0, p = round_stats.token_stats(table, T, cfg, geo.use_conf_kernel, keys)
    k = int(geo.shift)
    if geo.shift:
        msg[4], msg[5], msg[6] = _bits(conf[:1])[0], _bits(p[:1])[0], x0[0].to(torch.int32)
    msg[HEADER : HEADER + n] = _bits(conf[k:])
    msg[HEADER + Rmax : HEADER + Rmax + n] = _bits(p[k:])
    msg[HEADER + 2 * Rmax : HEADER + 2 * Rmax + n] = x0[k:].to(torch.int32)
    return msg, rows


def gathered_stats(parts: torch.Tensor, geo, Nb: int, Rmax: int):
    """parts [world, HEADER + 3 * Rmax] -> (conf, x0, p): the single-process statistics table (the last_logit row
    of the holding rank first under the shift, then the needed rows in ascending flat order), the first
    non-finite flat row (or -1), the error flag (0-d); no host read."""
    world, dev = parts.shape[0], parts.device
    NB = geo.NB
    cnt = parts[:, 1].long()
    nf = parts[:, 2].long()
    nf = torch.where(nf >= 0, nf, NB * Nb).min()
    nonfinite = torch.where(nf == NB * Nb, -1, nf)
    real = (torch.arange(Rmax, device=dev)[None, :] < cnt[:, None]).reshape(-1)
    order = torch.sort((~real).to(torch.uint8), stable=True).indices  # real rows first, rank order kept
    body = parts[:, HEADER:].reshape(world, 3, Rmax).transpose(0, 1).reshape(3, -1)
    conf = body[0].index_select(0, order).contiguous().view(torch.float32)
    p = body[1].index_select(0, order).contiguous().view(torch.float32)
    x0 = body[2].index_select(0, order).long()
    if geo.shift:  # the holder's last_logit statistics: table row 0
        h = parts[:, 3].argmax().reshape(1)
        head = parts.index_select(0, h)[0]
        conf = torch.cat([head[4:5].contiguous().view(torch.float32), conf])
        p = torch.cat([head[5:6].contiguous().view(torch.float32), p])
        x0 = torch.cat([head[6:7].long(), x0])
    return conf, x0, p, nonfinite, parts[:, 0].max()


def after_exchange(st: dict, T: dict, geo, w: dict, parts: torch.Tensor, Nb: int, Rmax: int, rank: torch.Tensor):
    """The round after the all_gather, the same on every rank: selection, fill, spawn, block transitions and
    the next plan (rnd.select_apply: ops.select_round on the gathered table). Returns (st, info, vals [12]
    long): the next head [9], the winner, the error flag, and the row of this rank's logits holding the
    winner's raw row u - 1 (Dream's shift: the next last_logit; meaningful on the winner's owner only).
    rank: 0-d long (a tensor, so every rank compiles the same graph)."""
    conf, x0, p, nonfinite, failed = gathered_stats(parts, geo, Nb, Rmax)
    st["nonfinite"] = nonfinite
    W, last_row, info = rnd.select_apply(st, T, geo, w, round_stats.TokenStats(conf, x0, p))
    if geo.shift:  # table row last_row = needed raw row last_row - 1; this rank's rows follow the lower ranks'
        lower = torch.arange(parts.shape[0], device=parts.device) < rank
        loc = last_row - 1 - torch.where(lower, parts[:, 1].long(), 0).sum()
    else:
        loc = torch.zeros((), dtype=torch.long, device=conf.device)
    vals = torch.cat([st["head"], W.reshape(1), failed.reshape(1).long(), loc.reshape(1)])
    return st, info, vals


def compiled_share(model, st: dict, T: dict, geo, cfg, Nb: int, Rb: int, world: int, rank, holder):
    """The rank-local part of a compiled round: window_inputs, the round counter, this rank's share of the
    alive slots (slot_share on the device: nA is a device value here) padded to the static
    cap = ceil(NB / world) slots, its forward (prefix attention over the static cache, as a compiled
    single-process round) and its message. A rank without a slot runs the anchor's window (its K/V is the
    span's under the block-causal mask; under full attention it is ignored) and sends no row. rank and holder:
    0-d tensors (every rank compiles the same graph: one Inductor cache entry). Returns (st, (w, msg, logits,
    k_win, v_win))."""
    dev = st["x"].device
    w = rnd.window_inputs(st, T, geo, Nb, Rb)
    st["round"] = st["round"] + 1  # as finish_round: the keyed sampler's step
    cap = -(-geo.NB // world)
    n_rows = min(cap * Nb, Rb)
    nA = st["alive"].sum()
    q, r = nA // world, nA % world
    lo = rank * q + torch.minimum(r, rank)
    hi = lo + q + (r > rank).long()
    j = lo + torch.arange(cap, device=dev)
    slots = torch.where(hi > lo, j.clamp(max=hi - 1), nA - 1)
    valid = j < hi
    logits, k_win, v_win, flat, n_real = share_forward(model, st, geo, w, slots, valid, n_rows, st["cache_len"])
    msg, rows = rank_message(st, T, geo, cfg, Nb, n_rows, holder, logits, flat, n_real,
                             model.head_weight() if geo.fused_head else None)
    return st, (w, msg, rows, k_win, v_win)

class _Exchange:
    """A distributed round's one "forward" as the one loop sees it (anything with `forward_requests`: the scheduler
    groups forwards by it, one per request): the round of each part's driver (`DistributedDecoder._round`: this
    rank's share, the all_gather, the selection, the span commit). Nothing is left for `finish`."""

    def __init__(self, dec: "DistributedDecoder"):
        self.dec = dec

    def forward_requests(self, parts: list[dict], mode: str, attn_backend=None, pool=None) -> list[tuple]:
        for part in parts:
            self.dec._round(*part["bucket"])
        return [(None, None, None)] * len(parts)


class DistributedDecoder(FastDecoder):
    """FastDecoder whose rounds run a share of the slots on each rank of `comm` (module docstring): a driver
    (lopa_fast.decode.driver) whose eager round is one `_Exchange` and which has no batched compiled step (its
    compiled rounds are the two graphs around the collectives, `CompiledRounds.call`). comm: a
    lopa_fast.distributed.Comm; cache: its KV pool slot views (FastDecoder's)."""

    def __init__(self, model, prompt, cfg, branching_factor: int, name: str, comm, branch_stats: bool = False,
                 cache=None):
        super().__init__(model, prompt, cfg, branching_factor, name, cache=cache, branch_stats=branch_stats)
        self.comm = comm
        self._exchange = _Exchange(self)
        self.holder = 0  # the rank holding the last_logit row (Dream's shift); round 1's is everyone's
        self._holder_flag = [torch.tensor(v, dtype=torch.int32, device=self.dev) for v in (0, 1)]
        self._rank_t = torch.tensor(comm.rank, dtype=torch.long, device=self.dev)
        self._pending = None
        self._head = None
        self.kv_rounds = 0  # rounds whose span K/V was broadcast
        self.max_share = 0  # the most slots this rank ran in one round (its window K/V)
        self._hook_error: BaseException | None = None  # the progress hook's exception, held until the next gather

    def _head_weight(self):
        """The LM-head weight the fused head statistics read (None without geo.fused_head; FastDecoder's `_head`, whose
        name this driver's last read head holds)."""
        return self.model.head_weight() if self.geo.fused_head else None

    def _read_head(self) -> rnd.Head:
        if self._pending is None:
            head = super()._read_head()
        else:  # read with the winner and the error flag at the end of _round: still one read per round
            head, self._pending = self._pending, None
            self.host_reads += 1
        self._head = head
        return head

    def _share_eager(self, w: dict, nA: int, u: int, Nb: int, Rb: int, s: int, Rmax: int):
        """This rank's forward and message on an eager round: (msg, logits, (k_win, v_win, first slot) or None).
        Exactly its slots (no padding); a rank without a slot runs the anchor's window when a span is cached
        under the block-causal mask (the span's K/V is the same in every slot) and no forward otherwise."""
        st, geo, comm, dev = self.st, self.geo, self.comm, self.dev
        lo, hi = slot_share(nA, comm.world, comm.rank)
        holder = comm.rank == self.holder
        own = hi > lo
        if not own and not (geo.mode == "block_causal" and u > 0):
            width = self.model.config.hidden_size if geo.fused_head else st["last_logit"].shape[0]
            none = st["last_logit"].new_zeros((0, width))  # (no row: hidden rows with the fused head, else logits)
            flat = torch.zeros(0, dtype=torch.long, device=dev)
            return rank_message(st, self.tables, geo, self.cfg, Nb, Rmax, holder, none, flat, 0,
                                self._head_weight())[0], None, None
        f_lo, f_hi = (lo, hi) if own else (nA - 1, nA)
        self.max_share = max(self.max_share, f_hi - f_lo)
        slots = torch.arange(f_lo, f_hi, device=dev)
        valid = torch.full((f_hi - f_lo,), own, device=dev)
        n_rows = min((f_hi - f_lo) * Nb, Rb) if own else 1
        logits, k_win, v_win, flat, n_real = share_forward(self.model, st, geo, w, slots, valid, n_rows, s)
        if not own:  # the anchor's window ran for its span K/V only: no row of it is sent
            logits, flat, n_real = logits[:0], flat[:0], 0
        msg, rows = rank_message(st, self.tables, geo, self.cfg, Nb, Rmax, holder, logits, flat, n_real,
                                 self._head_weight())
        return msg, rows, (k_win, v_win, f_lo)

    def _share_compiled(self, nA: int, Nb: int, Rb: int):
        """This rank's part of a compiled round (compiled_share, one graph per bucket): (w, msg, logits, (k_win,
        v_win, first slot))."""
        comm, geo, cfg, model = self.comm, self.geo, self.cfg, self.model
        key = ("dist-share", comm.world, *round_key(geo, cfg, Nb, Rb))
        def make():  # the rank's share as a step function of (state, tables, rank, holder flag)
            return lambda st, T, rank, holder: compiled_share(model, st, T, geo, cfg, Nb, Rb, comm.world, rank, holder)

        holder = self._holder_flag[int(comm.rank == self.holder)]
        self.st, (w, msg, logits, k_win, v_win) = self.compiled.call(key, (Nb, Rb), f"{Nb}x{Rb}:share", make, self.st,
                                                                     self.tables, self._rank_t, holder)
        self.max_share = -(-geo.NB // comm.world)
        return w, msg, logits, (k_win, v_win, slot_share(nA, comm.world, comm.rank)[0])

    # ---- the driver's eager round: one exchange (the scheduler's round_scope holds it and `read_head`)
    def batch_step(self, Nb: int, Rb: int, s: int):
        """None: a distributed round is never a batched graph (its compiled parts run inside `_round`)."""
        return None

    def prepare(self, Nb: int, Rb: int, s: int) -> dict:
        return {"bucket": (Nb, Rb, s)}

    def forwards(self, w: dict) -> tuple:
        return ((self._exchange, self.geo.mode, self.geo.attn_backend),)

    def forward_args(self, w: dict) -> dict:
        return w

    def finish(self, w: dict, logits, k_win, v_win) -> None:
        """Nothing: the exchange ran the whole round."""

    def _round(self, Nb: int, Rb: int, s: int) -> None:
        """One round on every rank: this rank's share (eager, or `compiled_share`), the all_gather of the
        statistics, the selection and plan (`after_exchange`), the one host read, the span commit."""
        T, geo, comm = self.tables, self.geo, self.comm
        rnd_no = self._rounds + 1
        nA, u = self._head.alive, self._head.commit_len
        self.max_Nb = max(self.max_Nb, Nb)
        compiled = self.compiled is not None and self._rounds > 0  # round 1 (the prefill) eager, as on one process
        # message rows per rank: a compiled share is padded to the static ceil(NB / world) slots
        Rmax = min(-(-(geo.NB if compiled else nA) // comm.world) * Nb, Rb)
        err, kv, logits, w = None, None, None, None
        try:
            if self._hook_error is not None:  # this rank's progress hook raised after the last round: the peers
                raise self._hook_error  # learn it from this round's gather, as from any error of the round
            if compiled:
                w, msg, logits, kv = self._share_compiled(nA, Nb, Rb)
            else:
                w = rnd.window_inputs(self.st, T, geo, Nb, Rb)
                self.st["round"] = self.st["round"] + 1  # as finish_round (the keyed sampler's step)
                msg, logits, kv = self._share_eager(w, nA, u, Nb, Rb, s, Rmax)
        except BaseException as e:  # noqa: BLE001 - joins the gather with its flag set, so every rank stops now
            err = e  # (no peer waits; a KeyboardInterrupt too: re-raised on this rank once the peers know)
            msg = torch.zeros(HEADER + 3 * Rmax, dtype=torch.int32, device=self.dev)
            msg[0], msg[2] = 1, -1
        parts = comm.all_gather(msg, "stats", rnd_no)
        if err is not None:  # the peers learn it from the gathered flag (after their round's one host read)
            self._raise_peer_error(err, rnd_no)
        if compiled:
            key = ("dist-after", comm.world, Rmax, *round_key(geo, self.cfg, Nb, Rb))
            make = lambda: lambda st, T, w, parts, rank: after_exchange(  # noqa: E731
                st, T, geo, w, parts, Nb, Rmax, rank)
            self.st, self.info, vals = self.compiled.call(key, (Nb, Rb), f"{Nb}x{Rb}:after", make, self.st, T, w, parts,
                                                          self._rank_t)
        else:
            self.st, self.info, vals = after_exchange(self.st, T, geo, w, parts, Nb, Rmax, self._rank_t)
        vals = vals.tolist()  # the round's one host read: the next head, the winner, the error flag, a row index
        self._pending = rnd.Head(*vals[:9])
        if vals[10]:
            self._raise_peer_error(err, rnd_no)
        if u > 0:
            W = vals[9]
            self._commit(W, nA, u, kv, rnd_no)
            if geo.shift:  # the winner's raw row u - 1 is the next last_logit: its owner keeps it (a copy: the
                # compiled share's outputs are rewritten by its next call)
                owner = slot_owner(W, nA, comm.world)
                if comm.rank == owner:  # (with the fused head: a row of the logits it kept)
                    self.st["last_logit"] = logits[vals[11]].clone()
                else:  # the dtype the owner's row has (a compiled share sees one input dtype on every rank)
                    self.st["last_logit"] = self.st["last_logit"].to(logits.dtype if logits is not None else
                                                                      self.st["last_logit"].dtype)
                self.holder = owner

    def _commit(self, W: int, nA: int, u: int, kv, rnd_no: int) -> None:
        """The winner's span K/V into every rank's cache: broadcast from its owner (full attention, ONE
        collective, all layers packed), or this rank's own copy (block-causal: identical in every slot)."""
        st, comm = self.st, self.comm
        if self.geo.mode == "block_causal":
            k_win, v_win, _ = kv
            rnd.commit_span(st, u, k_win[:, 0, :u], v_win[:, 0, :u])
            return
        src = slot_owner(W, nA, comm.world)
        ck = st["cache_k"]
        if comm.rank == src:
            k_win, v_win, f_lo = kv
            buf = torch.stack([k_win[:, W - f_lo, :u], v_win[:, W - f_lo, :u]]).contiguous()
        else:
            buf = torch.empty((2, ck.shape[0], u, *ck.shape[2:]), dtype=ck.dtype, device=ck.device)
        comm.broadcast(buf, src, "kv", rnd_no)
        self.kv_rounds += 1
        rnd.commit_span(st, u, buf[0], buf[1])

    def after_round(self) -> None:
        """The round's counters and the progress hook; an exception of the hook (a cancelled request, a
        KeyboardInterrupt) is held until the next round's gather, so every rank leaves in the same round (a rank
        that left alone would meet its peers' round messages with its next request's: a size mismatch, SIGABRT)."""
        try:
            super().after_round()
        except BaseException as e:  # noqa: BLE001 - re-raised after the peers were told (_round / result)
            self._hook_error = e

    def _raise_peer_error(self, err: BaseException | None, rnd_no: int) -> None:
        msgs = self.comm.all_gather_object(None if err is None else f"{type(err).__name__}: {err}", rnd_no)
        bad = next(r for r, m in enumerate(msgs) if m is not None)
        if err is not None and (not isinstance(err, Exception) or err is self._hook_error):
            raise err  # this rank's own KeyboardInterrupt / hook error: the caller sees its own exception
        raise DistributedError(f"distributed decoding: rank {bad} of {self.comm.world} failed in round {rnd_no}: "
                               f"{msgs[bad]}", rank=bad, round=rnd_no) from err

    def result(self):
        """FastDecoder's result plus stats["distributed"]; raises the progress hook's error of the last round (no
        peer waits for this rank then)."""
        out = super().result()
        if self._hook_error is not None:  # the hook raised after the last round: no peer waits for this rank
            raise self._hook_error
        c = self.comm
        rounds = max(1, out.stats["forwards"])
        total = sum(c.bytes.values())
        kv = self.st["cache_k"]  # this rank's window K/V: its share of the slots, not all NB
        out.stats["kv_window_bytes"] = kv[:, :1].numel() * kv.element_size() * 2 * self.max_share * self.max_Nb
        out.stats["distributed"] = {
            "world_size": c.world, "rank": c.rank, "backend": c.backend, "collectives": dict(c.calls),
            "bytes": dict(c.bytes), "bytes_per_round": total / rounds, "kv_broadcast_rounds": self.kv_rounds,
            "fused_head": self.geo.fused_head,  # the messages carried the fused head's statistics (no logits rows)
        }
        return out


def driver(model, prompt, cfg, branching_factor: int, name: str, cache=None, branch_stats: bool = False):
    """The distributed request's driver (cfg bound and validated; lopa_fast.api checked it): a DistributedDecoder
    over the default group, stepped by the one loop like any driver (cache: its KV pool slot views). Refuses, on
    every rank, a request that differs between ranks (config, prompt or model geometry, dtype or weights)."""
    check_group()
    comm = Comm()
    dev = prompt.device
    want = "cuda" if comm.backend == "nccl" else "cpu"
    if dev.type != want:
        raise KnobError(f"distributed=True with the {comm.backend} backend needs the model on {want}; it is on {dev}",
                        knob="distributed", value=True)
    dec = DistributedDecoder(model, prompt, cfg, branching_factor, name, comm, branch_stats, cache=cache)
    # the request fingerprint and the keyed sampler's seed (seed=None draws one per process: rank 0's is used)
    fp = torch.tensor([request_fingerprint(model, prompt, cfg), int(dec.tables["seed"])], dtype=torch.long, device=dev)
    seen = comm.all_gather(fp, "setup", 0)
    prints = seen[:, 0].tolist()
    if len(set(prints)) > 1:
        raise DistributedError(f"distributed decoding: the ranks were given different requests (config / prompt / "
                               f"model geometry, dtype or weights: fingerprints {prints}); every rank must call "
                               "generate with the same arguments and the same model")
    dec.tables["seed"] = seen[0, 1].clone()
    return dec
