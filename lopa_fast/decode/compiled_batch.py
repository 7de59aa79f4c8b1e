"""Batched compiled rounds: the live requests of a batch whose next step has the same key run it as ONE compiled /
captured callable (one shared forward + every request's bookkeeping), one graph per (step key, batch-size bucket),
the way nano-vllm captures its decode step once per batch size.

A driver describes its step as a `BatchStep` (key, workspace key, `pre` / `post` around the forward); `run(steps)`
runs a group over a workspace of lanes: docs/internals.md. This module, like compiled.py, knows no strategy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from lopa_fast.decode.shapes import pow2_bucket


@dataclass
class BatchStep:
    """One request's coming step, as the batched callable needs it (module docstring). key / bucket / label /
    workspace / pre / post / mode / attn_backend are the same for every request of one key (the first one's are
    used); state, tables, view are the request's own. rounds: the model's CompiledRounds."""

    rounds: Any
    key: tuple
    bucket: tuple
    label: str
    workspace: Any
    pre: Callable
    post: Callable
    mode: str
    attn_backend: str
    state: dict
    tables: dict
    view: Any
    # a step of several dependent forwards (APD: the drafter's, then the verifier's over the drafts): forwards =
    # ((model, mask, attention backend), ...) in order, and between forward f and f + 1 the stage
    # mids[f](st, T, ctx, logits, k_win, v_win) -> (the next forward's part, ctx); None: one forward of the model
    # `run` is given, with `mode` / `attn_backend`
    forwards: tuple | None = None
    mids: tuple = ()


def batch_bucket(n: int) -> int:
    """The batch-size bucket of a group of n requests: the next power of two (1, 2, 4, 8, ...)."""
    return pow2_bucket(n, 1)


def run(steps: list[BatchStep], model) -> list[tuple[dict, dict]]:
    """Run one step of every request in `steps` (one key) as the key's batched callable; returns per request (its
    state dict, its values updated in place; its info: graph-owned tensors under a capture, rewritten by the next
    replay of this key)."""
    first = steps[0]
    cr, Bb = first.rounds, batch_bucket(len(steps))
    label = f"{first.label}_x{Bb}"
    views = [s.view for s in steps]
    captured = cr.captures(first.state[next(iter(first.state))])

    def call(entry: "_Entry"):
        if entry.lanes is None:  # a compiled callable whose workspace was freed (`free_workspaces`): new lanes
            entry.lanes, entry.owners, entry.residents = _lanes(cr, first, Bb)
        return _call(entry, steps)

    return cr.get_or_build(("batch", Bb, first.key), (*first.bucket, f"x{Bb}"), label, views,
                           lambda: _build(cr, first, model, Bb, label, views, captured), call,
                           captured=captured)


class _Entry:
    """A key's batched callable: lanes (its workspace's first Bb (state, tables) pairs; None once
    `free_workspaces` took them from a compiled one), replay() -> flat info {"lane.name": tensor}, captured (a CUDA
    graph, real or emulated) or compiled, which lane last got which request's tables (owners) and whose state lives
    in which lane (residents, `_call`; both lists are the workspace's, shared by its entries), its workspace key."""

    def __init__(self, lanes, replay, captured: bool, owners: list, wkey=None, residents: list | None = None):
        self.lanes, self.replay, self.captured, self.owners, self.wkey = lanes, replay, captured, owners, wkey
        self.residents = residents


# id(request state dict) -> (residents list, lanes list, lane index): where each resident request's state lives,
# over every workspace (a request whose key changes moves between workspaces). A resident's dict is held by its
# residents entry, so its id is never reused while it is in here.
_RESIDENCE: dict = {}


def release(state: dict | None) -> None:
    """A request leaves its batch (lopa_fast.decode.batch.Scheduler): its state, if it lives in a lane, goes back
    into its own tensors (`_leave`) before the tensors' memory (e.g. its KV pool slot) is handed to another request."""
    at = _RESIDENCE.get(id(state)) if state is not None else None
    if at is not None:
        _leave(at[1], at[0], at[2])


def _leave(lanes: list, residents: list, j: int) -> None:
    """Lane j's resident request (residents[j] = (its state dict, its home tensors), or None) leaves the lane: each
    of its entries still bound to a lane tensor is copied back into its home tensor and bound to it again."""
    res = residents[j]
    if res is None:
        return
    state, home = res
    S = lanes[j][0]
    back = [k for k, v in state.items() if k in S and v is S[k]]
    _copy([home[k] for k in back], [S[k] for k in back])
    for k in back:
        state[k] = home[k]
    residents[j] = None
    if _RESIDENCE.get(id(state), (None,))[0] is residents:
        del _RESIDENCE[id(state)]


def _tensors(entry_or_ws) -> list:
    lanes = entry_or_ws.lanes if isinstance(entry_or_ws, _Entry) else entry_or_ws["lanes"]
    return [t for S, T in lanes or () for d in (S, T) for t in d.values()]


def lane_bytes(cr, keys=None) -> int:
    """Bytes of the batched-step workspaces `cr` (a model's CompiledRounds) holds (keys: None, or only those of
    these workspace keys): every lane tensor of its workspaces and of the callables built over them (an older,
    smaller workspace lives on in its graphs), each storage counted once."""
    seen, n = set(), 0
    wss = [ws for k, ws in cr.workspaces.items() if k[:1] == ("batch",) and (keys is None or k[1] in keys)]
    entries = [e for e in cr.fns.values() if isinstance(e, _Entry) and (keys is None or e.wkey in keys)]
    for t in [t for x in wss + entries for t in _tensors(x)]:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


def free_workspaces(cr, keep, only=None) -> None:
    """Free the batched-step workspaces of `cr` whose workspace key (BatchStep.workspace) is not in `keep` (the keys
    of the live requests; only: None, or the keys that may go): the workspace, the captured graphs over its lanes (a
    graph is bound to their memory: it captures again when asked) and the lanes of the compiled callables (a
    compiled one keeps its code and takes new lanes on its next call: `run`). The batch engine calls it when a
    request waits for memory (`BatchEngine.reclaim`: idle lanes never hold memory a request needs; issue 36)."""
    def goes(wkey) -> bool:
        return wkey not in keep and (only is None or wkey in only)

    for k in [k for k in cr.workspaces if k[:1] == ("batch",) and goes(k[1])]:
        ws = cr.workspaces[k]
        for j in range(len(ws["lanes"])):  # their residents' state goes home first
            _leave(ws["lanes"], ws["residents"], j)
        del cr.workspaces[k]
    for k, e in [(k, e) for k, e in cr.fns.items() if isinstance(e, _Entry) and goes(e.wkey)]:
        if e.captured:
            del cr.fns[k]
        else:
            e.lanes = e.owners = e.residents = None


def _lanes(cr, first: BatchStep, Bb: int) -> tuple[list, list, list]:
    """The workspace of first.workspace with at least Bb lanes (a new one, from clones of this request's state and
    tables, when there is none, it is smaller or its state has other fields); returns (lanes, table owners, state
    residents)."""

    def fits(ws) -> bool:
        return len(ws["lanes"]) >= Bb and ws["lanes"][0][0].keys() == first.state.keys()

    def make() -> dict:
        lanes = [({k: v.clone() for k, v in first.state.items()}, {k: v.clone() for k, v in first.tables.items()})
                 for _ in range(Bb)]
        return {"lanes": lanes, "owners": [None] * Bb, "residents": [None] * Bb}

    old = cr.workspaces.get(("batch", first.workspace))
    ws = cr.workspace(("batch", first.workspace), fits, make)
    if old is not None and old is not ws:  # a replaced workspace: its residents' state goes home
        for j in range(len(old["lanes"])):
            _leave(old["lanes"], old["residents"], j)
    return ws["lanes"][:Bb], ws["owners"], ws["residents"]


def _batched_step(model, first: BatchStep):
    """step(states, tables) -> [(state, info)] for Bb lanes: every lane's `pre`, then per forward ONE
    `forward_requests` over the lanes' parts (per-request attention: no pool) followed by every lane's next stage
    (a `mids` entry, the last one `post`)."""
    fwds = first.forwards or ((model, first.mode, first.attn_backend),)
    stages = (*first.mids, first.post)
    if len(stages) != len(fwds):
        raise ValueError(f"BatchStep {first.label}: {len(fwds)} forwards need {len(fwds) - 1} mids, got "
                         f"{len(first.mids)}")
    pre = first.pre

    def batched_step(states: list, tables: list) -> list:
        outs = [pre(st, T) for st, T in zip(states, tables)]  # (part, ctx) per lane
        for (m, mode, backend), stage in zip(fwds, stages):
            res = m.forward_requests([part for part, _ in outs], mode, backend)
            outs = [stage(st, T, ctx, *o) for st, T, (_, ctx), o in zip(states, tables, outs, res)]
        return outs  # (state, info) per lane

    return batched_step


def _build(cr, first: BatchStep, model, Bb: int, label: str, views, captured: bool) -> _Entry:
    """The key's entry: its lanes and the batched step over them as one graph (`CompiledRounds.build`: captured on
    CUDA / emulate_graphs, else torch.compile'd over the same lane tensors, so its guards see the same inputs)."""
    lanes, owners, residents = _lanes(cr, first, Bb)
    step = _batched_step(model, first)

    def body(states: list, tables: list, write: bool = True) -> dict:  # the step on the lanes, written back
        outs = step([dict(S) for S in states], tables)  # into them (write); returns the flat info
        flat, dst, src = {}, [], []
        for j, (S, (out, info)) in enumerate(zip(states, outs)):
            for k, v in out.items():
                if write and v is not S[k]:  # in-place updates (the cache's commits) are there already
                    dst.append(S[k])
                    src.append(v)
            for k, v in info.items():
                if v is not None:
                    flat[f"{j}.{k}"] = v
        if captured:  # a D2F round's 27 state fields were 27 graph nodes, now 4 (one multi-tensor copy per dtype)
            _copy(dst, src)
        else:  # torch.compile: per field. A grouped `_foreach_copy_` whose sources are computed from its destinations
            # at other positions is miscompiled by Inductor (torch 2.13, CPU: the fused kernel reads a destination
            # while writing it; pytorch/pytorch#198033's class; 8 lines reproduce it with x <- x.flip(0) + 1), and
            # changed APD's tokens; Inductor fuses the per-field copies itself. (Captured: eager kernels, every
            # source materialised before the copy, and no source shares storage with another field's destination.)
            for d, v in zip(dst, src):
                d.copy_(v)
        return flat

    states, tables = [S for S, _ in lanes], [T for _, T in lanes]
    capture = None
    if captured:
        # warm-up on scratch copies (kernels compile / autotune; it returns (state, outputs) as a step does, for
        # the tests' emulated capture), then the capture over the lanes
        capture = (lambda: (None, body([{k: v.clone() for k, v in S.items()} for S in states], tables, write=False)),
                   lambda: body(states, tables))
    fn = cr.build(label, views, body, capture)
    entry = _Entry(lanes, None, captured, owners, first.workspace, residents)
    # the lanes read at each call: `free_workspaces` may replace a compiled entry's (same shapes: the same compiled
    # graph); a captured graph reads the lanes it was captured over and ignores its arguments
    entry.replay = lambda: fn([S for S, _ in entry.lanes], [T for _, T in entry.lanes])
    return entry


def _copy(dst: list, src: list) -> None:
    """dst[i].copy_(src[i]) as one multi-tensor copy per (dtype, dtype, device) group: CUDA's fused route takes one
    dtype a list and falls back to one copy_ a tensor otherwise (a request's ~29 state fields of 4-5 dtypes: ~29
    launches mixed, ~4-5 grouped)."""
    groups: dict = {}
    for d, v in zip(dst, src):
        a, b = groups.setdefault((d.dtype, v.dtype, d.device), ([], []))
        a.append(d)
        b.append(v)
    for a, b in groups.values():
        torch._foreach_copy_(a, b)


def _call(entry: _Entry, steps: list[BatchStep]) -> list[tuple[dict, dict]]:
    """Run the callable over the requests' lanes; per request (state, info).

    A request's state lives in its lane between steps (it is the lane's resident: its state dict's entries ARE the
    lane tensors), so a request that steps in the same lane again copies nothing in or out (before: ~2 x 29 state
    copies around every replay, run eagerly, the KV cache among them: 2 x 58 MB a round at Dream-7B). First every
    lane of the call whose resident is not the request it gets now is emptied (`_leave`: a replay rewrites every
    lane it runs, the padding ones too), and so is any other lane a request lives in (its key changed: another
    workspace); then each request is loaded: the entries not already its lane's tensors are copied in and its dict
    is bound to the lane, its own tensors kept as its home (`release` sends it home when it leaves the batch).
    Request constants (tables) are loaded when the lane last held another request's."""
    lanes, owners, residents = entry.lanes, entry.owners, entry.residents
    for j in range(len(lanes)):
        res = residents[j]
        if res is not None and (j >= len(steps) or res[0] is not steps[j].state):
            _leave(lanes, residents, j)
    for j, s in enumerate(steps):
        at = _RESIDENCE.get(id(s.state))
        if at is not None and (at[0] is not residents or at[2] != j):
            _leave(at[1], at[0], at[2])
    for j, s in enumerate(steps):
        S, TS = lanes[j]
        if S.keys() != s.state.keys():
            raise RuntimeError(f"batched step: request state fields {sorted(s.state)} differ from its workspace's "
                               f"{sorted(S)} (one workspace key must mean one state layout)")
        home = residents[j][1] if residents[j] is not None else {}
        load = [k for k in S if s.state[k] is not S[k]]  # all of them for a request new to the lane
        _copy([S[k] for k in load], [s.state[k] for k in load])
        for k in load:
            home[k] = s.state[k]
            s.state[k] = S[k]
        residents[j] = (s.state, home)
        _RESIDENCE[id(s.state)] = (residents, lanes, j)
        if owners[j] is not s.tables:  # request constants: loaded when the lane last held another request
            tn = list(TS)
            _copy([TS[k] for k in tn], [s.tables[k] for k in tn])
            owners[j] = s.tables
    flat = entry.replay()
    out = []
    for j, s in enumerate(steps):
        prefix = f"{j}."
        info = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
        out.append((s.state, info))
    return out
