"""`first_nonfinite`: the D2F / LoPA round's numerics guard, the first real logits row holding NaN / inf (at T > 0 also
a finite logit that dividing by T overflows). See reference.ops.first_nonfinite (the oracle, and the `torch` backend).

Backends: `cpp` (csrc/first_nonfinite_cpu.cpp in `lopa_fast._C`, float32 logits, eager: the default on CPU when built;
one read of the rows, no temporary) and `torch` (everywhere else: CUDA tensors, compiled graphs, other dtypes). Both
return the same value (an index or -1: exact).
"""
from __future__ import annotations

import torch

from lopa_fast.ops import _backend
from lopa_fast.reference import ops as ref
from lopa_fast.sampling import is_on


def first_nonfinite(logits: torch.Tensor, rows: torch.Tensor, n_real, none: int, temperature=0.0, *,
                    backend: str | None = None) -> torch.Tensor:
    """0-d long: rows[r] of the first of the n_real real rows r of logits [R, V] (last dim contiguous) holding NaN /
    inf (at temperature > 0, a float or a 0-d float64 knob: also overflowing when divided by it), else -1. rows [R]
    long: each row's flat window row (needed rows first, ascending); n_real: a host int or a 0-d long tensor (read
    by the kernel, no host read); none: a value above every flat row. No input check (the round's own tensors).
    backend: None (auto: `cpp` for float32 CPU logits when lopa_fast._C is built and not compiling, else torch) |
    "cpp" | "torch"."""
    b = _backend.float32_cpp("first_nonfinite", _backend.resolve("first_nonfinite", backend, logits.device), backend,
                             logits)
    if b != "cpp":
        return ref.first_nonfinite(logits, rows, n_real, none, temperature)
    if logits.dim() != 2 or logits.stride(-1) != 1 or rows.dtype != torch.long or not rows.is_contiguous():
        raise ValueError(f"first_nonfinite: logits {tuple(logits.shape)} (strides {logits.stride()}) must be [R, V] "
                         f"with a contiguous last dim, rows a contiguous long tensor (got {rows.dtype})")
    out = torch.empty((), dtype=torch.long)
    sampling = is_on(temperature)
    n_ptr = n_real.data_ptr() if torch.is_tensor(n_real) else 0
    t_ptr = temperature.data_ptr() if torch.is_tensor(temperature) else 0
    if t_ptr and temperature.dtype != torch.float64:
        raise TypeError(f"first_nonfinite: a temperature tensor must be the 0-d float64 knob, got {temperature.dtype}")
    if n_ptr and n_real.dtype != torch.long:
        raise TypeError(f"first_nonfinite: an n_real tensor must be 0-d long, got {n_real.dtype}")
    R, V = logits.shape
    _backend.cpp_module().first_nonfinite_cpu(
        [logits.data_ptr(), rows.data_ptr(), n_ptr, t_ptr, out.data_ptr()],
        [R, V, logits.stride(0), 0 if n_ptr else int(n_real), int(none), int(sampling)],
        0.0 if t_ptr or not sampling else float(temperature))
    return out
