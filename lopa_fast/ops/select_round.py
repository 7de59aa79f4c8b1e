"""`select_round`: a D2F / LoPA round's selection and bookkeeping after its token statistics, as one op; and
`plan_round`, its plan part alone (round 1's plan, before any selection: every later plan is select_round's).
See reference.ops.select_round / plan_round (the oracles, and the `torch` backends) for every argument.

Backends: `cpp` (csrc/select_round_cpu.cpp in the extension `lopa_fast._C`, built at install: the default on CPU
tensors when it is present), `torch` (the reference's vectorised ops: what compile / capture trace when no kernel
takes the op), `triton` and `cuda` when their kernels load. Every backend returns the same bits.
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.ops.select_round_outputs import outputs as _outputs
from lopa_fast.ops.select_round_outputs import plan_outputs as _plan_outputs
from lopa_fast.reference.ops import RoundPlan, SelectRound

_STATE = ("x", "n_blocks", "block_state", "complete", "eos", "alive", "creation_conf", "look_pos", "counts",
          "exists", "active", "running", "is_mask", "lens", "to_cache", "shared_end", "layout_slot", "commit_len")
_WINDOW = ("win_pos", "win_valid", "need_flat")
_TABLES = ("prompt_len", "gen_pos", "block_start", "block_end", "pos_block", "in_block", "lowest_k", "grow_table",
           "activate_table", "skip_threshold", "alpha")
_NAMES = ("conf", "token", "p") + _STATE + _WINDOW + _TABLES


def _expected(NB: int, Lb1: int, G1: int, Nb: int, bs: int, S: int) -> dict:
    """name -> (shape, dtype) of every tensor argument."""
    L, B, F64 = torch.long, torch.bool, torch.float64
    return dict(
        conf=((S,), torch.float32), token=((S,), L), p=((S,), torch.float32),
        x=((NB, Lb1), L), n_blocks=((NB,), L), block_state=((G1,), L), complete=((NB, G1), B), eos=((NB,), B),
        alive=((NB,), B), creation_conf=((NB,), F64), look_pos=((NB,), L), counts=((len(ref.ROUND_COUNTERS),), L),
        exists=((NB, G1), B), active=((NB, G1), B), running=((NB,), B), is_mask=((NB, Lb1), B), lens=((NB,), L),
        to_cache=((G1,), B), shared_end=((), L), layout_slot=((), L), commit_len=((), L),
        win_pos=((Nb,), L), win_valid=((Nb,), B), need_flat=((NB * Nb,), B),
        prompt_len=((), L), gen_pos=(((G1 - 1) * bs,), L), block_start=((G1,), L), block_end=((G1,), L),
        pos_block=((Lb1,), L), in_block=((Lb1, G1), B), lowest_k=((Lb1,), L), grow_table=((bs + 1,), B),
        activate_table=((bs + 1,), B), skip_threshold=((), F64), alpha=((), F64),
    )


def _check(args: tuple, bs: int, mask_id: int, eos_id: int, n_look: int) -> None:
    named = _backend.named_tensors("select_round", _NAMES, args)
    x = named["x"]
    if x.dim() != 2:
        raise ValueError(f"select_round: x must be [NB, Lb + 1], got {tuple(x.shape)}")
    NB, Lb1 = x.shape
    G1 = named["block_state"].numel()
    Nb = named["win_pos"].numel()
    S = named["conf"].numel()
    if not isinstance(bs, int) or bs < 1 or (G1 - 1) * bs >= Lb1:
        raise ValueError(f"select_round: bs={bs!r} with G={G1 - 1} blocks does not fit x's {Lb1} positions")
    if not isinstance(n_look, int) or not (n_look == 0 or n_look == NB - 1):
        raise ValueError(f"select_round: n_look={n_look!r}; allowed: 0 or NB - 1 = {NB - 1}")
    if not isinstance(mask_id, int) or mask_id < 0 or not isinstance(eos_id, int) or eos_id < -1:
        raise ValueError(f"select_round: mask_id={mask_id!r} must be >= 0, eos_id={eos_id!r} >= -1 (-1: none)")
    for name, (shape, dtype) in _expected(NB, Lb1, G1, Nb, bs, S).items():
        t = named[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"select_round: {name} is {t.dtype} {tuple(t.shape)}; expected {dtype} {shape}")
        if t.device != x.device:
            raise ValueError(f"select_round: {name} is on {t.device}, x on {x.device}")


def select_round(*args: torch.Tensor, bs: int, mask_id: int, eos_id: int, n_look: int, shift: bool, blend: bool,
                 score_all: bool, check: bool = True, backend: str | None = None,
                 out: list[torch.Tensor] | None = None) -> SelectRound:
    """The round's decision, next state and next plan (reference.ops.select_round's positional tensor arguments
    and keywords). backend: None (auto: `cpp` on CPU tensors when lopa_fast._C is built, the kernels on CUDA) |
    "cpp" | "triton" | "cuda" | "torch".
    out: None, or a workspace the eager `cpp` kernel fills instead of allocating (`select_round_outputs.outputs_for`
    of the call's dims; it must not alias an input: a driver alternates two; the allocations cost ~50 us of a tiny
    CPU round, more than the kernel); the other backends return fresh tensors."""
    if check:
        _check(args, bs, mask_id, eos_id, n_look)
    kw = dict(bs=bs, mask_id=mask_id, eos_id=eos_id, n_look=n_look, shift=bool(shift), blend=bool(blend),
              score_all=bool(score_all))
    b = _backend.resolve("select_round", backend, args[3].device)
    if b == "torch":
        return ref.select_round(*args, **kw)
    if b == "cpp":  # eagerly the kernel itself (the custom op's dispatch costs more than the kernel on tiny rounds)
        if torch.compiler.is_compiling():
            return SelectRound(*torch.ops.lopa_fast.cpp_select_round(list(args), **kw))
        return SelectRound(*_run_cpp(list(args), **kw, out=out))
    if b == "triton":  # one launch into fresh outputs (shapes fixed by the bucket: capturable)
        return SelectRound(*_backend.kernel("select_round", "triton")(list(args), _outputs(args, split=False), **kw))
    if b == "cuda":
        return SelectRound(*_backend.cuda_module().select_round(*args, **kw))
    raise ValueError(f"select_round: backend {b!r} has no kernel yet")


# ------------------------------------------------------------------------------ the C++ kernel as a torch custom op
def _run_cpp(args: list[torch.Tensor], bs: int, mask_id: int, eos_id: int, n_look: int, shift: bool, blend: bool,
             score_all: bool, split: bool = True, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The C++ kernel on fresh outputs, or on `out` (lopa_fast._C.select_round_cpu takes the data pointers)."""
    if out is None:
        out = _outputs(args, split)
    x = args[3]
    dims = [x.shape[0], x.shape[1], args[5].shape[0], args[21].shape[0], bs, mask_id, eos_id, n_look, int(shift),
            int(blend), int(score_all)]
    return _backend.run_cpp("select_round_cpu", args, out, dims)


@torch.library.custom_op("lopa_fast::cpp_select_round", mutates_args=())
def _cpp_op(args: list[torch.Tensor], bs: int, mask_id: int, eos_id: int, n_look: int, shift: bool, blend: bool,
            score_all: bool) -> list[torch.Tensor]:
    return _run_cpp(args, bs, mask_id, eos_id, n_look, shift, blend, score_all, split=False)


@_cpp_op.register_fake
def _(args, bs, mask_id, eos_id, n_look, shift, blend, score_all):
    return _outputs(args, split=False)


# ------------------------------------------------------------------------------ plan_round (round 1's plan)
_PLAN_NAMES = ("x", "n_blocks", "block_state", "complete", "eos", "alive", "prompt_len", "gen_pos", "block_start",
               "block_end", "grow_table", "activate_table")


def plan_round(*args: torch.Tensor, bs: int, mask_id: int, shift: bool, check: bool = True,
               backend: str | None = None) -> RoundPlan:
    """Round 1's plan (reference.ops.plan_round's 12 positional tensors and keywords): `cpp` on CPU tensors when
    lopa_fast._C is built (csrc/select_round_cpu.cpp's plan_round_cpu, the code select_round's C++ kernel plans
    with), else the torch reference (CUDA tensors too: it runs once per request, eagerly)."""
    if check:
        if len(args) != len(_PLAN_NAMES) or not all(isinstance(t, torch.Tensor) for t in args):
            raise ValueError(f"plan_round: expected {len(_PLAN_NAMES)} tensors: {', '.join(_PLAN_NAMES)}")
        x = args[0]
        if x.dim() != 2:
            raise ValueError(f"plan_round: x must be [NB, Lb + 1], got {tuple(x.shape)}")
        want = _expected(x.shape[0], x.shape[1], args[2].numel(), 1, bs, 1)
        for name, t in zip(_PLAN_NAMES, args):
            shape, dtype = want[name]
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != x.device:
                raise ValueError(f"plan_round: {name} is {t.dtype} {tuple(t.shape)} on {t.device}; expected {dtype} "
                                 f"{shape} on {x.device}")
    b = _backend.resolve("plan_round", backend, args[0].device)
    if b != "cpp" or torch.compiler.is_compiling():
        return ref.plan_round(*args, bs=bs, mask_id=mask_id, shift=shift)
    x = args[0]
    out = _plan_outputs(x.shape[0], x.shape[1], args[2].numel())
    dims = [x.shape[0], x.shape[1], args[2].numel(), bs, mask_id, int(bool(shift))]
    return RoundPlan(*_backend.run_cpp("plan_round_cpu", args, out, dims))
