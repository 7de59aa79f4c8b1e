"""One decoding round's work, counted from a real run, and projected to one H200.

`count_rounds(model, run)` runs `run()` (a `lopa_fast.generate` call, or upstream's loop through
`Upstream.runner`) with two instruments on, and returns one record per round:

* a stage clock: wrappers around the functions each stage is made of set the current stage, and the wall time
  between two switches goes to the stage that was current. Stages (`STAGES`):
    embed      from the model call's entry to the first layer norm (embedding, RoPE tables, masks)
    attn_proj  pre-norm, q/k/v GEMM, RoPE, o-projection (per layer)
    attn_core  the attention contraction itself (`branch_attention_sdpa` / `ops.branch_attention`)
    mlp        pre-norm, gate/up GEMM, SwiGLU, down (per layer)
    lm_head    final norm, the LM-head row selection and GEMM
    stats      token statistics over the logits rows (softmax / confidence / top-1) and the non-finite guard
    select     everything else inside a round: plan, scores, winner, commit, fill, spawn (the bookkeeping)
    host       the driver between rounds: its host read, bucket choice, counters
  A layer's first norm starts `attn_proj`, its second `mlp`, the norm after the last layer `lm_head`, so the
  split needs no change to the model code.
* an op counter (`OpCounter`, a TorchDispatchMode) that adds every aten op to the current stage: FLOPs (torch's
  flop formulas, `torch.utils.flop_counter.flop_registry`, plus CPU SDPA), bytes read + written (input and output
  tensor bytes; gathers and in-place scatters count the rows they touch, not the whole table), launches (ops that
  are not views or host reads: the eager kernel-launch proxy), host syncs (`_local_scalar_dense` = item / bool /
  int, `nonzero`, `masked_select`, `unique`, and `Tensor.tolist` / `numpy`), the transient memory peak (bytes
  allocated since the round began and still alive) and, per op, its H200 roofline time.

`project(...)` turns the counts of a reduced-depth run (its layers) into the real depth's round on one H200.
Stdlib + torch only: tests/test_roundcount.py checks it at tiny shapes; bench/bench_real_shapes.py runs it at
real widths.
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

STAGES = ("embed", "attn_proj", "attn_core", "mlp", "lm_head", "stats", "select", "host")
LAYER_STAGES = ("attn_proj", "attn_core", "mlp")  # per layer: scaled by real depth / measured depth
MODEL_STAGES = ("embed", "attn_proj", "attn_core", "mlp", "lm_head")
FIELDS = ("t", "ovh", "flops", "bytes_f32", "bytes_other", "launches", "syncs", "peak", "roof_meas", "roof_sheet",
          "ops", "eager")  # t: stage wall time; ovh: the counter's own time inside it (t - ovh: the uninstrumented
# estimate); eager: the launches among `launches` that run outside a captured graph (`captured_sequence`: a
# request's move into its lane, once, before its first replay: 7 multi-tensor copies), priced as eager launches by
# `project`

# ---- H200 constants (each with its source) ------------------------------------------------------------------------
# datasheet: NVIDIA H200 product brief: HBM3e 4.8 TB/s, dense BF16 tensor core 989 TFLOP/s (1,979 with sparsity)
H200_SHEET_BW = 4.8e12
H200_SHEET_FLOPS = 989e12
# measured on an H200 (docs/toolchain.md section 7; bench/results/projection.md "Constants of the projection"):
# ~4.3 TB/s device-to-device copy, ~790 TFLOP/s bf16 GEMM
H200_MEAS_BW = 4.3e12
H200_MEAS_FLOPS = 790e12
# launch costs (planning constants of issue 33, to be replaced by bench/gpu_check.sh's measured-vs-projected stage):
# eager: Python dispatch + cudaLaunchKernel, 5-10 us per op; captured: 1-2 us per CUDA-graph node, one graph launch
EAGER_US = (5.0, 10.0)
GRAPH_NODE_US = (1.0, 2.0)
GRAPH_LAUNCH_US = 10.0
HOST_READ_US = 15.0  # one small device-to-host copy + the stream sync it implies (planning constant)
GEMM_EFFICIENCY = 0.8  # "GEMMs with M = 32-160 usually reach 70-85% of HBM roofline" (bench/results/projection.md)

# Dream-7B weight-streaming floor (bench/bench_round_gpu.py): bytes streamed per forward, KV bytes per token
DREAM7B_STREAMED = 14.14e9
DREAM7B_KV_PER_TOKEN = 28 * 2 * 4 * 128 * 2

aten = torch.ops.aten
_SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim,
             aten.unique_consecutive}
# (_unsafe_view: matmul's reshape of a 3-d input's mm result back to 3-d; no view in its schema, but no kernel and
# no bytes either: counted as a launch it added 3 phantom graph nodes a layer, 84 at Dream-7B's 28 layers, and
# twice each GEMM output's bytes)
_NO_LAUNCH = {aten._local_scalar_dense, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset,
              aten._unsafe_view}
# ops that read only the rows their index names (bytes: the output twice + the index), not the whole table
_GATHERS = {aten.embedding, aten.index_select, aten.gather, aten.index, aten.take}
# custom ops that are several GPU kernels (launches per call; see also _CUSTOM_COST)
_MULTI_LAUNCH: dict[str, int] = {}


def _head_confidence_cost(args, out) -> tuple[int, int, int]:
    """`lopa_fast::triton_head_confidence(hidden [R, H], weight [V, H], suppress, eps, entropy, keep_logits)` as
    kernels/triton/head_confidence.py launches it: (launches, FLOPs, bytes beyond its inputs and outputs). Kernels:
    stats + merge, and with the entropy its pass + the partials' sum; FLOPs: the head GEMM; extra bytes: the [R, V]
    logits buffer in hidden.dtype, written by the stats pass (counted as an output when kept) and read back by the
    entropy pass."""
    hidden, weight, entropy, keep = args[0], args[1], args[4], args[5]
    R, H = hidden.shape
    V = weight.shape[0]
    buf = R * V * hidden.element_size()
    extra = (buf if entropy and not keep else 0) + (buf if entropy else 0)
    return 2 + (2 if entropy else 0), 2 * R * V * H, extra


def _confidence_cost(args, out) -> tuple[int, int, int]:
    """`lopa_fast::triton_confidence(logits [N, V], ...)` as kernels/triton/confidence.py launches it on a GPU: one
    program per row (1 launch) or the split path (partials, entropy, finalize: 3); each reads the row twice (the
    entropy needs the final lse): one read beyond the input's bytes."""
    from lopa_fast.kernels.triton import _vocab_stats as vs
    from lopa_fast.kernels.triton import confidence as conf

    logits = args[0]
    N, V = logits.shape
    bv = conf.block_v_for(V)
    S = vs.split_layout(V, bv, conf.num_splits_for(N, V, bv))[0]
    return (1 if S == 1 else 3), 0, N * V * logits.element_size()


def _branch_attention_cost(args, out) -> tuple[int, int, int]:
    """`lopa_fast::triton_branch_attention(q, k_cache, v_cache, cache_len_t, cache_len, k_win, v_win, ...,
    cache_index)` as kernels/triton/branch_attention.py plans it for a bf16 GPU (`launch_plan` at the GPU's tiles,
    whatever dtype the count runs in): the window kernel alone when the prefix fits one split, else the prefix kernel
    too. FLOPs and bytes: its inputs and outputs (the split partials' traffic is not counted)."""
    from lopa_fast.kernels.triton import branch_attention as ba

    q, k_cache, cache_len_t, cache_len, k_win = args[0], args[1], args[3], args[4], args[5]
    cache_index = args[12] if len(args) > 12 else None  # (a trailing default may be left off)
    B, n, Hq, _ = q.shape
    Hkv = k_win.shape[2]
    bm, bn, _ = ba.block_sizes(torch.bfloat16, gpu=True)
    pooled = cache_index is not None
    lk = k_cache.shape[-3] if pooled or cache_len_t is not None else int(cache_len)
    tiles = -(-(n * Hq // Hkv) // bm) if pooled else -(-(B * n * Hq // Hkv) // bm)
    splits, _ = ba.launch_plan(tiles * Hkv, lk, bn)
    return (0 if q.numel() == 0 else 1 if splits <= 1 else 2), 0, 0


def _norm_linear_cost(args, out) -> tuple[int, int, int]:
    """`lopa_fast::triton_norm_linear(x [..., K], weight [N, K], ...)`: one kernel, the GEMM's FLOPs; its bytes are
    its inputs and outputs (the normed rows and the [.., N] projection stay on chip; the prologue's second read of
    the rows comes from L2)."""
    x, weight = args[0], args[1]
    return 1, 2 * (x.numel() // x.shape[-1]) * weight.shape[0] * weight.shape[1], 0


# custom ops whose kernels, FLOPs or traffic their signature does not show: name -> (args, out) -> (launches, FLOPs,
# extra bytes, classed by the first argument's dtype)
_CUSTOM_COST = {"triton_head_confidence": _head_confidence_cost, "triton_confidence": _confidence_cost,
                "triton_norm_linear": _norm_linear_cost, "triton_branch_attention": _branch_attention_cost}
# allocations: memory (the transient peak counts them), no kernel and no bytes (a CUDA graph has no node for them)
_ALLOC_ONLY = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
# in-place scatters into a big buffer (bytes: the source twice + the index)
_SCATTERS_INPLACE = {aten.index_copy_, aten.index_put_, aten.scatter_, aten.scatter_add_, aten.masked_scatter_}


def _sdpa_cpu_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    """CPU SDPA (`_scaled_dot_product_flash_attention_for_cpu`), missing from torch's registry: QK^T and PV."""
    B, H, Lq, D = q.shape
    return 4 * B * H * Lq * k.shape[-2] * D


_EXTRA_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops}


def _tensors(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _nbytes(ts) -> tuple[int, int]:
    f32 = other = 0
    for t in ts:
        n = t.numel() * t.element_size()
        if t.dtype == torch.float32:
            f32 += n
        else:
            other += n
    return f32, other


def op_bytes(func, args, kwargs, out) -> tuple[int, int]:
    """(fp32 bytes, other bytes) an op reads and writes."""
    packet = func._overloadpacket
    if packet in _GATHERS:
        outs = _tensors(out)
        idx = [t for t in _tensors((args, kwargs)) if not t.is_floating_point()]
        f, o = _nbytes(outs)
        fi, oi = _nbytes(idx)
        return 2 * f + fi, 2 * o + oi
    if packet in _SCATTERS_INPLACE:
        srcs = _tensors((args[1:], kwargs))
        f, o = _nbytes(srcs)
        return 2 * f, 2 * o
    if getattr(packet, "__name__", "") == "triton_commit_round":  # in place: the span's rows, not the caches
        k_win, last = args[3], args[7]
        L, NB, Nb, H, D = k_win.shape
        n = 2 * 2 * L * Nb * H * D * k_win.element_size() + (2 * last.numel() * last.element_size() if last is not None
                                                              else 0)  # (u <= Nb rows of K and V, read + written)
        return (n, 0) if k_win.dtype == torch.float32 else (0, n)
    fi, oi = _nbytes(_tensors((args, kwargs)))
    fo, oo = _nbytes(_tensors(out))
    return fi + fo, oi + oo


def op_flops(func, args, kwargs, out) -> int:
    f = flop_registry.get(func._overloadpacket) or _EXTRA_FLOPS.get(func._overloadpacket)
    return int(f(*args, **kwargs, out_val=out)) if f is not None else 0


def roofline_s(flops: float, bytes_f32: float, bytes_other: float, bw: float, peak: float) -> float:
    """An op's time on the H200 in bf16: fp32 bytes halve (bf16 weights and activations), other bytes stay."""
    return max((bytes_f32 / 2 + bytes_other) / bw, flops / peak)


class Rounds:
    """The stage clock and the per-round records (round 0: everything before the first round marker)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.records: list[dict] = [self._record()]
        self.cur = "host"
        self.stack: list[str] = []
        self.t0 = time.perf_counter()
        self.norms = None  # layer norms seen in the current model call (None: outside a model call)
        self.live = 0  # bytes allocated under the counter and still alive
        self.base = 0  # live at the round's start
        self.in_wrapper = False
        self.cap = None  # upstream's loop: stop after this many rounds (RoundCap)

    @staticmethod
    def _record() -> dict:
        rec = {s: dict.fromkeys(FIELDS, 0) for s in STAGES}
        rec["meta"] = {"calls": 0, "tail": False}  # model calls in the round; tail: after the round cap
        return rec

    @property
    def rec(self) -> dict:
        return self.records[-1]

    def switch(self, name: str) -> None:
        now = time.perf_counter()
        self.rec[self.cur]["t"] += now - self.t0
        self.t0 = now
        self.cur = name

    def push(self, name: str) -> None:
        self.stack.append(self.cur)
        self.switch(name)

    def pop(self) -> None:
        self.switch(self.stack.pop())

    def new_round(self, tail: bool = False) -> None:
        self.switch(self.cur)
        self.records.append(self._record())
        self.rec["meta"]["tail"] = tail
        self.base = self.live

    def close(self) -> None:
        self.switch(self.cur)

    # ---- model-call wrappers
    def model_enter(self) -> None:
        self.rec["meta"]["calls"] += 1
        self.push("embed")
        self.norms = 0

    def model_exit(self) -> None:
        self.norms = None
        self.pop()

    def norm(self) -> None:
        if self.norms is None:
            return
        j = self.norms
        self.norms += 1
        if j < 2 * self.num_layers:
            self.switch("attn_proj" if j % 2 == 0 else "mlp")
        else:
            self.switch("lm_head")


class OpCounter(TorchDispatchMode):
    """Adds every aten op to the current stage of `rounds` (see the module docstring)."""

    def __init__(self, rounds: Rounds):
        super().__init__()
        self.r = rounds
        self.live_ptrs: dict[int, int] = {}

    def _free(self, ptr: int) -> None:
        n = self.live_ptrs.pop(ptr, 0)
        self.r.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # composite ops (linear, matmul, einsum, SDPA, item, ...) reach a mode undecomposed under inference_mode:
        # run their decomposition, so the counter sees the kernels they are made of (mm, bmm, ...)
        # (the mode is off inside its own handler: `with self` puts it back for the decomposition's ops)
        if func._overloadpacket not in flop_registry and func._overloadpacket not in _SYNC_OPS:
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        t_done = time.perf_counter()
        r = self.r
        st = r.rec[r.cur]
        st["ops"] += 1
        packet = func._overloadpacket
        if func in _SYNC_OPS or packet in _SYNC_OPS:
            st["syncs"] += 1
        if func.is_view or func in _NO_LAUNCH or packet in _NO_LAUNCH:
            st["ovh"] += time.perf_counter() - t_done
            return out
        name = getattr(packet, "__name__", "")
        b32, bo = op_bytes(func, args, kwargs, out)
        cost = _CUSTOM_COST.get(name)
        if packet in _ALLOC_ONLY:
            launches, f, b32, bo = 0, 0, 0, 0
        elif cost is not None:
            launches, f, extra = cost(args, out)
            if args[0].dtype == torch.float32:
                b32 += extra
            else:
                bo += extra
        else:
            launches, f = _MULTI_LAUNCH.get(name, 1), op_flops(func, args, kwargs, out)
        st["launches"] += launches
        if _GRAPH["capturing"] and not _GRAPH["inside"]:
            st["eager"] += launches
        st["flops"] += f
        st["bytes_f32"] += b32
        st["bytes_other"] += bo
        st["roof_meas"] += roofline_s(f, b32, bo, H200_MEAS_BW, H200_MEAS_FLOPS)
        st["roof_sheet"] += roofline_s(f, b32, bo, H200_SHEET_BW, H200_SHEET_FLOPS)
        for t in _tensors(out):  # transient memory: new storages only (views and in-place results share one)
            try:
                stor = t.untyped_storage()
            except Exception:  # noqa: BLE001  (tensors without storage)
                continue
            ptr = stor.data_ptr()
            if ptr and ptr not in self.live_ptrs:
                n = stor.nbytes()
                self.live_ptrs[ptr] = n
                r.live += n
                weakref.finalize(t, self._free, ptr)
        st["peak"] = max(st["peak"], r.live - r.base)
        st["ovh"] += time.perf_counter() - t_done
        return out


@contextlib.contextmanager
def _patched(obj, name, wrapper_factory):
    orig = getattr(obj, name)
    setattr(obj, name, wrapper_factory(orig))
    try:
        yield orig
    finally:
        setattr(obj, name, orig)


def _stage_wrapper(rounds: Rounds, stage: str):
    def factory(fn):
        def wrapped(*a, **k):
            if rounds.in_wrapper:  # nested in another instrumented call: attribute to the outer one
                return fn(*a, **k)
            rounds.push(stage)
            rounds.in_wrapper = True
            try:
                return fn(*a, **k)
            finally:
                rounds.in_wrapper = False
                rounds.pop()

        return wrapped

    return factory


def _model_wrapper(rounds: Rounds):
    def factory(fn):
        def wrapped(*a, **k):
            if rounds.norms is not None:  # inside a model call already (forward_requests of one request is its
                return fn(*a, **k)  # forward_static): one model call, counted once
            rounds.model_enter()
            try:
                return fn(*a, **k)
            finally:
                rounds.model_exit()

        return wrapped

    return factory


def _norm_wrapper(rounds: Rounds):
    def factory(fn):
        def wrapped(*a, **k):
            if not rounds.in_wrapper:
                rounds.norm()
            return fn(*a, **k)

        return wrapped

    return factory


class RoundCap(Exception):
    """Raised by a round marker once `Rounds.cap` rounds have run (stops upstream's loop, which has no cap)."""


def _round_marker(rounds: Rounds, stage: str = "select"):
    def factory(fn):
        def wrapped(*a, **k):
            if rounds.cap is not None and len(rounds.records) - 1 >= rounds.cap:
                raise RoundCap
            rounds.new_round()
            rounds.switch(stage)
            return fn(*a, **k)

        return wrapped

    return factory


@contextlib.contextmanager
def instrument(model, rounds: Rounds, upstream=None):
    """Install the stage wrappers for the fast path, the reference path and (upstream: an `Upstream`) upstream's
    loop; restore everything on exit."""
    import torch.nn.functional as F

    import lopa_fast.decode.batch as batch
    import lopa_fast.strategies.lopa.driver as driver
    import lopa_fast.strategies.lopa.round as rnd
    import lopa_fast.models.static_forward as sf
    import lopa_fast.models.transformer as tr
    import lopa_fast.ops as ops
    import lopa_fast.strategies.lopa.reference_d2f as rd2f
    import lopa_fast.strategies.lopa.reference_lopa as rlopa
    import lopa_fast.testing as testing

    @contextlib.contextmanager
    def fast_round_scope():
        rounds.new_round()
        rounds.switch("select")
        try:
            yield
        finally:
            rounds.switch("host")

    def read_head_factory(fn):
        def wrapped(self):
            rounds.push("host")
            try:
                return fn(self)
            finally:
                rounds.pop()

        return wrapped

    def tolist_factory(fn):
        def wrapped(self, *a, **k):
            rounds.rec[rounds.cur]["syncs"] += 1
            return fn(self, *a, **k)

        return wrapped

    with contextlib.ExitStack() as es:
        # model: entry / exit, norms, attention core
        for name in ("forward_static", "forward_window", "forward_requests"):  # the one loop: forward_requests
            setattr(model, name, _model_wrapper(rounds)(getattr(model, name)))
            es.callback(delattr, model, name)
        es.enter_context(_patched(testing, "sdpa_forward", _model_wrapper(rounds)))
        es.enter_context(_patched(tr, "rms_norm", _norm_wrapper(rounds)))
        es.enter_context(_patched(ops, "rms_norm", _norm_wrapper(rounds)))
        es.enter_context(_patched(ops, "add_rms_norm", _norm_wrapper(rounds)))  # the fused layer's residual norms
        es.enter_context(_patched(ops, "norm_linear", _norm_wrapper(rounds)))  # the Triton layer's norm-prologue GEMMs
        # the CPU forward's C++ norms: the layer loop's functions come from cpp_norms through the LayerOps memo,
        # emptied on entry and exit so that the loop takes the counted ones here and the plain ones after
        norm_factory = _norm_wrapper(rounds)
        es.enter_context(_patched(sf, "cpp_norms", lambda fn: lambda eps: tuple(norm_factory(f) for f in fn(eps))))
        sf._LAYER_OPS.clear()
        es.callback(sf._LAYER_OPS.clear)
        es.enter_context(_patched(sf, "branch_attention_sdpa", _stage_wrapper(rounds, "attn_core")))
        es.enter_context(_patched(ops, "branch_attention", _stage_wrapper(rounds, "attn_core")))
        es.enter_context(_patched(F, "scaled_dot_product_attention", _stage_wrapper(rounds, "attn_core")))
        # the fast round: statistics; the round scope and the head read
        es.enter_context(_patched(rnd, "token_stats", _stage_wrapper(rounds, "stats")))
        # the fused head (LOPA_FAST_FUSED_HEAD, a GPU's default at T = 0): the head GEMM with the statistics riding
        # in it, one op: lm_head
        es.enter_context(_patched(rnd, "fused_head_stats", _stage_wrapper(rounds, "lm_head")))
        es.enter_context(_patched(ops, "first_nonfinite", _stage_wrapper(rounds, "stats")))
        es.enter_context(_patched(driver, "round_scope", lambda fn: fast_round_scope))  # begin's plan + read
        es.enter_context(_patched(batch, "round_scope", lambda fn: fast_round_scope))  # the one loop's rounds
        es.enter_context(_patched(driver.FastDecoder, "_read_head", read_head_factory))
        # the reference: one marker per round, statistics
        es.enter_context(_patched(rlopa, "shared_prefix_end", _round_marker(rounds)))
        es.enter_context(_patched(rd2f, "update_activation", _round_marker(rounds)))  # once per D2F round
        for mod in (driver, rd2f, rlopa):  # the round cap: what follows is the request's tail, not a round
            es.enter_context(_patched(mod, "round_cap_hit", _tail_marker(rounds)))
        for mod in (rd2f, rlopa):
            es.enter_context(_patched(mod, "token_stats", _stage_wrapper(rounds, "stats")))
            es.enter_context(_patched(mod, "check_finite", _stage_wrapper(rounds, "stats")))
        if upstream is not None:
            up = upstream.mod
            rounds.cap = upstream.rounds
            if upstream.k > 1:  # LoPA: once per round; D2F's single-branch loop: its once-per-round state update
                es.enter_context(_patched(up, "find_shared_prefix_end", _round_marker(rounds)))
            else:
                es.enter_context(_patched(up.DreamLoRA, "_update_block_completion_states", _round_marker(rounds)))
            es.enter_context(_patched(up, "sample_tokens", _stage_wrapper(rounds, "stats")))
            es.enter_context(_patched(upstream.golden, "sdpa_forward", _model_wrapper(rounds)))
        # host reads that bypass the dispatcher
        es.enter_context(_patched(torch.Tensor, "tolist", tolist_factory))
        es.enter_context(_patched(torch.Tensor, "numpy", tolist_factory))
        yield


def _tail_marker(rounds: Rounds):
    def factory(fn):
        def wrapped(*a, **k):
            rounds.new_round(tail=True)
            rounds.switch("host")
            return fn(*a, **k)

        return wrapped

    return factory


def count_rounds(model, run, upstream=None) -> list[dict]:
    """Run `run()` instrumented (upstream: an `Upstream` when `run` is its loop); the per-round records (record 0:
    before the first round marker). Each stage's `ovh` is the counter's own measured Python time inside it."""
    rounds = Rounds(model.config.num_layers)
    with torch.inference_mode(), instrument(model, rounds, upstream), OpCounter(rounds):
        rounds.t0 = time.perf_counter()
        try:
            run()
        except RoundCap:
            pass
        rounds.close()
    return rounds.records


def steady(records: list[dict], skip: int = 1) -> list[dict]:
    """The steady-state rounds: records with a model call, not the tail, after the first `skip` (the prefill)."""
    return [r for r in records if r["meta"]["calls"] > 0 and not r["meta"]["tail"]][skip:]


def summarize(records: list[dict], skip: int = 1) -> dict:
    """Mean per round over the steady-state rounds (`steady`); peak: the largest."""
    rs = steady(records, skip)
    if not rs:
        raise ValueError(f"summarize: {len(records)} records, no steady-state round after skipping {skip}")
    out = {s: {} for s in STAGES}
    for s in STAGES:
        for f in FIELDS:
            vals = [r[s][f] for r in rs]
            out[s][f] = max(vals) if f == "peak" else sum(vals) / len(rs)
    out["rounds"] = len(rs)
    out["calls"] = sum(r["meta"]["calls"] for r in rs) / len(rs)
    return out


def totals(summary: dict, stages=STAGES) -> dict:
    return {f: sum(summary[s].get(f, 0) for s in stages) if f != "peak" else max(summary[s][f] for s in stages)
            for f in FIELDS}


def scale_depth(summary: dict, measured_layers: int, real_layers: int, deeper: dict | None = None) -> dict:
    """The per-round counts at the real depth: layer stages x real / measured; the rest once per round.
    deeper: the same round's summary at measured_layers + 1 (a two-point fit, exact): a layer stage's count is then
    its per-layer part (deeper - summary) x the real depth plus what it holds once per forward (the ops after the
    last layer's MLP until the final norm: the last residual add, the K/V stacking, the LM-head row selection,
    which the stage clock counts in `mlp`; scaled x depth they were ~4 x (depth - 1) phantom nodes)."""
    out = {}
    for s in STAGES:
        if deeper is None or s not in LAYER_STAGES:
            f = real_layers / measured_layers if s in LAYER_STAGES else 1.0
            out[s] = {k: (v * f if k != "peak" else v) for k, v in summary[s].items()}
            continue
        out[s] = {}
        for k, v in summary[s].items():
            per_layer = deeper[s][k] - v
            out[s][k] = v if k == "peak" else max(0.0, v + (real_layers - measured_layers) * per_layer)
    return out


def floor_ms(T: int, prefix: int, streamed: float = DREAM7B_STREAMED, kv_per_token: int = DREAM7B_KV_PER_TOKEN,
             flops_per_token: float | None = None) -> float:
    """The weight-streaming floor of one forward over T query tokens at `prefix` (measured H200 constants;
    bench/bench_round_gpu.py's formula): max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)."""
    fpt = streamed if flops_per_token is None else flops_per_token  # 2 FLOPs per bf16 weight (2 B): FLOPs = bytes
    t_mem = (streamed + (prefix + T) * kv_per_token) / H200_MEAS_BW
    t_comp = fpt * T / H200_MEAS_FLOPS
    return 1e3 * max(t_mem, t_comp)


def project(scaled: dict) -> dict:
    """Projected ms per round on one H200 from depth-scaled counts (bench/results/projection.md states the model):
    every op at its roofline (bf16 bytes / HBM bandwidth vs FLOPs / bf16 peak), plus launch costs:
      eager     = sum(roofline) + launches x 5-10 us + host reads x 15 us
      captured  = sum(roofline) + launches x 1-2 us (graph nodes; an upper bound, Inductor fuses element-wise ops)
                  + one graph launch + host reads x 15 us
    `*_real`: the roofline divided by 0.8 (GEMMs at 80% of the roofline)."""
    tot = totals(scaled)
    roof = tot["roof_meas"] * 1e3
    roof_sheet = tot["roof_sheet"] * 1e3
    n, syncs = tot["launches"], tot["syncs"]
    host = syncs * HOST_READ_US / 1e3
    p = dict(roofline_ms=roof, roofline_sheet_ms=roof_sheet, launches=n, syncs=syncs, flops=tot["flops"],
             bytes_bf16=tot["bytes_f32"] / 2 + tot["bytes_other"])
    p["eager_ms"] = tuple(roof + n * us / 1e3 + host for us in EAGER_US)
    eager = tot.get("eager", 0.0)  # (outside the graph: eager launches)
    p["eager_launches"] = eager
    p["captured_ms"] = tuple(roof + (n - eager) * us / 1e3 + eager * eu / 1e3 + GRAPH_LAUNCH_US / 1e3 + host
                             for us, eu in zip(GRAPH_NODE_US, EAGER_US))
    p["captured_real_ms"] = tuple(roof / GEMM_EFFICIENCY + (n - eager) * us / 1e3 + eager * eu / 1e3
                                  + GRAPH_LAUNCH_US / 1e3 + host for us, eu in zip(GRAPH_NODE_US, EAGER_US))
    p["stage_roof_ms"] = {s: scaled[s]["roof_meas"] * 1e3 for s in STAGES}
    return p


@contextlib.contextmanager
def kernel_bodies_in_torch():
    """The fast path's GPU kernel sequence with each Triton kernel's body computed by its torch reference: the
    Triton launchers (`lopa_fast.kernels.triton.{rms_norm, rope, silu_mul, norm_linear, branch_attention,
    head_confidence, confidence}`) are replaced by
    `lopa_fast.reference.ops`, so every kernel is still ONE custom op to the counter (`torch.ops.lopa_fast.triton_*`,
    its inputs and outputs as the kernel's) but runs at torch speed instead of the Triton interpreter's (minutes
    at real width); `ops.select_round` and `ops.window_inputs` run as their ONE custom ops
    (`lopa_fast::cpp_select_round`, `lopa_fast::cpp_window_inputs`). For counting only:
    use with LOPA_FAST_BACKEND=triton."""
    import importlib

    from lopa_fast.reference import ops as ref

    def attention(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens=None, block_ids=None, mode="full",
                  scale=None, return_lse=False, num_splits=None, *, cache_index=None):
        return ref.branch_attention(q, k_cache, v_cache, cache_len, k_win, v_win, win_lens, block_ids, mode, scale,
                                    return_lse, cache_index=cache_index)

    def head_confidence(hidden, weight, suppress_token=None, eps=1e-10, entropy=True, keep_logits=False):
        hc = ref.head_confidence(hidden, weight, suppress_token, eps, entropy, None, keep_logits)
        return hc if entropy else hc._replace(neg_entropy=torch.zeros_like(hc.lse))

    def confidence(logits, suppress_token=None, eps=1e-10, num_splits=None):
        return tuple(ref.confidence(logits, suppress_token, eps))

    swaps = {"rms_norm": {"rms_norm": ref.rms_norm, "add_rms_norm": ref.add_rms_norm},
             "rope": {"rope": ref.rope}, "silu_mul": {"silu_mul": ref.silu_mul},
             "branch_attention": {"branch_attention": attention},
             "head_confidence": {"head_confidence": head_confidence}, "confidence": {"confidence": confidence},
             "norm_linear": {"norm_linear": lambda *args, tiles=None: ref.norm_linear(*args)},
             "first_bad": {"first_bad": ref.first_bad}, "commit_round": {"commit_round": ref.commit_round}}
    import lopa_fast.ops as ops_pkg
    from lopa_fast.reference.ops import SelectRound, WindowInputs

    def select_round_one_op(orig):
        """The round's selection as the ONE kernel a GPU runs (the custom op, its body the C++ kernel here; the
        eager CPU path calls the kernel directly, which the counter would not see)."""
        def one(*args, check=True, backend=None, out=None, **kw):  # (out: the eager C++ workspace; a GPU has none)
            return SelectRound(*torch.ops.lopa_fast.cpp_select_round(list(args), **kw))
        return one

    def window_inputs_one_op(orig):
        """The round's forward inputs as the ONE kernel a GPU runs (the custom op, its body the C++ kernel)."""
        def one(*args, Nb, Rb, blocks, check=True, backend=None):
            return WindowInputs(*torch.ops.lopa_fast.cpp_window_inputs(list(args), Nb, Rb, bool(blocks)))
        return one

    with contextlib.ExitStack() as es:
        for mod_name, fns in swaps.items():
            mod = importlib.import_module(f"lopa_fast.kernels.triton.{mod_name}")
            for name, fn in fns.items():
                es.enter_context(_patched(mod, name, lambda orig, fn=fn: fn))
        es.enter_context(_patched(ops_pkg, "select_round", select_round_one_op))
        es.enter_context(_patched(ops_pkg, "window_inputs", window_inputs_one_op))
        # the numerics guard has no GPU kernel: a GPU round runs its torch ops (the C++ one would be invisible here)
        es.enter_context(_patched(ops_pkg, "first_nonfinite",
                                  lambda orig: lambda *a, backend=None, **kw: orig(*a, backend="torch", **kw)))
        yield


# what a GPU runs by default: the Triton kernels, and the fused LM head + statistics at T = 0 (LOPA_FAST_FUSED_HEAD's
# "auto" on CUDA)
GPU_ENV = {"LOPA_FAST_BACKEND": "triton", "LOPA_FAST_FUSED_HEAD": "1"}


@contextlib.contextmanager
def gpu_sequence():
    """The fast path's GPU kernel sequence on a CPU: GPU_ENV set and `kernel_bodies_in_torch` (bench_real_shapes'
    fastgpu path)."""
    from unittest import mock
    import os

    with mock.patch.dict(os.environ, GPU_ENV), kernel_bodies_in_torch():
        yield


@contextlib.contextmanager
def captured_sequence(model):
    """`gpu_sequence` with the round captured as a CUDA graph (compile=True on a GPU) emulated on the CPU: the capture
    runs the step's warm-up and body once; each replay reruns the body, so the counter sees exactly the kernels the
    graph holds (the round's state written back into the workspace included) plus what runs outside it between
    replays (loading a request into its lane and back). The emulation's own writes of the outputs (a real graph
    writes them in place) run with the counter off. bench_real_shapes' fastcap path."""
    from torch.utils._python_dispatch import _disable_current_modes

    from lopa_fast.decode.compiled import CompiledRounds

    def capture(warmup, body):
        _, info = warmup()
        outputs = {k: None if v is None else v.clone() for k, v in info.items()}

        def replay():
            _GRAPH["inside"] = True
            try:
                new = body()
            finally:
                _GRAPH["inside"] = False
            with _disable_current_modes():
                for k, v in new.items():
                    if v is not None:
                        outputs[k].copy_(v)

        return replay, outputs

    cr = CompiledRounds.for_model(model)
    old = cr.emulate_graphs
    cr.emulate_graphs = True
    _GRAPH["capturing"] = True
    try:
        with gpu_sequence(), _patched(CompiledRounds, "capture", lambda fn: staticmethod(capture)):
            yield
    finally:
        cr.emulate_graphs = old
        _GRAPH["capturing"] = False


_GRAPH = {"capturing": False, "inside": False}  # captured_sequence's state: launches outside a replay are eager


class Upstream:
    """Upstream's LoPA / D2F loop (LoPA `scale_dream_d2f.DreamLoRA._generate_enhanced_speculative` /
    `_generate_original_single_branch`, imported from a checkout by tests/golden/make_lopa_golden.import_upstream:
    nothing of it is copied here) on `model` for at most `rounds` rounds. Upstream decides everything; our network
    answers its model calls through make_lopa_golden.DenseAdapter (a plain SDPA forward with upstream's dense
    additive mask and full logits rows, the contract of its modified HF Dream model). The round cap is a round
    marker that raises (`RoundCap`): upstream's code is not changed."""

    def __init__(self, mod, golden, k: int, rounds: int):
        self.mod, self.golden, self.k, self.rounds = mod, golden, k, rounds

    def runner(self, model, prompt: list[int], knobs: dict):
        case = dict(knobs, prompt=list(prompt), branching_factor=self.k,
                    strategy="lopa" if self.k > 1 else "d2f")
        return lambda: self.golden.run_case(self.mod, model, case)
