"""One D2F / LoPA round as a function of fixed-shape device tensors (no host read, no value-dependent shape).

The round's stages (window_inputs, the forward, finish_round: statistics, winner, commit, fill, spawn, the next
round's plan and its `head`): docs/internals.md. The token statistics live in lopa_fast/strategies/lopa/round_stats.py.

Layout (request constants: P prompt length, bs block size, G generated blocks, L = P + G * bs, the
buffer length Lb >= L (L rounded up, so prompts of nearby lengths share compiled rounds: P and L are
device tensors in the tables (prompt_len, total_len), never shapes), NB branch slots = k + 1 for k >= 2, else 1):
  x            [NB, Lb + 1] long  token rows; column Lb is a trash column (scatters of padding go there)
  n_blocks     [NB] long          generated blocks present per slot
  block_state  [G + 1] long       block states 0 active, 1 to_cache, 2 in_cache (shared by every slot:
                                  a new branch always gets the winner's table, growth appends active blocks)
  complete     [NB, G + 1] bool   is_complete ("fully activated": the fallback may fill)
  eos, alive [NB] bool; creation_conf [NB] float64 (the confidence that created a branch); look_pos [NB] long
  last_logit   [V]                the raw logit saved with the last committed span (Dream's shift)
  cache_k/v [layers, Lb + 1, Hkv, D]; cache_len 0-d long  (row Lb is a trash row for masked commits)
  count_<name> 0-d long           the round's counters (ROUND_COUNTERS), read once at the end of the request
  plan tensors of the coming round (`plan`): exists, active [NB, G + 1] bool; running, done [NB] bool (alive and
    not finished / finished); is_mask, need [NB, Lb + 1] bool (a mask inside the row's length / an LM-head row
    needed); lens, window_lens [NB] long (row length, window length from the start); to_cache [G + 1] bool;
    shared_end (the end of the leading non-active blocks), layout_slot (the anchor if running, else the first
    running slot), start (the window start), commit_len (the to-cache span's length): 0-d long
  head [9] long: the `Head` fields, read by the host once per round
Slots [0, n_look) hold lookaheads in rank order and the anchor comes last among the alive slots (slot
nA - 1): upstream's verification order, so "first maximum" is its tie rule for the winner.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lopa_fast import keyed
from lopa_fast.strategies.lopa.round_stats import (
    TokenStats,
    fused_head_stats,
    row_keys,
    temperature,
    token_stats,
)
from lopa_fast import ops
from lopa_fast.decode.kv_pool import request_cache
from lopa_fast.decode.shapes import knob, stop_in_prefix, stop_table
from lopa_fast.sampling import chunk_rows
from lopa_fast.reference import ops as ref_ops
from lopa_fast.reference.ops import ROUND_COUNTERS, TO_CACHE  # noqa: F401 (ROUND_COUNTERS: the driver's)


class Head(NamedTuple):
    """The round's `head` [9] as the host reads it (one `.tolist()` per round): the plan of the coming round."""

    done: int  # every alive slot finished
    alive: int  # alive slots nA (the anchor is slot nA - 1)
    start: int  # the window start s (= the committed prefix length once the span below is cached)
    commit_len: int  # the to-cache span the round commits (u positions from the start)
    width: int  # the window width n: the longest running slot's window
    rows: int  # the LM-head rows R the round needs
    ragged: int  # the alive slots' windows differ in length
    nonfinite: int  # the flat window row (slot * Nb + column) of the first non-finite raw logits row the last
    # round read, or -1 (the numerics guard rides on the round's one host read: the driver raises before any
    # token of that round is returned)
    stop: int  # a stop sequence lies in the anchor's finalised prefix (the tokens before its first mask)


def round_knobs(cfg) -> dict[str, float]:
    """The round's float knobs (runtime inputs in the tables, `init_tables`: a compiled / captured round serves
    every value; only whether T > 0 / top-p filters / scores blend keys a graph): the temperature, top_p (1.0: no
    filter), the skip threshold and the selection blend alpha (clamped to [0, 1])."""
    return dict(temperature=float(cfg.temperature), top_p=1.0 if cfg.top_p is None else float(cfg.top_p),
                skip_threshold=float(cfg.skip_threshold), alpha=float(max(0.0, min(1.0, cfg.selection_conf_alpha))))


def lowest_k_table(n: int, topp: float) -> list[int]:
    """k(c) = max(1, floor(c * topp)) for c = 0..n, computed in Python float64 exactly as upstream's
    `int(len(confs) * branch_topp)`: the branch score reads this table (`init_tables`: long [n + 1]) instead of
    redoing float maths on the device."""
    return [max(1, int(c * topp)) for c in range(n + 1)]


def init_tables(P: int, bs: int, G: int, Lb: int, cfg, dev) -> dict:
    """Request constants as tensors: P and L, block geometry, position tables (Lb + 1 entries; positions
    >= L, the trash column included, belong to no block), the lowest-k table and the decoded-fraction
    lookup tables, and the float knobs (`round_knobs`: 0-d float64). Shapes depend on (bs, G, Lb) only.
    Computed on the host and built one tensor each; the ones that do not depend on the prompt length are shared by
    the requests of one geometry and knobs (`_shared_tables`; read-only, as every table). A request's setup: ~230
    -> ~90 us on a tiny CPU request, then ~60."""
    L = P + G * bs
    longs = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    pos_block = longs([0 if p < P else min(1 + (p - P) // bs, G + 1) for p in range(Lb + 1)])
    stop = tuple(tuple(q) for q in cfg.stop) if cfg.stop else None  # (a hashable key, whatever sequences it came as)
    shared = _shared_tables(bs, G, Lb, float(cfg.branch_topp), float(cfg.block_add_threshold),
                            float(cfg.decoded_token_threshold), stop, tuple(round_knobs(cfg).items()), dev)
    scalar = lambda v: torch.scalar_tensor(v, dtype=torch.long, device=dev)  # noqa: E731 (~2 us; torch.tensor(v): ~7)
    return dict(
        shared,
        prompt_len=scalar(P),
        total_len=scalar(L),
        gen_pos=torch.arange(P, P + G * bs, device=dev),  # the generated positions, block-major
        block_start=longs([0] + [P + (i - 1) * bs for i in range(1, G + 1)]),
        block_end=longs([P] + [P + i * bs for i in range(1, G + 1)]),
        pos_block=pos_block,
        in_block=pos_block[:, None] == shared["block_index"][None, :],  # [Lb + 1, G + 1]: position p lies in block j
        seed=scalar(keyed.resolve_seed(cfg.seed) if cfg.temperature > 0 else 0),  # keyed draws
    )


@functools.lru_cache(maxsize=64)
def _shared_tables(bs: int, G: int, Lb: int, topp: float, add_threshold: float, decoded_threshold: float, stop,
                   knobs: tuple, dev) -> dict:
    """`init_tables`' entries that do not depend on the prompt length (normal tensors even when first built under
    inference mode: they outlive the request)."""
    # decoded-fraction tests as lookup tables over a block's mask count, computed with Python floats exactly
    # as upstream ((total - mc) / total >= tau). The prompt block has mc = 0 -> fraction 1.0, the same entry
    # as a full generated block, so one table of bs + 1 entries serves every block.
    frac = [(bs - c) / bs for c in range(bs + 1)]
    with torch.inference_mode(False):
        return dict(
            block_index=torch.arange(G + 1, device=dev),
            pos=torch.arange(Lb + 1, device=dev),
            lowest_k=torch.tensor(lowest_k_table(Lb, topp), dtype=torch.long, device=dev),
            stops=stop_table(stop, dev),
            grow_table=torch.tensor([f >= add_threshold for f in frac], device=dev),
            activate_table=torch.tensor([f >= decoded_threshold for f in frac], device=dev),
            **{name: knob(v, dev) for name, v in knobs},
        )


def init_state(model, prompt: torch.Tensor, G: int, Lb: int, NB: int, mask_id: int, cache=None) -> dict:
    """The round state of a fresh request (round 1: the prompt-only anchor in slot 0). cache: None (a new zero
    cache) or zeroed (k, v) [layers, Lb + 1, Hkv, D] views the request uses in its place (a batch's KV pool slot)."""
    dev = prompt.device
    P = prompt.numel()
    cfg = model.config
    x = torch.full((NB, Lb + 1), mask_id, dtype=torch.long, device=dev)
    x[:, :P] = prompt
    state = torch.zeros(G + 1, dtype=torch.long, device=dev)
    state[0] = TO_CACHE
    complete = torch.zeros(NB, G + 1, dtype=torch.bool, device=dev)
    complete[:, 0] = True
    cache_k, cache_v = request_cache(model, Lb + 1, cache)
    zero = lambda: torch.zeros((), dtype=torch.long, device=dev)  # noqa: E731
    st = dict(
        x=x, n_blocks=torch.zeros(NB, dtype=torch.long, device=dev), block_state=state, complete=complete,
        eos=torch.zeros(NB, dtype=torch.bool, device=dev), alive=torch.arange(NB, device=dev) == 0,
        creation_conf=torch.ones(NB, dtype=torch.float64, device=dev),
        look_pos=torch.full((NB,), -1, dtype=torch.long, device=dev),
        last_logit=torch.ones(cfg.vocab_size, dtype=model.dtype, device=dev),
        cache_k=cache_k, cache_v=cache_v, cache_len=zero(),
    )
    st["nonfinite"] = torch.full((), -1, dtype=torch.long, device=dev)
    st["round"] = zero()  # rounds run (the keyed sampler's step; 1 during the first round)
    st["counts"] = torch.zeros(len(ROUND_COUNTERS), dtype=torch.long, device=dev)
    return st


def plan(st: dict, T: dict, geo) -> None:
    """Grow, activation, termination, shared-prefix end and the to-cache span of the coming round, on the
    device (`ops.plan_round`, the plan part of `select_round`: round 1's plan, before any selection); writes
    n_blocks / complete and the plan tensors + `head` into st (no host read)."""
    pl = ops.plan_round(st["x"], st["n_blocks"], st["block_state"], st["complete"], st["eos"], st["alive"],
                        T["prompt_len"], T["gen_pos"], T["block_start"], T["block_end"], T["grow_table"],
                        T["activate_table"], bs=geo.bs, mask_id=geo.mask_id, shift=geo.shift, check=False)
    st.update(pl._asdict())
    _finish_head(st, T, geo)


def _finish_head(st: dict, T: dict, geo) -> None:
    """st["head"] [9]: the plan's 7 fields, the numerics guard's row and the stop check (a stop sequence in the
    anchor's finalised prefix: its generated tokens before its first mask)."""
    if geo.stop_lens:
        nA = st["head"][1]
        anchor_gen = st["x"].index_select(0, (nA - 1).reshape(1))[0].index_select(0, T["gen_pos"])
        stop = stop_in_prefix(anchor_gen, T["stops"], geo.stop_lens, geo.mask_id).reshape(1).long()
    elif torch.compiler.is_compiling():  # no stop sequences: nothing to look for (8 ops a round saved)
        stop = torch.zeros(1, dtype=torch.long, device=st["x"].device)
    else:  # (eagerly: one zero per device, never written)
        stop = _no_stop(st["x"].device)
    head = st["head"]
    st["head"] = torch.cat([head if head.shape[0] == 7 else head[:7], st["nonfinite"].reshape(1), stop])


@functools.lru_cache(maxsize=None)
def _no_stop(dev: torch.device) -> torch.Tensor:
    """The head's stop field [1] of a request without stop sequences on `dev` (0), shared by eager rounds (a normal
    tensor even when first asked for under inference mode)."""
    with torch.inference_mode(False):
        return torch.zeros(1, dtype=torch.long, device=dev)


def forward_part(st: dict, geo, w: dict, start, prefix_len) -> dict:
    """The round's part of `model.forward_requests` on `window_inputs`' w: every slot's window over the static
    cache; start / prefix_len: the window start as a host int eagerly (attention then slices exactly the committed
    rows), st["start"] / st["cache_len"] when compiled. With geo.fused_head the forward returns the final-normed
    rows (output="hidden": `finish_round` applies the fused `ops.head_confidence`), else the logits."""
    # dense: every row's window spans all Nb columns (an eager round's host fact: the torch attention's mask is lighter)
    return dict(tokens=w["tokens"], start=start, cache_k=st["cache_k"], cache_v=st["cache_v"], prefix_len=prefix_len,
                win_lens=w["win_lens"], bids=w["block_ids"], rows=w["rows"], dense=w.get("dense", False),
                output="hidden" if geo.fused_head else "logits")


def finish_round(st: dict, T: dict, geo, cfg, w: dict, logits, k_win, v_win, head=None, out=None) -> tuple[dict, dict]:
    """Everything of the round after its forward (logits [Rb, V] of the rows w["rows"], window K/V [layers, NB,
    Nb, Hkv, D]): token statistics, scores and the winner, the commit, the fill, the spawn and the next plan.
    Bucket padding never changes a value: window columns past a branch's length are masked keys and never masked
    positions, extra LM-head rows are computed and never read. Nothing needs a host read except `st["head"]`.
    geo.fused_head: `logits` are the final-normed hidden rows [Rb, H] and head the LM-head weight [V, H]: the
    statistics come from `fused_head_stats` (no fp32 [Rb, V] logits; under the shift the head keeps its raw
    logits in the model dtype, the next last_logit being one row of them). out: select_round's
    workspace for this round (`select_apply`), or None."""
    Nb = w["win_pos"].shape[0]
    st["round"] = st["round"] + 1
    # the needed rows: a host int when the caller knows it (an eager round: `n_real`), else counted on the device
    n_real = w["n_real"] if "n_real" in w else w["need_flat"].sum()
    if geo.fused_head:
        fused = fused_head_stats(st, cfg, geo, logits, head)
        stats = fused.table
        st["nonfinite"] = ops.first_bad(fused.finite, w["rows"], n_real, geo.NB * Nb, check=False)
    else:
        # numerics guard: the first needed raw row holding NaN / inf (before any deliberate -inf), else -1
        st["nonfinite"] = ops.first_nonfinite(logits, w["rows"], n_real, geo.NB * Nb, temperature(T, cfg))
        # stats table row 0 = the stale last_logit (predicts window position 0 under the shift): a table past one
        # statistics chunk is read as its two row blocks (no [Rb + 1, V] copy of the logits); a smaller one is
        # concatenated (one statistics pass, and the next last_logit is then one row of it: ~10 ops a round saved)
        last = st["last_logit"]
        table = [(last if last.dtype == logits.dtype else last.to(logits.dtype)).unsqueeze(0), logits] if geo.shift \
            else logits
        if geo.shift and logits.shape[0] < chunk_rows(logits.shape[-1]):
            table = [torch.cat(table)]
        keys = row_keys(st, T, w["rows"], st["start"], Nb, geo.shift, cfg)
        stats = token_stats(table, T, cfg, geo.use_conf_kernel, keys)
    u = st["commit_len"]  # this round's span (select_apply moves st on to the next plan)
    W, last_row, info = select_apply(st, T, geo, w, stats, out)
    if w.get("span") is None and (geo.fused_head or not geo.shift):
        # a compiled / captured round: the commit as ONE op (`ops.commit_round`: the winner's K/V rows into the cache,
        # the next last_logit from the logits the fused head kept), where its torch form is ~15 graph nodes
        last = st["last_logit"] if geo.shift else None
        ops.commit_round(st["cache_k"], st["cache_v"], st["cache_len"], k_win, v_win, W, u, last,
                         fused.logits if geo.shift else None, last_row if geo.shift else None, check=False)
        st["cache_len"] = st["cache_len"] + u
        return st, info
    if geo.NB == 1:  # one slot (D2F): the winner is slot 0, its K/V a view (two copies a round saved)
        k_span, v_span = k_win[:, 0], v_win[:, 0]
    else:
        W1 = W.reshape(1)
        k_span, v_span = k_win.index_select(1, W1)[:, 0], v_win.index_select(1, W1)[:, 0]
    commit_span(st, u, k_span, v_span, w.get("span"))
    if geo.shift:  # the winner's raw row u-1 is the next last_logit
        if geo.fused_head:  # table row r > 0 is raw row r - 1: that row of the logits the head kept
            new_last = fused.logits.index_select(0, (last_row - 1).clamp(min=0).reshape(1))[0]
            st["last_logit"] = torch.where((u > 0) & (last_row > 0), new_last,
                                           st["last_logit"].to(new_last.dtype))
        elif len(table) == 1:  # the one-block table: its row last_row is the winner's raw row u - 1 (or row 0)
            new_last = table[0].index_select(0, last_row.reshape(1))[0]
            span = w.get("span")
            if span is not None:  # an eager round knows u on the host: no device select (2 ops a round)
                if span[1] > 0:
                    st["last_logit"] = new_last
                elif st["last_logit"].dtype != new_last.dtype:
                    st["last_logit"] = st["last_logit"].to(new_last.dtype)
            else:
                st["last_logit"] = torch.where(u > 0, new_last, st["last_logit"].to(new_last.dtype))
        else:  # table row r > 0 is raw row r - 1; row 0 the stale last_logit itself
            raw = logits.index_select(0, (last_row - 1).clamp(min=0).reshape(1))[0]
            new_last = torch.where(last_row > 0, raw, table[0][0])
            st["last_logit"] = torch.where(u > 0, new_last, st["last_logit"].to(new_last.dtype))
    return st, info


def window_inputs(st: dict, T: dict, geo, Nb: int, Rb: int) -> dict:
    """The forward's inputs for every slot on the bucket (Nb, Rb) and the round's window facts (`ops.window_inputs`,
    one op; also bumps the LoPA-only counters that read the plan). Returns win_pos [Nb] (window positions, padding
    -> the trash column Lb), win_valid [Nb], tokens [NB, Nb], block_ids [NB, Nb] or None, win_lens [NB], need [NB,
    Nb] (LM-head rows needed), need_flat [NB * Nb], rows [Rb] (needed flat rows first, ascending)."""
    blocks = geo.mode == "block_causal"
    r = ops.window_inputs(st["x"], st["need"], st["alive"], st["window_lens"], st["running"], st["lens"],
                          st["layout_slot"], st["counts"], st["start"], T["total_len"], T["pos_block"], Nb=Nb, Rb=Rb,
                          blocks=blocks, check=False)
    st["counts"] = r.counts
    bids = r.win_block[None, :].expand(geo.NB, Nb) if blocks else None
    return dict(win_pos=r.win_pos, win_valid=r.win_valid, tokens=r.tokens, block_ids=bids, win_lens=r.win_lens,
                need=r.need, need_flat=r.need.reshape(-1), rows=r.rows)


def select_apply(st: dict, T: dict, geo, w: dict, stats: TokenStats,
                 out=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The round's selection and bookkeeping after its statistics table (`ops.select_round`, one op: scores and the
    winner, the fill, the spawn, the block transitions, the counters and the next plan; writes st). Returns
    (winner 0-d, last_row 0-d: the table row of the winner's raw row u - 1 under the shift, info: the round's
    trace facts score, winner, accepted, tokens, win_pos, look_pos)."""
    r = ops.select_round(
        stats.conf, stats.token, stats.p,
        st["x"], st["n_blocks"], st["block_state"], st["complete"], st["eos"], st["alive"], st["creation_conf"],
        st["look_pos"], st["counts"], st["exists"], st["active"], st["running"], st["is_mask"], st["lens"],
        st["to_cache"], st["shared_end"], st["layout_slot"], st["commit_len"],
        w["win_pos"], w["win_valid"], w["need_flat"],
        T["prompt_len"], T["gen_pos"], T["block_start"], T["block_end"], T["pos_block"], T["in_block"], T["lowest_k"],
        T["grow_table"], T["activate_table"], T["skip_threshold"], T["alpha"],
        bs=geo.bs, mask_id=geo.mask_id, eos_id=-1 if geo.eos_id is None else geo.eos_id, n_look=geo.n_look,
        shift=geo.shift, blend=geo.blend, score_all=geo.trace, check=False, out=out,
    )
    # (look_pos: a copy, since a captured graph writes the new state back into the same workspace tensors; an eager
    # round's outputs alternate between two workspaces (`out`), so this round's input stays put until the next round)
    info = dict(score=r.score, winner=r.winner, accepted=r.accepted, tokens=r.tokens, win_pos=w["win_pos"],
                look_pos=st["look_pos"] if out is not None else st["look_pos"].clone())
    st.update(zip(_STATE_OUT, [r[i] for i in _STATE_IDX]))  # (a list: a generator left unfinished is closed by a
    # GeneratorExit raised into it, ~5 us of a tiny CPU round)
    _finish_head(st, T, geo)
    return r.winner, r.last_row, info


# the op's outputs that are round state (the rest are the round's decision)
_STATE_OUT = tuple(f for f in ref_ops.SelectRound._fields if f not in ("winner", "score", "last_row", "accepted",
                                                                         "tokens"))
_STATE_IDX = tuple(ref_ops.SelectRound._fields.index(f) for f in _STATE_OUT)


def commit_span(st: dict, u, k_span: torch.Tensor, v_span: torch.Tensor, span: tuple | None = None) -> None:
    """Commit the winner's first u window positions (u: this round's span length, 0-d tensor or int;
    k_span / v_span [layers, c, Hkv, D]: its window K/V from column 0, c >= u; rows past u go to the trash
    row Lb) and advance cache_len by u. span: None, or (cache_len, u) as host ints (an eager round knows them from
    its head): two slice copies instead of the masked index_copy_ (7 ops -> 3)."""
    if span is not None:
        at, n = span
        ck = st["cache_k"]
        # (the forward may have written them there already, `in_cache`: then k_span starts at cache row `at`, read from
        # the pointers, without two slice views a round)
        if k_span.data_ptr() != ck.data_ptr() + at * ck.stride(1) * ck.element_size():
            ck[:, at : at + n].copy_(k_span[:, :n])
            st["cache_v"][:, at : at + n].copy_(v_span[:, :n])
        st["cache_len"] = st["cache_len"] + n
        return
    i = torch.arange(k_span.shape[1], device=k_span.device)
    dst = torch.where(i < u, st["cache_len"] + i, st["cache_k"].shape[1] - 1)
    # in place: the cache is the round's largest tensor (a Dream-7B request: ~70 MB), never copied per round
    st["cache_k"].index_copy_(1, dst, k_span)
    st["cache_v"].index_copy_(1, dst, v_span)
    st["cache_len"] = st["cache_len"] + u
