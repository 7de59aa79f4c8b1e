"""Branch parallelism across processes (torch.distributed): the branch slots of a D2F / LoPA round split over ranks.

`generate(..., backend="fast", distributed=True)` inside an initialised process group (gloo on CPU, NCCL on
GPUs: one rank per device, the model on cuda:LOCAL_RANK) decodes ONE request with every rank of the group.
Every rank holds the whole round state (token rows and block tables: a few KB) and the whole static prefix
KV cache, and runs the fast round's stages (`lopa_fast.decode.round`: `window_inputs`, the forward,
`token_stats`, `select_winner`, `commit_span`, `apply_winner`) with one change: the forward covers only its
share of the round's alive slots, and the token statistics of the needed LM-head rows are exchanged.

Per round (nA alive slots, read from the round head every rank reads anyway):

1. slots: rank r runs slots [lo_r, hi_r) of range(nA), contiguous, split as evenly as possible (the first
   nA % world ranks get one more); any k, nothing dropped (upstream puts branch i on rank i and drops
   branches beyond the world size);
2. ONE all_gather of int32 [3 + 3 * Rmax] per rank: an error flag, the number of real rows, the first
   non-finite flat row, then the (conf, p, x0) statistics of its needed rows (conf and p as fp32 bit
   patterns: exact), Rmax = min(ceil(nA / world) * Nb, Rb). Never logits: 12 bytes per needed row instead of
   2 * V bytes (Dream: 304 KB per row). Every rank then holds the same statistics table as the
   single-process round (the rows in ascending flat order) and runs `select_winner` / `apply_winner` on
   it: the same scores, the same winner (first maximum = upstream's tie rule), the same fill, spawn and
   next plan on every rank, with no further message;
3. `last_logit` (Dream's shift: the winner's raw row u - 1 predicts the next window's first position) is
   kept as its statistics (conf, x0, p): the only values the rules read of it. They are a row of the
   gathered table, so nothing extra moves;
4. the winner's to-cache span K/V, only when u > 0. Full attention: it is branch-specific, and its owner
   broadcasts it in ONE collective: [2, layers, u, Hkv, D] (K and V of every layer packed). Block-causal:
   the span sees only the prefix and itself, so every rank that ran any slot holds the same K/V and
   nothing moves; a rank with no alive slot (round 1 has one slot; late rounds may have fewer slots than
   ranks) recomputes the anchor's window (it would be idle anyway) instead of receiving 2 * layers * u *
   Hkv * D elements;
5. the round's one host read (`head`) carries the winner and the gathered error flag too, so a round
   still reads the device once. The span commit is deferred to after that read (the plan of the next round
   does not read the cache).

Faults: a rank whose share raises (forward, statistics) still joins the all_gather with its error flag set;
every rank then raises DistributedError naming the failing rank and its message (one all_gather_object, on
the error path only). A rank that dies makes its peers' next collective fail or time out: the process
group's timeout bounds the wait (`init_from_env` uses LOPA_FAST_DIST_TIMEOUT_S, default 60 s; a group
created by the caller keeps the caller's timeout) and the failure is re-raised as DistributedError.

Every rank returns the same GenerateOutput (same ids, forwards and counters; its `seconds` are its own);
stats["distributed"] holds the world size, this rank, the backend and the bytes moved.

NCCL: written (device = cuda:local_rank, the same collectives on device tensors; one host read per round as
on one GPU) but not run here: the machines at hand have at most one GPU and NCCL refuses two ranks on one
device. The tests run gloo on CPU.
"""
from __future__ import annotations

import datetime
import os
import zlib

import torch
import torch.distributed as dist

from lopa_fast.decode import round as rnd
from lopa_fast.decode.engine import FastDecoder
from lopa_fast.errors import DistributedError, KnobError

# the collective timeout of a group started by init_from_env: a dead peer is reported after at most this long
# (a peer that raises is reported at once, through the error flag of the round's all_gather)
DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "LOPA_FAST_DIST_TIMEOUT_S"
STRATEGIES = ("d2f", "lopa")
HEADER = 3  # int32 words before the statistics: error flag, real rows, first non-finite flat row (or -1)


def check_config(cfg) -> None:
    """Refuse (KnobError naming the knob) distributed=True where it cannot run: no initialised process group,
    a strategy other than d2f / lopa, the reference backend, compile=True or temperature > 0."""
    if cfg.strategy not in STRATEGIES:
        raise KnobError(f"distributed=True covers strategy 'd2f' and 'lopa'; got strategy={cfg.strategy!r}",
                        knob="strategy", value=cfg.strategy)  # fmt: skip
    if cfg.backend == "reference":
        raise KnobError("distributed=True runs the fast decoder; pass backend='fast' (or 'auto')",
                        knob="backend", value=cfg.backend)  # fmt: skip
    if cfg.compile:
        raise KnobError("distributed=True runs eager rounds; compile=True is not supported with it yet",
                        knob="compile", value=True)  # fmt: skip
    if cfg.temperature != 0:
        raise KnobError(f"distributed=True covers temperature=0 only; got temperature={cfg.temperature!r}",
                        knob="temperature", value=cfg.temperature)  # fmt: skip
    if not (dist.is_available() and dist.is_initialized()):
        raise KnobError(
            "distributed=True needs an initialised torch.distributed process group (launch with "
            "`python -m torch.distributed.run --nproc-per-node N ...` and call "
            "torch.distributed.init_process_group, or lopa_fast.distributed.init_from_env()); none is initialised",
            knob="distributed", value=True,
        )  # fmt: skip


def init_from_env(device: str | None = None) -> str:
    """Start the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) with a
    bounded timeout (LOPA_FAST_DIST_TIMEOUT_S seconds, default DEFAULT_TIMEOUT_S). NCCL when `device` is CUDA
    (or None and CUDA is available): this rank's device becomes cuda:LOCAL_RANK; else gloo on the CPU.
    Returns the device string the model must be loaded on. KnobError without torchrun's environment."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise KnobError(f"--distributed needs torchrun's environment ({', '.join(missing)} unset); launch with "
                        "`python -m torch.distributed.run --nproc-per-node N -m lopa_fast generate ... --distributed`",
                        knob="distributed", value=True)  # fmt: skip
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= 24 * 3600:
        raise KnobError(f"{TIMEOUT_ENV}={raw!r}; allowed: seconds in (0, 86400]", knob=TIMEOUT_ENV, value=raw)
    cuda = device.startswith("cuda") if device is not None else torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = device or "cpu"
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # rendezvous failure / timeout: one clear error, not a backend traceback
            raise DistributedError(f"distributed decoding: could not start the process group: "
                                   f"{' '.join(str(e).split())[:300]}") from e  # fmt: skip
    return device


def slot_share(n: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi): rank's contiguous share of n slots, the first n % world ranks taking one more (empty when
    rank >= n)."""
    q, r = divmod(n, world)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (rank < r)


def slot_owner(slot: int, n: int, world: int) -> int:
    """The rank whose share of n slots holds `slot`."""
    return next(r for r in range(world) if slot_share(n, world, r)[0] <= slot < slot_share(n, world, r)[1])


class Comm:
    """The collectives of one request on `group`, each counted. Bytes are logical payload traffic: an
    all_gather of c bytes per rank delivers world * (world - 1) * c bytes, a broadcast of b bytes
    (world - 1) * b (whatever tree or ring the backend uses underneath)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.calls = {"all_gather": 0, "broadcast": 0, "all_gather_object": 0}
        self.bytes = {"stats": 0, "kv": 0, "setup": 0}  # delivered bytes, all ranks together

    def _run(self, what: str, fn, round_: int):
        try:
            return fn()
        except Exception as e:  # a dead peer (connection closed) or the group's timeout
            raise DistributedError(
                f"distributed decoding: {what} failed in round {round_} on rank {self.rank} of {self.world} "
                f"(a peer died or timed out): {' '.join(str(e).split())[:300]}", round=round_,
            ) from e  # fmt: skip

    def all_gather(self, t: torch.Tensor, kind: str, round_: int) -> torch.Tensor:
        """[world, *t.shape]: every rank's t."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._run("all_gather", lambda: dist.all_gather(parts, t, group=self.group), round_)
        self.calls["all_gather"] += 1
        self.bytes[kind] += self.world * (self.world - 1) * t.numel() * t.element_size()
        return torch.stack(parts)

    def broadcast(self, t: torch.Tensor, src: int, kind: str, round_: int) -> None:
        self._run("broadcast", lambda: dist.broadcast(t, src=src, group=self.group), round_)
        self.calls["broadcast"] += 1
        self.bytes[kind] += (self.world - 1) * t.numel() * t.element_size()

    def all_gather_object(self, obj, round_: int) -> list:
        out = [None] * self.world
        self._run("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group), round_)
        self.calls["all_gather_object"] += 1
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their int32 bit patterns (exact round trip through an int32 message)."""
    return t.float().contiguous().view(torch.int32)


class DistributedDecoder(FastDecoder):
    """FastDecoder whose rounds run a share of the slots on each rank of `comm` (module docstring)."""

    def __init__(self, model, prompt, cfg, branching_factor: int, name: str, comm: Comm):
        super().__init__(model, prompt, cfg, branching_factor, name)
        self.comm = comm
        self.cpp_tables = None  # the torch stages (the C++ twin fuses the statistics exchange point away)
        # the last_logit row -> its statistics (conf, x0, p) [1] each: all the rules ever read of it
        last = self.st.pop("last_logit")
        self.last_stats = rnd.token_stats(last[None, :], cfg, self.geo.use_conf_kernel) if self.geo.shift else None
        self._pending = None
        self._head = None
        self.kv_rounds = 0  # rounds whose span K/V was broadcast
        self.max_share = 0  # the most slots this rank ran in one round (its window K/V)

    def _read_head(self) -> list[int]:
        if self._pending is None:
            head = super()._read_head()
        else:  # read with the winner and the error flag at the end of _step: still one read per round
            head, self._pending = self._pending, None
            self.host_reads += 1
        self._head = head
        return head

    def _local(self, w: dict, lo: int, hi: int, nA: int, u: int, Nb: int, Rb: int, Rmax: int, s: int):
        """This rank's forward and statistics: (the int32 message [HEADER + 3 * Rmax], (k_win, v_win) or None).
        An idle rank (no slot of its own) runs the anchor's window under the block-causal mask when a span is
        cached this round (the span's K/V is the same in every slot), and nothing otherwise."""
        st, geo, dev = self.st, self.geo, self.dev
        msg = torch.zeros(HEADER + 3 * Rmax, dtype=torch.int32, device=dev)
        msg[2] = -1
        own = hi > lo
        if not own and not (geo.mode == "block_causal" and u > 0):
            return msg, None
        f_lo, f_hi = (lo, hi) if own else (nA - 1, nA)
        self.max_share = max(self.max_share, f_hi - f_lo)
        need = w["need"][f_lo:f_hi].reshape(-1)
        n_rows = min((f_hi - f_lo) * Nb, Rb) if own else 1
        rows = torch.sort((~need).to(torch.uint8), stable=True).indices[:n_rows]
        bids = None if w["bids"] is None else w["bids"][f_lo:f_hi]
        logits, k_win, v_win = self.model.forward_static(
            w["tokens"][f_lo:f_hi], st["s"], st["cache_k"], st["cache_v"], s, w["win_lens"][f_lo:f_hi], bids,
            geo.mode, rows, attn_backend=geo.attn_backend,
        )  # fmt: skip
        if own:
            n_real = need.sum()
            msg[1] = n_real
            msg[2] = rnd.first_nonfinite(logits, rows + f_lo * Nb, n_real, geo.NB * Nb)
            conf, x0, p = rnd.token_stats(logits, self.cfg, geo.use_conf_kernel)
            msg[HEADER : HEADER + n_rows] = _bits(conf)
            msg[HEADER + Rmax : HEADER + Rmax + n_rows] = _bits(p)
            msg[HEADER + 2 * Rmax : HEADER + 2 * Rmax + n_rows] = x0.to(torch.int32)
        return msg, (k_win, v_win, f_lo)

    def _gathered_stats(self, parts: torch.Tensor, Rmax: int, Nb: int):
        """parts [world, HEADER + 3 * Rmax] -> (conf, x0, p) over the needed rows in ascending flat order (the
        shift's last_logit row first), the first non-finite flat row (or -1), the error flag; no host read."""
        NB, dev = self.geo.NB, self.dev
        cnt = parts[:, 1].long()
        nf = parts[:, 2].long()
        nf = torch.where(nf >= 0, nf, NB * Nb).min()
        nonfinite = torch.where(nf == NB * Nb, -1, nf)
        real = (torch.arange(Rmax, device=dev)[None, :] < cnt[:, None]).reshape(-1)
        order = torch.sort((~real).to(torch.uint8), stable=True).indices  # real rows first, rank order kept
        body = parts[:, HEADER:].reshape(self.comm.world, 3, Rmax).transpose(0, 1).reshape(3, -1)
        conf = body[0].index_select(0, order).contiguous().view(torch.float32)
        p = body[1].index_select(0, order).contiguous().view(torch.float32)
        x0 = body[2].index_select(0, order).long()
        if self.geo.shift:
            lc, lx, lp = self.last_stats
            conf, x0, p = torch.cat([lc, conf]), torch.cat([lx, x0]), torch.cat([lp, p])
        return conf, x0, p, nonfinite, parts[:, 0].max()

    def _step(self, Nb: int, Rb: int, s: int) -> None:
        st, T, geo, comm = self.st, self.tables, self.geo, self.comm
        rnd_no = self._rounds + 1
        nA, u = self._head[1], self._head[3]
        self.max_Nb = max(self.max_Nb, Nb)
        w = rnd.window_inputs(st, T, geo, Nb, Rb)
        st["round"] = st["round"] + 1  # as rnd.finish_round (the keyed sampler's step; T = 0 here never reads it)
        lo, hi = slot_share(nA, comm.world, comm.rank)
        Rmax = min(-(-nA // comm.world) * Nb, Rb)
        err, kv = None, None
        try:
            msg, kv = self._local(w, lo, hi, nA, u, Nb, Rb, Rmax, s)
        except Exception as e:  # joins the gather with its flag set, so every rank stops now (no peer waits)
            err = e
            msg = torch.zeros(HEADER + 3 * Rmax, dtype=torch.int32, device=self.dev)
            msg[0], msg[2] = 1, -1
        parts = comm.all_gather(msg, "stats", rnd_no)
        conf, x0, p, nonfinite, failed = self._gathered_stats(parts, Rmax, Nb)
        st["nonfinite"] = nonfinite
        sel = rnd.select_winner(st, T, geo, w, conf)
        if geo.shift:  # the winner's raw row u - 1's statistics become the next last_logit's
            r = sel["last_row"].reshape(1)
            new = (conf.index_select(0, r), x0.index_select(0, r), p.index_select(0, r))
            self.last_stats = tuple(torch.where(st["u"] > 0, a, b) for a, b in zip(new, self.last_stats))
        self.info = rnd.apply_winner(st, T, geo, w, sel, conf, x0, p)
        vals = torch.cat([st["head"], sel["W"].reshape(1), failed.reshape(1).long()]).tolist()  # the one read
        self._pending = vals[:9]
        if vals[10]:
            self._raise_peer_error(err, rnd_no)
        if u > 0:
            self._commit(vals[9], nA, u, kv, rnd_no)

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

    def _raise_peer_error(self, err: BaseException | None, rnd_no: int) -> None:
        msgs = self.comm.all_gather_object(None if err is None else f"{type(err).__name__}: {err}", rnd_no)
        bad = next(r for r, m in enumerate(msgs) if m is not None)
        raise DistributedError(f"distributed decoding: rank {bad} of {self.comm.world} failed in round {rnd_no}: "
                               f"{msgs[bad]}", rank=bad, round=rnd_no) from err  # fmt: skip

    def run(self, on_round=None):
        out = super().run(on_round)
        c = self.comm
        rounds = max(1, out.stats["forwards"])
        total = sum(c.bytes.values())
        kv = self.st["cache_k"]  # this rank's window K/V: its share of the slots, not all NB
        out.stats["kv_window_bytes"] = kv[:, :1].numel() * kv.element_size() * 2 * self.max_share * self.max_Nb
        out.stats["distributed"] = {
            "world_size": c.world, "rank": c.rank, "backend": c.backend, "collectives": dict(c.calls),
            "bytes": dict(c.bytes), "bytes_per_round": total / rounds, "kv_broadcast_rounds": self.kv_rounds,
        }  # fmt: skip
        return out


def _fingerprint(model, prompt: torch.Tensor, cfg) -> int:
    """A crc32 of the request (config, prompt ids, model geometry): every rank must decode the same one."""
    c = model.config
    geo = (c.vocab_size, c.num_layers, c.num_kv_heads, c.head_dim)
    return zlib.crc32(repr((cfg, prompt.tolist(), geo)).encode())


def run_distributed(model, prompt, cfg, branching_factor: int, name: str, on_round=None):
    """One request on every rank of the default group (cfg bound and validated; lopa_fast.api checked it).
    Refuses, on every rank, a request that differs between ranks (config, prompt or model geometry)."""
    check_config(cfg)
    comm = Comm()
    dev = prompt.device
    want = "cuda" if comm.backend == "nccl" else "cpu"
    if dev.type != want:
        raise KnobError(f"distributed=True with the {comm.backend} backend needs the model on {want}; it is on {dev}",
                        knob="distributed", value=True)  # fmt: skip
    fp = torch.tensor([_fingerprint(model, prompt, cfg)], dtype=torch.long, device=dev)
    seen = comm.all_gather(fp, "setup", 0).view(-1).tolist()
    if len(set(seen)) > 1:
        raise DistributedError(f"distributed decoding: the ranks were given different requests (config / prompt / "
                               f"model fingerprints {seen}); every rank must call generate with the same arguments")
    return DistributedDecoder(model, prompt, cfg, branching_factor, name, comm).run(on_round)
