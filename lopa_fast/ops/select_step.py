"""`select_step`: a threshold step's selection and bookkeeping after its token statistics, as one op.
See reference.ops.select_step (the oracle, and the `torch` backend) for every argument's shape and meaning.

Backends: `cpp` (csrc/select_step_cpu.cpp in the extension `lopa_fast._C`, built at install: the default on CPU
tensors when it is present), `triton` (kernels/triton/select_step.py: one launch instead of a captured step's ~30
selection nodes; the default on CUDA tensors) and `torch` (the reference's vectorised ops). No CUDA C++ kernel:
auto on CUDA takes Triton, else torch. Every backend returns the same bits.
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.reference.ops import STEP_RULES, SelectStep

_NAMES = ("x", "pos", "valid", "x0", "conf", "ent", "finite", "multi", "noop", "s", "knob")


def _check(args: tuple, rule: str, mask_id: int, B: int) -> None:
    named = _backend.named_tensors("select_step", _NAMES, args)
    if rule not in STEP_RULES:
        raise ValueError(f"select_step: rule={rule!r}; allowed: {', '.join(STEP_RULES)}")
    if not isinstance(mask_id, int) or mask_id < 0 or not isinstance(B, int) or B < 0:
        raise ValueError(f"select_step: mask_id={mask_id!r} and B={B!r} must be ints >= 0")
    x = named["x"]
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"select_step: x must be a non-empty [L], got {tuple(x.shape)}")
    n = named["pos"].numel()
    L, B_, F64 = torch.long, torch.bool, torch.float64
    want = dict(x=((x.numel(),), L), pos=((n,), L), valid=((n,), B_), x0=((n,), L), ent=((n,), F64),
                finite=((n,), B_), multi=((), L), noop=((), L), s=((), L), knob=((), F64))
    for name, (shape, dtype) in want.items():
        t = named[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"select_step: {name} is {t.dtype} {tuple(t.shape)}; expected {dtype} {shape}")
    conf = named["conf"]
    if tuple(conf.shape) != (n,) or conf.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"select_step: conf is {conf.dtype} {tuple(conf.shape)}; expected float32 or float64 ({n},)")
    for name, t in named.items():
        if t.device != x.device:
            raise ValueError(f"select_step: {name} is on {t.device}, x on {x.device}")


def select_step(*args: torch.Tensor, rule: str, mask_id: int, B: int, check: bool = True,
                backend: str | None = None) -> SelectStep:
    """The step's new canvas, counters and head (reference.ops.select_step's positional tensor arguments and
    keywords). backend: None (auto: `cpp` on CPU tensors when lopa_fast._C is built, triton on CUDA, else torch) |
    "cpp" | "triton" | "torch"."""
    if check:
        _check(args, rule, mask_id, B)
    b = _backend.resolve("select_step", backend, args[0].device)
    if b == "torch":
        return ref.select_step(*args, rule=rule, mask_id=mask_id, B=B)
    if b == "triton":  # one launch into fresh outputs (no value-dependent shape: capturable)
        outs = [torch.empty_like(args[0]), *(torch.empty_like(args[7]) for _ in range(3)),
                args[0].new_empty(4)]
        return SelectStep(*_backend.kernel("select_step", "triton")(list(args), outs, rule_index=STEP_RULES.index(
            rule), mask_id=mask_id, B=B))
    if torch.compiler.is_compiling():
        return SelectStep(*torch.ops.lopa_fast.cpp_select_step(list(args), rule, mask_id, B))
    return SelectStep(*_run_cpp(list(args), rule, mask_id, B))


def _run_cpp(args: list[torch.Tensor], rule: str, mask_id: int, B: int, split: bool = True) -> list[torch.Tensor]:
    """The C++ kernel on fresh outputs (lopa_fast._C.select_step_cpu takes the data pointers). split: the five
    outputs as views of one buffer (eager: one allocation, not five; a custom op's outputs may not alias)."""
    x = args[0]
    L = x.numel()
    if split:
        buf = torch.empty(L + 7, dtype=torch.long)
        out = [buf[:L], buf[L], buf[L + 1], buf[L + 2], buf[L + 3:]]
    else:
        out = [torch.empty(L, dtype=torch.long)] + [torch.empty((), dtype=torch.long) for _ in range(3)] + \
            [torch.empty(4, dtype=torch.long)]
    dims = [L, args[1].numel(), STEP_RULES.index(rule), mask_id, B, int(args[4].dtype == torch.float64)]
    return _backend.run_cpp("select_step_cpu", args, out, dims)


@torch.library.custom_op("lopa_fast::cpp_select_step", mutates_args=())
def _cpp_op(args: list[torch.Tensor], rule: str, mask_id: int, B: int) -> list[torch.Tensor]:
    return _run_cpp(args, rule, mask_id, B, split=False)


@_cpp_op.register_fake
def _(args, rule, mask_id, B):
    L = args[0].numel()
    return [args[0].new_empty(L), *(args[0].new_empty(()) for _ in range(3)), args[0].new_empty(4)]
