"""Backend selection for the public ops: cuda | triton | cpp | torch.

`backend=None` (auto): on CUDA tensors the first available of AUTO_ORDER; on CPU tensors `cpp` for the ops the
extension lopa_fast._C carries (CPP_OPS; built at install from csrc/, absent without a compiler), else the
vectorised `torch` backend (what the CPU fast path runs). An explicit backend is honoured or refused with a ValueError:
`triton` also runs on CPU tensors when Triton's interpreter is on (TRITON_INTERPRET=1, the tests).

The CUDA hook: the package `lopa_fast.ops.cuda` exposing `available(op: str) -> bool`,
`unsupported(op, *args) -> str | None` (why its kernel cannot take these arguments: head dim, window length,
dtype) and one function per op with the public op's signature (no `backend`/`check` kwargs). If it cannot be
imported, `cuda` is simply unavailable. An explicit `backend="cuda"` runs the CUDA kernel or raises.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os

import torch

from lopa_fast.kernels.triton._common import is_interpreter as triton_interpreter  # noqa: F401 (re-exported)

BACKENDS = ("cuda", "triton", "cpp", "torch")
# the ops lopa_fast._C implements on CPU tensors (csrc/)
CPP_OPS = ("select_round", "select_step", "plan_round", "window_inputs", "rope", "rms_norm", "add_rms_norm",
           "first_nonfinite")
# an op whose Triton launcher lives in another op's module (kernels/triton/<module>.py)
TRITON_MODULE = {"add_rms_norm": "rms_norm"}
# Preference among kernel backends on a CUDA tensor; reorder once both are measured side by side.
AUTO_ORDER = ("triton", "cuda")

_triton_ok: bool | None = None


def triton_available() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            importlib.import_module("triton")
            _triton_ok = True
        except Exception:  # noqa: BLE001 - any import failure (missing driver libs, ...) means "no triton"
            _triton_ok = False
    return _triton_ok


def cuda_module():
    """lopa_fast.ops.cuda if present and importable, else None."""
    try:
        return importlib.import_module("lopa_fast.ops.cuda")
    except ModuleNotFoundError as e:
        if e.name != "lopa_fast.ops.cuda":
            raise
        return None


_cpp: object = None  # lopa_fast._C once imported; False when it is not built (said once, in the log)


def run_cpp(fn: str, ins: list, outs: list, dims: list) -> list:
    """Call the C++ op `fn` of lopa_fast._C on the data pointers of `ins` (made contiguous) then `outs` (fresh,
    contiguous), with its int `dims`; returns `outs` (filled)."""
    ins = [t if t.is_contiguous() else t.contiguous() for t in ins]
    getattr(cpp_module(), fn)([t.data_ptr() for t in ins] + [t.data_ptr() for t in outs], dims)
    return outs


def named_tensors(op: str, names: tuple, args: tuple) -> dict:
    """{name: tensor} of an op's tensor arguments: ValueError naming the expected list when the count differs,
    TypeError naming the argument that is not a tensor."""
    if len(args) != len(names):
        raise ValueError(f"{op}: {len(args)} tensor arguments; expected {len(names)}: {', '.join(names)}")
    for name, t in zip(names, args):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    return dict(zip(names, args))


def float32_cpp(op: str, b: str, asked, *tensors: torch.Tensor) -> str:
    """The backend to run for the float32-only, eager-only C++ layer kernels (rope, rms_norm / add_rms_norm,
    first_nonfinite), given `resolve`'s choice b for `asked`: auto moves a call being compiled (the kernels take raw
    pointers: not traceable) or other dtypes to "torch"; asked for by name, other dtypes are refused naming them."""
    if b != "cpp":
        return b
    auto = asked in (None, "auto")
    if auto and torch.compiler.is_compiling():
        return "torch"
    if any(t.dtype != torch.float32 for t in tensors):
        if not auto:
            dtypes = ", ".join(str(t.dtype) for t in tensors)
            raise TypeError(f"{op}: dtypes {dtypes} on backend='cpp'; allowed: float32")
        return "torch"
    return b


def cpp_module():
    """lopa_fast._C (the C++ CPU ops, built at install), or None when this install has none: logged once per
    process, naming why (setup.py printed the compiler's failure at install)."""
    global _cpp
    if _cpp is None:
        try:
            _cpp = importlib.import_module("lopa_fast._C")
        except ImportError as e:
            logging.getLogger("lopa_fast").info(
                "lopa_fast._C is not built (%s): the C++ CPU ops (%s) run on their torch backends (same results, "
                "slower); reinstall with a C++ compiler and pybind11 to build it", e, ", ".join(CPP_OPS))
            _cpp = False
    return _cpp or None


def _usable(op: str, backend: str, device: torch.device, args: tuple = ()) -> str | None:
    """None if `backend` can run `op` on `device` (with the public op's `args`, when given), else the reason."""
    if backend == "torch":
        return None
    if backend == "cpp":
        if op not in CPP_OPS:
            return f"lopa_fast._C has no C++ kernel for {op}"
        if device.type != "cpu":
            return f"tensors are on {device}"
        return None if cpp_module() is not None else "lopa_fast._C is not built"
    if backend == "triton":
        if not _has_family(op, "triton"):
            return f"no Triton kernel for {op}"
        if not triton_available():
            return "triton does not import"
        if device.type != "cuda" and not triton_interpreter():
            return f"tensors are on {device} and TRITON_INTERPRET is not set"
        return None
    mod = cuda_module()
    if mod is None or not mod.available(op):
        return f"no CUDA kernel for {op} is loaded"
    why = mod.unsupported(op, *args) if args else None
    if why is not None:
        return why
    if device.type != "cuda":
        return f"tensors are on {device}"
    return None


ENV = "LOPA_FAST_BACKEND"  # overrides an op's auto backend (tests, debugging): auto | cuda | triton | cpp | torch


def _has_family(op: str, backend: str) -> bool:
    """Whether `op` has a kernel of that family at all (the environment's backend applies to the ops that have
    one; e.g. LOPA_FAST_BACKEND=cpp moves select_round to C++ and leaves rms_norm on its auto choice)."""
    if backend == "cpp":
        return op in CPP_OPS
    if backend == "triton":
        return _triton_module_exists(TRITON_MODULE.get(op, op))
    return True


@functools.lru_cache(maxsize=None)
def _triton_module_exists(module: str) -> bool:
    return importlib.util.find_spec(f"lopa_fast.kernels.triton.{module}") is not None


def env_value(name: str) -> str | None:
    """os.environ.get(name) without its exception: for an unset name, os.environ.get raises and catches a KeyError
    inside (_Environ.__getitem__), measured at ~10 us of a tiny CPU round where a plain dict lookup is ~0.1 (an
    exception's cold path, between torch calls), and the ops read $LOPA_FAST_BACKEND ~5 times a round. CPython's
    os.environ keeps its entries in the dict `_data` (encoded keys and values), which its own get / set / del go
    through, so reading it sees every change (monkeypatch.setenv too); anything else is read with .get."""
    env = os.environ
    data = getattr(env, "_data", None)
    if data is None or not hasattr(env, "encodekey") or torch.compiler.is_compiling():  # (dynamo knows .get)
        return env.get(name)
    raw = data.get(env.encodekey(name))
    return None if raw is None else env.decodevalue(raw)


def env_backend() -> str:
    """The backend $LOPA_FAST_BACKEND asks for ("auto" when unset or empty); a ValueError naming the variable for
    any other value, so a typo in the environment is not read as an op's argument."""
    value = env_value(ENV) or "auto"
    if value != "auto" and value not in BACKENDS:
        raise ValueError(f"environment variable {ENV}={value!r}; allowed: auto, {', '.join(BACKENDS)} (or unset)")
    return value


def resolve(op: str, backend: str | None, device: torch.device, args: tuple = ()) -> str:
    """The backend to run `op` with for tensors on `device`; `args` (the public op's arguments) let a kernel
    backend refuse shapes it has no kernel for (auto then moves on; an explicit backend raises)."""
    if backend == "torch":  # always usable (the layer loop asks ~10 times a forward: no work for it)
        return backend
    asked = f"backend={backend!r}"  # who asked for it, named in the errors
    if backend is None or backend == "auto":
        backend = env_backend()
        if backend == "auto" or not _has_family(op, backend):
            if device.type == "cuda":
                for b in AUTO_ORDER:
                    if _usable(op, b, device, args) is None:
                        return b
            elif op in CPP_OPS and _usable(op, "cpp", device) is None:
                return "cpp"
            return "torch"
        asked = f"{ENV}={backend!r}"
    if backend not in BACKENDS:
        raise ValueError(f"{op}: {asked}; allowed: None/'auto', {BACKENDS}")
    why = _usable(op, backend, device, args)
    if why is not None:
        raise ValueError(f"{op}: {asked} is unavailable: {why}")
    return backend


def kernel(op: str, backend: str):
    """The launcher of `op` for a kernel backend ('triton' or 'cuda')."""
    if backend == "cuda":
        return getattr(cuda_module(), op)
    return getattr(importlib.import_module(f"lopa_fast.kernels.triton.{op}"), op)


def check_last_dim_contiguous(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} needs a contiguous last dim (stride 1), got strides {t.stride()}")


def check_vocab_args(op: str, what: str, V: int, suppress_token, eps) -> None:
    """The statistics ops' shared arguments (confidence, head_confidence): V >= 2 columns (`what`: the tensor that
    has them), suppress_token an int in [0, V) or None, eps a float >= 0."""
    if V < 2:
        raise ValueError(f"{op}: {what} has V={V}; the top-2 margin needs V >= 2")
    if suppress_token is not None:
        if isinstance(suppress_token, bool) or not isinstance(suppress_token, int):
            raise TypeError(f"{op}: suppress_token={suppress_token!r} must be an int or None")
        if not 0 <= suppress_token < V:
            raise ValueError(f"{op}: suppress_token={suppress_token} not in [0, V={V})")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0):
        raise ValueError(f"{op}: eps={eps!r} must be a float >= 0")


def check_tensors(op: str, ref_name: str, ref: torch.Tensor, specs) -> None:
    """Each (name, tensor | None, allowed dtypes) of `specs`: dtype in allowed and on `ref`'s device."""
    for name, t, allowed in specs:
        if t is None:
            continue
        if t.dtype not in allowed:
            raise TypeError(f"{op}: {name}.dtype={t.dtype}; allowed: {allowed}")
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device}, {ref_name} on {ref.device}")
