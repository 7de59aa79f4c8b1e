"""Shared test helpers: tolerance table, the 2x error rule, NaN-poisoned allocations, the test device."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

# (atol, rtol) per dtype for elementwise comparisons (torch's defaults for fp32).
# Attention and reductions use the 2x rule instead (assert_2x_rule).
TOLERANCES = {
    torch.float32: (1e-5, 1.3e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 only on a GPU: the Triton interpreter's bf16 dot multiplies raw bit patterns (docs/toolchain.md section 3)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def max_err(a: torch.Tensor, b: torch.Tensor, rows=None) -> float:
    d = (a.double() - b.double()).abs()
    if rows is not None:
        d = d[rows]
    return d.max().item() if d.numel() else 0.0


def assert_2x_rule(name: str, out, ref_exact, out_torch, rows=None, slack: float = 1e-5):
    """flash-attention's rule: err(kernel, exact) <= 2 * err(torch in the same dtype, exact) + slack.
    Prints both errors so a failure explains itself."""
    e_k = max_err(out, ref_exact, rows)
    e_t = max_err(out_torch, ref_exact, rows)
    print(f"{name}: err(kernel)={e_k:.3e} err(torch)={e_t:.3e}")
    assert torch.isfinite(out.double() if rows is None else out.double()[rows]).all(), f"{name}: non-finite output"
    assert e_k <= 2 * e_t + slack, f"{name}: err(kernel)={e_k:.3e} > 2 * err(torch)={e_t:.3e} + {slack}"


_INT_SENTINEL = -123456789


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty / empty_like return NaN (floats) or a sentinel (ints, bools as 0x55 bytes), so an
    output element a kernel forgets to write cannot pass as a plausible value."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.view(torch.uint8).fill_(0x55)
        elif t.dtype in (torch.int8, torch.uint8):
            t.fill_(0x55)
        else:
            t.fill_(_INT_SENTINEL)
        return t

    def empty(*a, **k):
        return poison(real_empty(*a, **k))

    def empty_like(*a, **k):
        return poison(real_like(*a, **k))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def golden_models(data: dict, script: str) -> dict:
    """Rebuild the tiny models a golden file was made with (tests/golden/*.json "models"); FAIL (not
    skip: the golden tests must not go quiet) when lopa_fast.testing.random_model no longer reproduces their
    weights (then rerun `script`)."""
    from lopa_fast.testing import model_from_spec, weights_fingerprint

    out = {}
    for name, spec in data["models"].items():
        m = model_from_spec(spec["hf"], spec["random"])
        if weights_fingerprint(m) != spec["fingerprint"]:
            pytest.fail(f"lopa_fast.testing.random_model now builds different weights for {name}; regenerate "
                        f"the goldens with {script}", pytrace=False)
        out[name] = m
    return out


def attention_in_dtype(q, kc, vc, L, kw, vw, win_lens, block_ids, mode, softmax_fp32: bool = False):
    """A plain PyTorch branch attention in the input dtype: the 2x rule's yardstick (softmax in the input
    dtype, or in fp32 and cast back with softmax_fp32=True, as a kernel that keeps fp32 statistics does)."""
    from lopa_fast.reference import attention_modes

    B, n, Hq, D = q.shape
    G = Hq // kw.shape[2]
    rep = lambda t: t.repeat_interleave(G, dim=-2)  # noqa: E731 - [.., Hkv, D] -> [.., Hq, D]
    k = torch.cat([rep(kc[:L]).unsqueeze(0).expand(B, -1, -1, -1), rep(kw)], dim=1)  # [B, L+n, Hq, D]
    v = torch.cat([rep(vc[:L]).unsqueeze(0).expand(B, -1, -1, -1), rep(vw)], dim=1)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * (1.0 / math.sqrt(D))
    vis = attention_modes.window_key_mask(n, win_lens, block_ids, mode, B, q.device)
    vis = torch.cat([torch.ones(B, n, L, dtype=torch.bool, device=q.device), vis], dim=-1)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype) if softmax_fp32 else torch.softmax(s, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", p, v)


# ------------------------------------------------------------------------------ op inputs and yardsticks
def make_attention_inputs(shape, dtype, seed=0, device=DEVICE, extra_rows=3, len_step=4):
    """(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids) for shape (B, n, Hq, Hkv, D, L):
    `extra_rows` cache rows past cache_len (must be ignored), ragged win_lens n - len_step * b (the first branch
    full), sorted block ids in [0, 3)."""
    B, n, Hq, Hkv, D, L = shape
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    q, kc, vc = r(B, n, Hq, D), r(L + extra_rows, Hkv, D), r(L + extra_rows, Hkv, D)
    kw, vw = r(B, n, Hkv, D), r(B, n, Hkv, D)
    win_lens = torch.tensor([max(1, n - len_step * b) for b in range(B)], device=device)
    block_ids = torch.sort(torch.randint(0, 3, (B, n), generator=g), dim=1).values.to(device)
    return q, kc, vc, L, kw, vw, win_lens, block_ids


# ------------------------------------------------------------ CUDA emulation (backends)
@pytest.fixture(scope="module")
def cuda_emu():
    """The CUDA kernels' exact source run on CPU (lopa_fast.ops.cuda.emulation); skips without g++ >= 12."""
    from lopa_fast.ops.cuda import emulation

    if emulation.host_compiler() is None:
        pytest.skip("no host C++ compiler for the CUDA emulation")
    try:
        return emulation.emulator()
    except RuntimeError as e:  # e.g. a g++ older than 12 (no <barrier>)
        pytest.skip(f"host emulation does not build here: {e}")


@pytest.fixture
def cuda_kernels():
    """lopa_fast.ops.cuda on a GPU machine (`gpu` tests): fails, not skips, when a GPU is present but the
    CUDA kernels cannot load."""
    from lopa_fast.ops import cuda

    if not cuda.available():
        pytest.fail(f"a GPU is present but the CUDA kernels are unavailable: {cuda.why_unavailable()}")
    return cuda


def step_models() -> dict:
    """The tiny Dream / LLaDA models of the vanilla / threshold step tests (eager and compiled): with and without
    a zeroed mask-token row."""
    from lopa_fast.testing import random_model, tiny_hf_config

    return {
        "dream": random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6),
        "dream_mask": random_model(tiny_hf_config("dream", vocab_size=128, num_kv_heads=4), seed=1, sharpen=4,
                                   zero_mask_row=False),
        "llada": random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=6),
        "llada_mask": random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=4, sharpen=3,
                                   zero_mask_row=False),
    }


def apd_models() -> dict:
    """The APD tests' drafters (d64, d66: seeded tiny Dream models) and verifiers (q64, q64b: tiny Qwen2) of
    tests/golden/apd_upstream.json, with the head rows the golden zeroes (tests/test_fast_apd.py PAIRS)."""
    import json
    import os

    from lopa_fast.testing import model_from_spec

    data = json.load(open(os.path.join(os.path.dirname(__file__), "golden", "apd_upstream.json")))["models"]
    out = {}
    for name, spec in data.items():
        m = model_from_spec(spec["hf"], spec["random"])
        if spec["zero_head_rows_from"] is not None:
            with torch.no_grad():
                m.head_weight()[spec["zero_head_rows_from"] :] = 0
        out[name] = m
    return out


def markdown_row(text: str, first_cell: str) -> list[str]:
    """The stripped cells of the markdown-table row of `text` whose first cell is `first_cell` (tables are written by
    tabulate, so cells are padded to their column's width); StopIteration when there is none."""
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == first_cell:
                return cells
    raise StopIteration(f"no table row {first_cell!r}")


def emulated_capture(warmup, body):
    """CompiledRounds.capture's CUDA-graph contract emulated on the CPU: a real capture records kernels without
    running them (the workspace is untouched until a replay), so the outputs come from the warm-up on scratch copies,
    and a "replay" reruns the captured body on the workspace and rewrites those outputs."""
    _, info = warmup()
    outputs = {k: None if v is None else v.clone() for k, v in info.items()}  # None: D2F's score without a trace

    def replay():
        for k, v in body().items():
            if v is not None:
                outputs[k].copy_(v)

    return replay, outputs


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG file, from its IHDR chunk."""
    import struct
    from pathlib import Path

    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path}: not a PNG file")
    return struct.unpack(">II", head[16:24])


def run_step(parts, model, st: dict, T: dict, geo, kind: str, sizes: tuple):
    """One vanilla / threshold step alone: `parts(geo, kind, sizes)` (the strategy step module's) around its solo
    forward. Returns (state, {"logits": raw logits [R, V]}). A "dual" step's forward is `model.forward_dual` (its
    window's K/V written into the cache in place), every other kind's `model.forward_static`."""
    pre, post = parts(geo, kind, sizes)
    a, ctx = pre(st, T)
    if kind == "dual":
        return post(st, T, ctx, model.forward_dual([a])[0], None, None)
    out = model.forward_static(a["tokens"], a["start"], a["cache_k"], a["cache_v"], a["prefix_len"], a["win_lens"],
                               None, "full", a["rows"], attn_backend=geo.attn_backend)
    return post(st, T, ctx, *out)


def spec_of(cfg):
    """The registry's spec of a bound config's strategy: what the plan hands the one loop (lopa_fast.decode.batch
    imports no strategy; its Scheduler / run_solo / BatchEngine take the spec)."""
    from lopa_fast import strategies

    return strategies.get(cfg.strategy)


def run_ranks(target, arg_lists, join_timeout: float):
    """Start one spawned process per argument tuple (`target(*args)`: a rank), wait for all of them together at
    most `join_timeout` seconds, kill the ones still running and fail naming them (a hang). Returns the
    processes (their exit codes read by the caller)."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in arg_lists]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"ranks {hung} still running after {join_timeout} s (a hang)"
    return procs


def http_call(url, body=None, *, raw: bytes | None = None, headers=None, method=None, timeout: float = 60):
    """(status, parsed JSON or text) of one HTTP request to a test server (a JSON body, or raw bytes)."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def differing_fields(a, b) -> list[str]:
    """The fields of two NamedTuples of tensors (an op's outputs: SelectRound, SelectStep, WindowInputs, ...) that
    differ bitwise: dtype, shape or value (a float NaN equals NaN)."""
    bad = []
    for name, x, y in zip(type(a)._fields, a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            bad.append(f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif x.is_floating_point():
            if not torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0)):
                bad.append(name)
        elif not torch.equal(x, y):
            bad.append(name)
    return bad


def record_calls(op: str, run, keep=lambda calls: True, drop=("check", "backend", "out")) -> list[tuple[tuple, dict]]:
    """The calls `run()` makes to lopa_fast.ops.<op>, each (its tensor arguments cloned, its keywords but `drop`: the
    dispatch choices and a caller's output workspace), those `keep(calls so far)` admits; the op itself runs as
    usual. The benches and parity tests replay them."""
    from lopa_fast import ops

    calls, real = [], getattr(ops, op)

    def spy(*args, **kw):
        if keep(calls):
            calls.append((tuple(a.clone() for a in args), {k: v for k, v in kw.items() if k not in drop}))
        return real(*args, **kw)

    setattr(ops, op, spy)
    try:
        run()
    finally:
        setattr(ops, op, real)
    return calls
