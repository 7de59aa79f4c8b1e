"""`window_inputs`: a D2F / LoPA round's forward inputs on its bucket, as one op (the host has read the round's head
and chosen the bucket Nb, Rb). See reference.ops.window_inputs (the oracle, and the `torch` backend).

Backends: `cpp` (csrc/window_inputs_cpu.cpp in `lopa_fast._C`: the default on CPU tensors when built), `triton`
(kernels/triton/window_inputs.py: one launch; the default on CUDA tensors) and `torch`. No CUDA C++ kernel. Integers
and booleans only: every backend returns the same values.
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.reference.ops import ROUND_COUNTERS, WindowInputs

_NAMES = ("x", "need_all", "alive", "window_lens", "running", "lens", "layout_slot", "counts", "start", "total_len",
          "pos_block")


def _check(args: tuple, Nb: int, Rb: int) -> None:
    if len(args) != len(_NAMES) or not all(isinstance(t, torch.Tensor) for t in args):
        raise ValueError(f"window_inputs: expected {len(_NAMES)} tensors: {', '.join(_NAMES)}")
    x = args[0]
    if x.dim() != 2:
        raise ValueError(f"window_inputs: x must be [NB, Lb + 1], got {tuple(x.shape)}")
    NB, Lb1 = x.shape
    if not isinstance(Nb, int) or not isinstance(Rb, int) or Nb < 1 or not 1 <= Rb <= NB * Nb:
        raise ValueError(f"window_inputs: Nb={Nb!r}, Rb={Rb!r}; allowed: Nb >= 1, 1 <= Rb <= NB * Nb = {NB * Nb}")
    L, B = torch.long, torch.bool
    want = dict(x=((NB, Lb1), L), need_all=((NB, Lb1), B), alive=((NB,), B), window_lens=((NB,), L),
                running=((NB,), B), lens=((NB,), L), layout_slot=((), L), counts=((len(ROUND_COUNTERS),), L),
                start=((), L), total_len=((), L), pos_block=((Lb1,), L))
    for name, t in zip(_NAMES, args):
        shape, dtype = want[name]
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != x.device:
            raise ValueError(f"window_inputs: {name} is {t.dtype} {tuple(t.shape)} on {t.device}; expected {dtype} "
                             f"{shape} on {x.device}")


def _outputs(x: torch.Tensor, Nb: int, Rb: int, blocks: bool, split: bool) -> list[torch.Tensor]:
    """Fresh outputs (WindowInputs' fields). split: the long and the bool ones as views of one buffer each (eager:
    2 allocations instead of 8; a custom op's outputs may not alias)."""
    NB, dev = x.shape[0], x.device
    nblk = Nb if blocks else 0
    if not split:
        e = lambda *s, dt=torch.long: torch.empty(s, dtype=dt, device=dev)  # noqa: E731
        return [e(Nb), e(Nb, dt=torch.bool), e(NB, Nb), e(nblk), e(NB), e(NB, Nb, dt=torch.bool), e(Rb), e(8)]
    pos, tokens, block, wl, rows, counts = torch.empty(Nb + NB * Nb + nblk + NB + Rb + 8, dtype=torch.long,
                                                       device=dev).split_with_sizes([Nb, NB * Nb, nblk, NB, Rb, 8])
    valid, need = torch.empty(Nb + NB * Nb, dtype=torch.bool, device=dev).split_with_sizes([Nb, NB * Nb])
    return [pos, valid, tokens.view(NB, Nb), block, wl, need.view(NB, Nb), rows, counts]


def window_inputs(*args: torch.Tensor, Nb: int, Rb: int, blocks: bool, check: bool = True,
                  backend: str | None = None) -> WindowInputs:
    """The round's forward inputs (reference.ops.window_inputs' 11 positional tensors and keywords). backend: None
    (auto: `cpp` on CPU tensors when lopa_fast._C is built, triton on CUDA, else torch) | "cpp" | "triton" |
    "torch"."""
    if check:
        _check(args, Nb, Rb)
    b = _backend.resolve("window_inputs", backend, args[0].device)
    if b == "torch":
        return ref.window_inputs(*args, Nb=Nb, Rb=Rb, blocks=blocks)
    if b == "cpp" and torch.compiler.is_compiling():  # one node of the compiled graph
        return WindowInputs(*torch.ops.lopa_fast.cpp_window_inputs(list(args), Nb, Rb, bool(blocks)))
    if b == "triton":
        outs = _outputs(args[0], Nb, Rb, blocks, split=False)
        return WindowInputs(*_backend.kernel("window_inputs", "triton")(list(args), outs, Nb=Nb, Rb=Rb,
                                                                        blocks=blocks))
    return WindowInputs(*_run_cpp(list(args), Nb, Rb, blocks, split=True))


def _run_cpp(args: list[torch.Tensor], Nb: int, Rb: int, blocks: bool, split: bool) -> list[torch.Tensor]:
    """The C++ kernel on fresh outputs (lopa_fast._C.window_inputs_cpu takes the data pointers)."""
    outs = _outputs(args[0], Nb, Rb, blocks, split=split)
    dims = [args[0].shape[0], args[0].shape[1], Nb, Rb, int(bool(blocks))]
    return _backend.run_cpp("window_inputs_cpu", args, outs, dims)


@torch.library.custom_op("lopa_fast::cpp_window_inputs", mutates_args=())
def _cpp_op(args: list[torch.Tensor], Nb: int, Rb: int, blocks: bool) -> list[torch.Tensor]:
    return _run_cpp(args, Nb, Rb, blocks, split=False)


@_cpp_op.register_fake
def _(args, Nb, Rb, blocks):
    return _outputs(args[0], Nb, Rb, blocks, split=False)
