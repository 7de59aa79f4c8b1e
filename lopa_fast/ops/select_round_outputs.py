"""The output tensors of `select_round` (its `SelectRound` fields), shared by every backend's launcher: a module of
its own, importing nothing of lopa_fast.ops, so the CUDA launchers (lopa_fast.ops.cuda) can allocate the same
layout without an import cycle through the public op's dispatch."""
from __future__ import annotations

import functools
import math

import torch

from lopa_fast.reference.ops import RoundPlan, SelectRound


def _shapes_of(NB: int, Lb1: int, G1: int, Nb: int) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each `SelectRound` field, in order."""
    L, B, F64 = torch.long, torch.bool, torch.float64
    return [((), L), ((NB,), F64), ((), L), ((Nb,), B), ((Nb,), L),  # winner, score, last_row, accepted, tokens
            ((NB, Lb1), L), ((NB,), B), ((NB,), B), ((NB,), F64), ((NB,), L), ((G1,), L), ((8,), L),
            ((NB,), L), ((NB, G1), B), ((NB, G1), B), ((NB, G1), B), ((NB,), B), ((NB,), B), ((NB, Lb1), B),
            ((NB, Lb1), B), ((NB,), L), ((NB,), L), ((G1,), B), ((), L), ((), L), ((), L), ((), L),
            ((7,), L)]


@functools.lru_cache(maxsize=256)
def _split_plan(NB: int, Lb1: int, G1: int, Nb: int) -> tuple:
    """Per dtype: (dtype, total elements, sizes, ((field index, shape or None for a 1-d field), ...)), computed once
    per geometry (a round's Python glue costs more than its C++ kernel on the tiny models)."""
    shapes = _shapes_of(NB, Lb1, G1, Nb)
    plan = []
    for dtype in (torch.long, torch.bool, torch.float64):
        idx = [k for k, (_, dt) in enumerate(shapes) if dt == dtype]
        sizes = [math.prod(shapes[k][0]) for k in idx]
        plan.append((dtype, sum(sizes), sizes, tuple((k, None if len(shapes[k][0]) == 1 else shapes[k][0])
                                                      for k in idx)))
    return tuple(plan)


def outputs(args, split: bool = True) -> list[torch.Tensor]:
    """Fresh output tensors of a select_round call (the `SelectRound` fields, in order). split: one buffer per
    dtype, split into the fields (3 allocations instead of 28: on a tiny CPU round the allocations cost more than
    the kernel; eager only, since a custom op's outputs may not alias one another)."""
    x = args[3]
    return outputs_for(x.shape[0], x.shape[1], args[5].shape[0], args[21].shape[0], x.device, split)


def outputs_for(NB: int, Lb1: int, G1: int, Nb: int, dev, split: bool = True) -> list[torch.Tensor]:
    """`outputs` by the round's dims (NB slots, Lb1 = Lb + 1 columns, G1 = G + 1 blocks, Nb window columns): e.g. a
    driver's persistent workspace for the C++ kernel (`select_round(..., out=...)`)."""
    dims = (NB, Lb1, G1, Nb)
    if not split:
        return [torch.empty(shape, dtype=dt, device=dev) for shape, dt in _shapes_of(*dims)]
    out: list = [None] * len(SelectRound._fields)
    for dtype, total, sizes, fields in _split_plan(*dims):
        parts = torch.empty(total, dtype=dtype, device=dev).split_with_sizes(sizes)
        for t, (k, shape) in zip(parts, fields):
            out[k] = t if shape is None else t.view(shape)
    return out


_PLAN_FIRST = len(SelectRound._fields) - len(RoundPlan._fields)  # the plan's fields close a SelectRound


def plan_outputs(NB: int, Lb1: int, G1: int) -> list[torch.Tensor]:
    """Fresh output tensors of a plan_round call (the `RoundPlan` fields, in order): one buffer per dtype, split."""
    out: list = [None] * len(RoundPlan._fields)
    for dtype, sizes, mine in _plan_split(NB, Lb1, G1):
        parts = torch.empty(sum(sizes), dtype=dtype).split_with_sizes(sizes)
        for t, (k, shape) in zip(parts, mine):
            out[k] = t if shape is None else t.view(shape)
    return out


@functools.lru_cache(maxsize=256)
def _plan_split(NB: int, Lb1: int, G1: int) -> tuple:
    """`_split_plan` restricted to the plan's fields: per dtype that has one, (dtype, sizes, ((field index in
    RoundPlan, shape or None), ...)), computed once per geometry."""
    shapes = _shapes_of(NB, Lb1, G1, 1)
    plan = []
    for dtype, _, _, fields in _split_plan(NB, Lb1, G1, 1):
        mine = tuple((k - _PLAN_FIRST, shape) for k, shape in fields if k >= _PLAN_FIRST)
        if mine:
            plan.append((dtype, [math.prod(shapes[k + _PLAN_FIRST][0]) for k, _ in mine], mine))
    return tuple(plan)
