"""Shape policy shared by every fast decoder: how lengths and window sizes are rounded so that requests and steps
of nearby sizes share compiled / captured graphs and pool slots; the padded stop-sequence table and its check.

One place for each number: LENGTH_QUANTUM (buffer lengths, KV pool slot growth), MIN_BUCKET (a compiled step's
smallest row / column bucket)."""
from __future__ import annotations

import math

import torch

# buffer lengths are rounded up to this many positions, so requests whose prompt + generation lengths fall in one
# band share their compiled rounds / steps and their pool slots (the prefix attention reads at most
# LENGTH_QUANTUM - 1 extra masked rows)
LENGTH_QUANTUM = 64
# the smallest bucket of a compiled step (window columns, draft rows): below it a bucket costs a compile more than
# the padded rows cost
MIN_BUCKET = 16


def quantized_length(n: int) -> int:
    """n rounded up to a multiple of LENGTH_QUANTUM."""
    return -(-n // LENGTH_QUANTUM) * LENGTH_QUANTUM


def pow2_bucket(n: int, smallest: int = MIN_BUCKET) -> int:
    """A compiled step's size for n rows / columns: the next power of two, at least `smallest`."""
    return max(smallest, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def stop_table(stop, dev, min_rows: int = 0) -> torch.Tensor:
    """The stop sequences (tuples of ids) as a zero-padded [max(S, min_rows), max length] long tensor on `dev`
    (the rows past S are zeros; [min_rows, 1] when there are none)."""
    seqs = list(stop or ())
    width = max((len(q) for q in seqs), default=1)
    t = torch.zeros((max(len(seqs), min_rows), width), dtype=torch.long)
    for j, q in enumerate(seqs):
        t[j, : len(q)] = torch.tensor(q)
    return t.to(dev)


def stop_in_prefix(row: torch.Tensor, stops: torch.Tensor, stop_lens: tuple, mask_id: int, first=None):
    """0-d bool: a stop sequence (the `stop_table` rows `stops`, lengths `stop_lens`) lies in row [n] before its
    first mask (the finalised prefix), starting at `first` or later (0-d; None: anywhere). A static loop over the
    (few, short) sequences: no host read."""
    n, dev = row.shape[0], row.device
    masks = row == mask_id
    end = torch.where(masks.any(), masks.long().argmax(), n)  # argmax: the first True
    hit = torch.zeros((), dtype=torch.bool, device=dev)
    for j, ln in enumerate(stop_lens):
        if ln > n:
            continue
        start = torch.arange(n - ln + 1, device=dev)
        match = (row.unfold(0, ln, 1) == stops[j, :ln][None, :]).all(1) & (start + ln <= end)
        hit = hit | (match if first is None else match & (start >= first)).any()
    return hit


def knob(value: float | None, dev) -> torch.Tensor:
    """A float knob as a 0-d float64 tensor on `dev` (0.0 when the knob is None): a runtime input of a compiled /
    captured step, read from its tables, so requests that differ only in the value share one graph (issue 28:
    every temperature, top_p or threshold compiled a graph of its own). Only whether a knob is on (T > 0, a top-p
    filter, which threshold rule) changes a graph; that stays in the step's geometry (its compile key).
    float64 as a Python float: an op with a 0-d tensor rounds it to the other operand's dtype as it rounds a Python
    scalar (write the knob as the right operand: `t * k`, never `k * t`, and `t.reciprocal() * k` for `k / t`, as
    Python's reflected operators do; `lopa_fast.keyed.knob_pow` for `t ** k`)."""
    # (scalar_tensor: ~2 us; torch.tensor of a Python float: ~6, four knobs a request)
    return torch.scalar_tensor(0.0 if value is None else float(value), dtype=torch.float64, device=dev)


def scaled(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """t * k for a knob k (0-d float64, `knob`) as `t * python_float` computes it on the CPU: in float32 and rounded
    once to t's dtype when t is bf16 / fp16 (on CUDA a 0-d tensor operand would be rounded to bf16 first), plainly
    otherwise."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return (t.float() * k).to(t.dtype)
    return t * k


def divided(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """t / k for a knob k, as `t / python_float` computes it on the CPU (see `scaled`)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return (t.float() / k).to(t.dtype)
    return t / k
