"""The fast D2F / LoPA decoder: every branch of a round in ONE batched forward, round state on the device.

Semantics are exactly those of the reference decoders (reference_d2f.py / reference_lopa.py; docs/semantics.md
sections 2-3); this module only changes *how* a round is computed. The round itself is
`lopa_fast.strategies.lopa.round` (fixed-shape device tensors: the layout and the stages are documented there);
this module is its driver (lopa_fast.decode.driver's protocol, stepped by lopa_fast.decode.batch's one loop):
per request the Geometry (the Python constants a compiled round bakes in; the prompt length is not one of them),
the device tables and state, and with compile=True the model's `CompiledRounds`; per round ONE host read of the
plan's `Head` -> the bucket (Nb, Rb) -> the round (eager: `prepare` / `forward_args` / `finish` around the
scheduler's shared forward; compiled: `batch_step`, the bucket's batched graph); at the end the output slot, the
counters, stats (host reads, memory, compile stats) and the trace.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lopa_fast.decode.compiled import compiled_for
from lopa_fast.decode.fused_head import fused_head_wanted
from lopa_fast.decode.compiled_batch import BatchStep
from lopa_fast.strategies.lopa import round as rnd
from lopa_fast.decode.shapes import pow2_bucket, quantized_length
from lopa_fast.decode.syncs import round_scope
from lopa_fast.errors import NonFiniteLogitsError
from lopa_fast.output import Clock, GenerateOutput, finalize_stats, round_cap_hit
from lopa_fast.ops.select_round_outputs import outputs_for
from lopa_fast.output.progress import report_round

# the smallest LM-head row bucket: below this many rows a bucket costs a compile more than the rows cost
MIN_HEAD_ROWS = 64

@dataclass(frozen=True)
class Geometry:
    """The Python constants of a request's round (they are baked into a compiled / captured round; the
    prompt length and the float knobs (`round.round_knobs`: temperature, top_p, skip threshold, alpha) are not
    among them: they live in the device tables, so a graph serves every value)."""

    bs: int
    G: int
    Lb: int
    NB: int
    n_look: int
    shift: bool
    mode: str
    mask_id: int
    eos_id: int | None
    blend: bool  # selection_conf_alpha > 0: branch scores blend the creating confidence (by T["alpha"])
    attn_backend: str
    use_conf_kernel: bool
    fused_head: bool  # the round's LM head and statistics as ONE `ops.head_confidence` (`fused_head_wanted`)
    trace: bool  # branch scores are computed for a one-slot round only when a trace asks for them
    stop_lens: tuple  # lengths of the stop sequences (their ids are a device table: T["stops"])


def buffer_len(P: int, cfg) -> int:
    """Lb: a request's buffer length (prompt P + its generated blocks, rounded up to shapes.LENGTH_QUANTUM); its static
    cache has Lb + 1 rows (row Lb: the trash row of masked commits)."""
    return quantized_length(P + (cfg.max_new_tokens // cfg.block_size) * cfg.block_size)


def bucket(n: int, R: int, geo: Geometry) -> tuple[int, int]:
    """(Nb, Rb): the window length rounded up to a block multiple, the LM-head rows rounded up to a power
    of two (at least MIN_HEAD_ROWS, at most every window row)."""
    Nb = -(-n // geo.bs) * geo.bs
    Rb = min(geo.NB * Nb, pow2_bucket(R, MIN_HEAD_ROWS))
    return Nb, Rb


def round_key(geo: Geometry, cfg, Nb: int, Rb: int) -> tuple:
    """A D2F / LoPA round's compile key: the geometry, the bucket and what of the statistics knobs changes the graph:
    the confidence, top_k (a shape), the mask suppression, and whether T > 0 / a top-p filter applies. Their float
    values are runtime inputs (the tables, lopa_fast.strategies.lopa.round.round_knobs), not keys."""
    stats_knobs = (cfg.sampling_strategy, cfg.top_p is not None and cfg.top_p < 1, cfg.top_k,
                   cfg.suppress_mask_token, cfg.temperature > 0)
    return (geo, stats_knobs, Nb, Rb)


_ACCEPTED, _TOKENS = rnd.ref_ops.SelectRound._fields.index("accepted"), rnd.ref_ops.SelectRound._fields.index("tokens")


class FastDecoder:
    """One request of D2F (k = 1) or LoPA (k >= 2) decoding with all branches batched.

    model: DecoderLM; prompt: LongTensor [P] on model.device; cfg: a bound GenerateConfig; cache: None (the
    request allocates its own static cache) or (k, v) views [num_layers, buffer_len(P, cfg) + 1, Hkv, D] of a
    batch's KV pool slot (lopa_fast.decode.kv_pool), zeroed, which the request's commits write in place.
    A driver (lopa_fast.decode.driver) stepped by lopa_fast.decode.batch's one loop; its `result()` equals (tokens,
    forwards) the reference backend's.
    """

    def __init__(self, model, prompt: torch.Tensor, cfg, branching_factor: int, name: str, cache=None,
                 branch_stats: bool = False):
        from lopa_fast.ops import _backend

        self.model, self.cfg, self.name, self.branch_stats = model, cfg, name, branch_stats
        dev = prompt.device
        self.dev = dev
        P, bs = prompt.numel(), cfg.block_size
        G = cfg.max_new_tokens // bs
        n_look = branching_factor if branching_factor >= 2 else 0  # lookaheads per round (upstream: k)
        use_kernel = (
            dev.type == "cuda" and os.environ.get("LOPA_FAST_DECODE_OPS", "1") != "0"
            and cfg.top_p is None and cfg.top_k is None
        )
        self.P = P
        Lb = buffer_len(P, cfg)
        self.geo = Geometry(
            bs=bs, G=G, Lb=Lb, NB=n_look + 1, n_look=n_look, shift=bool(model.logits_shift),
            mode="full" if cfg.use_full_attention else "block_causal", mask_id=cfg.mask_token_id,
            eos_id=cfg.eos_token_id, blend=rnd.round_knobs(cfg)["alpha"] > 0,
            attn_backend=_backend.resolve("branch_attention", None, dev), use_conf_kernel=use_kernel,
            fused_head=fused_head_wanted(cfg, dev),
            trace=bool(cfg.return_trace), stop_lens=tuple(len(q) for q in cfg.stop or ()),
        )
        model.fused_layers()  # the merged-weight view, built or checked once per request (outside any graph)
        self.tables = rnd.init_tables(P, bs, G, Lb, cfg, dev)
        self.st = rnd.init_state(model, prompt, G, Lb, self.geo.NB, cfg.mask_token_id, cache)
        self.host_reads = 0
        self.max_Nb = 0
        self._outs: dict = {}  # select_round's CPU workspaces by round parity, their lists by (parity, Nb)
        self.compiled, self.cview = compiled_for(model, cfg, dev)  # its rounds after the prefill: `batch_step`
        self.mode, self.attn_backend = self.geo.mode, self.geo.attn_backend  # the shared forward's (the scheduler's)

    def use_cache(self, cache_k, cache_v) -> None:
        """The request's static cache: a batch's pool slot views (re-pointed when the pool grows)."""
        self.st["cache_k"], self.st["cache_v"] = cache_k, cache_v

    def _read_head(self) -> rnd.Head:
        self.host_reads += 1
        return rnd.Head(*self.st["head"].tolist())  # the round's one device-to-host read

    # ---- a compiled / captured round in a batch (lopa_fast.decode.compiled_batch: one graph per bucket and batch size)
    def batch_step(self, Nb: int, Rb: int, s: int):
        """The coming round as a compiled batch's BatchStep, or None when it runs eagerly (compile off, or the
        prefill round, whose bucket depends on the prompt length: as alone)."""
        if self.compiled is None or self._rounds == 0:
            return None
        if not getattr(self, "_owned", False):  # the batch copies lane results into these tensors from now on:
            self.st = {k: v if k in ("cache_k", "cache_v") else v.clone() for k, v in self.st.items()}  # own them
            self._owned = True
        geo, cfg = self.geo, self.cfg

        def pre(st: dict, T: dict):
            w = rnd.window_inputs(st, T, geo, Nb, Rb)
            return rnd.forward_part(st, geo, w, st["start"], st["cache_len"]), w

        head = self._head()

        def post(st: dict, T: dict, w: dict, logits, k_win, v_win):
            return rnd.finish_round(st, T, geo, cfg, w, logits, k_win, v_win, head=head)

        return BatchStep(self.compiled, round_key(geo, cfg, Nb, Rb), (Nb, Rb), f"round_{Nb}x{Rb}", geo, pre,
                         post, geo.mode, geo.attn_backend, self.st, self.tables, self.cview)

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result for this request (its state, its trace facts); then `read_head`."""
        self.st, self.info = st, info

    # ---- one eager round in three stages, for lopa_fast.decode.batch (one forward for many requests)
    def prepare(self, Nb: int, Rb: int, s: int) -> dict:
        """The coming round's forward inputs on bucket (Nb, Rb) (s: the window start = prefix length, host int)."""
        w = rnd.window_inputs(self.st, self.tables, self.geo, Nb, Rb)
        w["start"] = s
        head = self.head
        w["n_real"] = head.rows  # the LM-head rows the round needs (host int: the guard's lean form)
        w["span"] = (head.start, head.commit_len)  # the commit: (cache_len = the window start, u), host ints
        # every slot's window fills the bucket (not ragged: the alive slots' windows are all `width` long, the others
        # get Nb; width == Nb): no padding key, so the torch attention's mask is skipped under full attention and is
        # the block rule alone under block-causal
        w["dense"] = not head.ragged and head.width == Nb
        return w

    def forward_args(self, w: dict) -> dict:
        """This request's part of `model.forward_requests` (the arguments of its solo `forward_static`)."""
        return rnd.forward_part(self.st, self.geo, w, w["start"], w["start"])

    def _head(self):
        """The LM-head weight the fused head statistics read (None without geo.fused_head)."""
        return self.model.head_weight() if self.geo.fused_head else None

    def finish(self, w: dict, logits, k_win, v_win) -> None:
        """The round after its forward (this request's logits [Rb, V] (hidden rows [Rb, H] with geo.fused_head)
        and window K/V [layers, NB, Nb, Hkv, D])."""
        self.st, self.info = rnd.finish_round(self.st, self.tables, self.geo, self.cfg, w, logits, k_win, v_win,
                                              head=self._head(), out=self._select_out(w["win_pos"].shape[0]))

    def _select_out(self, Nb: int) -> list | None:
        """select_round's workspace for this round on CPU (the C++ kernel fills it; None elsewhere): two, alternating
        by round, so the outputs never alias the state they are computed from (the previous round's) and a round's
        decision (info: score, tokens) stays valid until the next round. Sized for the widest window (Lb + 1
        columns); the two per-column fields (accepted, tokens [Nb]) are their first Nb entries."""
        if self.dev.type != "cpu" or Nb > self.st["x"].shape[1]:  # (a window never spans more than the buffer)
            return None
        parity = self._rounds % 2
        out = self._outs.get((parity, Nb))  # (the list for this bucket width, built once: two slices a round saved)
        if out is None:
            base = self._outs.get(parity)
            if base is None:
                x = self.st["x"]
                base = self._outs[parity] = outputs_for(x.shape[0], x.shape[1], self.geo.G + 1, x.shape[1], self.dev)
            out = list(base)
            out[_ACCEPTED], out[_TOKENS] = base[_ACCEPTED][:Nb], base[_TOKENS][:Nb]
            self._outs[(parity, Nb)] = out
        return out

    def _trace_entry(self, head: rnd.Head, round_: int) -> dict:
        info, P = self.info, self.P
        nA = head.alive
        W = int(info["winner"])
        look = [None if q < 0 else q - P for q in info["look_pos"][:nA].tolist()]
        acc_mask = info["accepted"]
        acc = [[q - P, t] for q, t in zip(info["win_pos"][acc_mask].tolist(), info["tokens"][acc_mask].tolist())]
        if look[W] is not None:
            acc.append([look[W], int(self.st["x"][0, look[W] + P])])
        return {
            "round": round_, "window_start": head.start - P, "cached": head.commit_len,
            "branches": [{"score": float(info["score"][b]), "lookahead": look[b], "window_len": wl}
                         for b, wl in enumerate(self._wl[:nA])],
            "winner": W, "accepted": sorted(acc),
        }

    def _refuse_nonfinite(self, flat_row: int, round_: int) -> None:
        """Raise NonFiniteLogitsError for window row `flat_row` (slot * Nb + column) of round `round_`."""
        s, Nb = self._last_window
        pos = s + flat_row % Nb + (1 if self.geo.shift else 0)  # the position that row predicts
        t = self.cfg.temperature  # at T > 0 the guard also refuses finite logits that 1 / T overflows
        value = "NaN/inf" if t == 0 else f"NaN/inf, or overflow at temperature {t}"
        raise NonFiniteLogitsError(strategy=self.name, round=round_, position=pos, value=value)

    # ---- the request as a driver (lopa_fast.decode.driver): lopa_fast.decode.batch's one loop steps it
    def begin(self, on_round=None) -> None:
        """Start the clock, plan round 1 and read its head (the request's first host read). on_round: the
        progress hook (lopa_fast.output.progress.report_round), called after every round with the anchor row (the
        accepted sequence): one extra host read per round, only with a hook."""
        self.on_round = on_round
        self.stats = {"forwards": 0, "model_calls": 0}
        self.trace = [] if self.cfg.return_trace else None
        self.ragged_rounds = 0
        self._rounds = 0
        self.clock = Clock(self.dev).__enter__()
        with round_scope():
            rnd.plan(self.st, self.tables, self.geo)
            self.head = self._read_head()

    def next_bucket(self) -> tuple[int, int, int] | None:
        """The coming round's bucket and window start (Nb, Rb, s), or None when the request has finished (all
        branches done, a stop sequence, or the round cap: said in stats). Raises NonFiniteLogitsError when the
        last round read NaN / inf logits."""
        done, nA, s, u, n, R, ragged, nonfinite, stop = self.head
        if nonfinite >= 0:
            self._refuse_nonfinite(nonfinite, self.stats["forwards"])
        if stop:  # a stop sequence in the anchor's finalised prefix (the API cuts the output before it)
            self.stats["stopped"] = True
            return None
        if done:
            return None
        if self.stats["forwards"] >= self.cfg.max_rounds:
            round_cap_hit(self.cfg, self.stats, self.name)
            return None
        if self.trace is not None:
            self._wl = self.st["window_lens"].tolist()
        Nb, Rb = bucket(n, R, self.geo)
        if self.compiled is None:  # eager rounds need no shape sharing: the LM head and the statistics run on the
            Rb = max(1, R)  # needed rows only (rows are independent: the same values as in a padded bucket)
        self._last_window = (s, Nb)
        self.max_Nb = max(self.max_Nb, Nb)
        return Nb, Rb, s

    def read_head(self) -> None:
        """The round's one host read: the next plan's head (inside the caller's round_scope)."""
        self._prev_head, self.head = self.head, self._read_head()

    def after_round(self) -> None:
        """Counters, the trace entry and the progress hook of the round just run (outside the round's scope)."""
        geo, stats, head = self.geo, self.stats, self.head
        self._rounds += 1
        stats["forwards"] += 1
        stats["model_calls"] += 1
        self.ragged_rounds += bool(self._prev_head.ragged)
        if self.trace is not None:
            self.trace.append(self._trace_entry(self._prev_head, stats["forwards"]))
        if self.on_round is not None:  # the anchor is the last alive slot of the next round's plan
            self.host_reads += 1
            row = self.st["x"][max(head.alive, 1) - 1, self.P : self.P + geo.G * geo.bs]
            report_round(self.on_round, row, geo.mask_id, geo.G * geo.bs, stats["forwards"])

    def result(self) -> GenerateOutput:
        """Stop the clock; the output slot, its tokens, the counters and stats, the trace."""
        self.clock.__exit__(None, None, None)
        cfg, geo, stats, head, trace, clock = self.cfg, self.geo, self.stats, self.head, self.trace, self.clock
        ragged_rounds = self.ragged_rounds
        if head.nonfinite >= 0:
            self._refuse_nonfinite(head.nonfinite, stats["forwards"])
        st = self.st
        if head.stop:
            out_slot = head.alive - 1  # the anchor (the last alive slot): the accepted sequence
        elif head.done:
            # every alive branch finished in the same round (lookaheads always keep an active block, so a
            # finished round holds just the anchor): upstream returns the first finished branch in list order
            out_slot = int(torch.where(st["done"], torch.arange(geo.NB, device=self.dev), geo.NB).min()) \
                if head.alive > 1 else 0
        else:
            out_slot = int(st["layout_slot"])  # the cap: the running anchor (else the first running branch)
        length = self.P + int(st["n_blocks"][out_slot]) * geo.bs
        ids = st["x"][out_slot, self.P : length].tolist()
        c = dict(zip(rnd.ROUND_COUNTERS, st["counts"].tolist()))
        stats.update(
            accepted_by_threshold=c["thresh"], fallback_fills=c["fallback"], eos_fills=c["eos_fills"],
            multi_token_rounds=c["multi"], eos_detected=bool(st["eos"][out_slot]),
        )
        if self.branch_stats:  # LoPA's branch statistics (lookahead wins, growth, ...)
            max_branches = c["max_branches"] if geo.NB > 1 else int(stats["forwards"] > 0)
            stats.update(lookahead_wins=c["look_wins"], branch_growth=c["growth_split"],
                         winner_grew=c["winner_grew"], max_branches=max_branches, ragged_rounds=ragged_rounds)
        stats["host_reads"] = self.host_reads
        stats["host_reads_per_round"] = self.host_reads / max(1, stats["forwards"])
        # memory: the prefix cache is allocated once (independent of k); the window K/V grow with k
        kv = st["cache_k"]
        stats["kv_prefix_bytes"] = kv.numel() * kv.element_size() * 2
        stats["kv_window_bytes"] = kv[:, :1].numel() * kv.element_size() * 2 * geo.NB * self.max_Nb
        if self.compiled is not None:
            stats.update(self.compiled.stats(self.cview))
        if self.dev.type == "cuda":
            stats["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.dev)
        finalize_stats(stats, ids, cfg.eos_token_id, geo.mask_id, clock.seconds, steps_plus_one=True)
        return GenerateOutput(ids, stats, trace)
