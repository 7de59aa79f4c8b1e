"""The one loop's cost for a solo compile=True request (issue 34): its rounds now run as the compiled batch step of
batch bucket 1, so its state (the KV cache included) is copied into its lane and back every round.

Parts:
  bytes   the lane copy at Dream-7B shape (bench/shapes.py REAL_SHAPES["dream7b"], bf16): the state of one d2f / lopa
          request (`FastDecoder.st`: mostly the prefix cache [layers, Lb + 1, Hkv, D] for K and V) copied in and
          out (each copy reads and writes it: 4x its bytes of memory traffic per round), as a fraction of the weight
          bytes one round streams (every projection and the LM head once). No torch compile, instant.
  time    per-round seconds of solo compile=True d2f and lopa k=2 on the embedded d2f-arith model (CPU, Inductor,
          after a warm-up request that compiles), and on the new code the part spent in the lane copies
          (compiled_batch._call minus its graph replay). Run it with the old code's tree first on PYTHONPATH to
          compare before / after in alternating processes (the command in bench/results/one_loop.md).
  eager   the same with compile=False (the solo eager round: now one `forward_requests` of one request).
  emulated  compile=True on the CUDA-graph path with the capture emulated on the CPU (the graph's body rerun
          eagerly, no Inductor): before, a solo request ran on its own workspace (no copy per round); now on its
          lane (copied in and out every round).

    python bench/bench_one_loop.py bytes
    PYTHONPATH=<tree> python bench/bench_one_loop.py time | eager | emulated
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def lane_bytes(P: int, new: int, k: int, shape: dict, elt: int = 2) -> int:
    """Bytes of one d2f / lopa request's round state (`round.init_state`) at `shape`: K and V caches
    [layers, Lb + 1, Hkv, D] (elt bytes), x [NB, Lb + 1] int64, last_logit [V] (elt), the small rest (< 1 KB)."""
    from lopa_fast.decode.shapes import quantized_length

    Lb = quantized_length(P + new)
    NB = k + 1 if k >= 2 else 1
    D = shape["hidden_size"] // shape["num_heads"]
    cache = 2 * shape["num_layers"] * (Lb + 1) * shape["num_kv_heads"] * D * elt
    return cache + NB * (Lb + 1) * 8 + shape["vocab_size"] * elt + 1024


def bytes_table() -> str:
    sys.path.insert(0, HERE)
    from shapes import REAL_SHAPES, streamed_params

    shape = REAL_SHAPES["dream7b"]
    weights = streamed_params(shape) * 2  # bf16
    rows = ["| prompt + new tokens | k | lane state (MB) | copy traffic per round (MB, in + out, read + write) | "
            "weight bytes per round (GB) | traffic / weights |", "|---|---|---|---|---|---|"]
    for P, new in ((256, 256), (512, 512), (1024, 1024), (2048, 2048)):
        for k in (1, 4):
            b = lane_bytes(P, new, k, shape)
            traffic = 4 * b
            rows.append(f"| {P} + {new} | {k} | {b / 1e6:.1f} | {traffic / 1e6:.0f} | {weights / 1e9:.2f} | "
                        f"{traffic / weights:.2%} |")
    return "\n".join(rows)


def time_rounds(reps: int = 5, compile: bool = True, emulated: bool = False) -> dict:
    import torch

    import lopa_fast

    torch.set_num_threads(1)
    if emulated:  # the CUDA-graph path on the CPU, the "graph" rerun eagerly (tests/utils.emulated_capture)
        sys.path.insert(0, os.path.dirname(HERE))
        from lopa_fast.decode.compiled import CompiledRounds
        from tests.utils import emulated_capture

        CompiledRounds.capture = staticmethod(emulated_capture)
    from lopa_fast.assets import model_dir

    model = lopa_fast.load_model(str(model_dir("d2f-arith")))
    if emulated:
        CompiledRounds.for_model(model).emulate_graphs = True
    prompt = torch.tensor([2] + [3 + i % 10 for i in range(23)])  # 24 ids of the arithmetic vocabulary
    copy = {"s": 0.0, "calls": 0}
    try:  # the new code: time the lane copies (the call minus its replay)
        from lopa_fast.decode import compiled_batch

        real_call = compiled_batch._call

        def timed_call(entry, steps):
            replay, spent = entry.replay, [0.0]

            def timed_replay():
                t = time.perf_counter()
                out = replay()
                spent[0] += time.perf_counter() - t
                return out

            entry.replay = timed_replay
            t0 = time.perf_counter()
            try:
                return real_call(entry, steps)
            finally:
                entry.replay = replay
                copy["s"] += time.perf_counter() - t0 - spent[0]
                copy["calls"] += 1

        compiled_batch._call = timed_call
    except ImportError:
        pass
    from lopa_fast.decode.compiled import CompiledRounds

    new_code = not hasattr(CompiledRounds, "step")  # the old solo entry point: gone with the one loop
    out = {"code": "one loop" if new_code else "before", "compile": compile, "emulated_capture": emulated,
           "torch": torch.__version__}
    for name, kw in (("d2f", dict(strategy="d2f")), ("lopa_k2", dict(strategy="lopa", branching_factor=2))):
        # eos_token_id 64: an id the model rarely emits, so a request runs its 6 blocks (rounds, not setup, dominate)
        kw = dict(kw, block_size=8, max_new_tokens=48, skip_threshold=0.9, compile=compile, eos_token_id=64)
        t = time.perf_counter()
        warm = lopa_fast.generate(model, prompt, backend="fast", **kw)
        compile_s = time.perf_counter() - t
        per_round, copy["s"], copy["calls"] = [], 0.0, 0
        for _ in range(reps):
            t = time.perf_counter()
            o = lopa_fast.generate(model, prompt, backend="fast", **kw)
            per_round.append((time.perf_counter() - t) / o.stats["forwards"])
            assert o.generated_ids == warm.generated_ids
        out[name] = dict(forwards=warm.stats["forwards"], first_request_s=round(compile_s, 1),
                         round_ms_median=round(1e3 * statistics.median(per_round), 3),
                         round_ms_all=[round(1e3 * x, 3) for x in per_round],
                         copy_ms_per_compiled_round=round(1e3 * copy["s"] / max(1, copy["calls"]), 4)
                         if copy["calls"] else None)
    return out


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "bytes"
    if what == "bytes":
        print(bytes_table())
    else:  # "time" (compile=True, Inductor), "eager" (compile=False), "emulated" (the CUDA-graph path emulated)
        print(json.dumps(time_rounds(reps=5 if what == "time" else 20, compile=what != "eager",
                                     emulated=what == "emulated")))
