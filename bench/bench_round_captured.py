"""Round latency (eager vs CUDA-graph-captured) and compile=True token parity, as one script for bench/gpu_check.sh.

Stages (each writes $OUT/<stage>.json and prints a short table):
* round: a random-weight Dream-7B-shaped bf16 model (28 layers, hidden 3584, 28/4 heads, head_dim 128, FFN 18944,
  vocab 152064; weights drawn directly on the GPU, bench_round_gpu.dream7b_random), LoPA at k = 1, 2, 4, 8,
  window 32, prefix 1024: ms per steady-state round of `generate(backend="fast")` eager and with
  compile=True (each bucket captured once as a CUDA graph by lopa_fast.decode.compiled.CompiledRounds, then
  replayed), as (t(1 + R rounds) - t(1 round)) / R after a warm-up run of the same length (captures every
  bucket first), beside the weight-streaming floor = bytes of weights / 4.8 TB/s.
* parity: `generate(backend="fast", compile=True)` vs `backend="reference"` on tiny random models: fp32 must be
  token-exact (reported as mismatching runs); bf16 reports the token agreement rate (the GPU confidence kernel
  is not bitwise).
* batch: batched generate (one forward per round for B requests, lopa_fast.decode.batch, eager) vs B sequential
  runs on the same Dream-7B-shaped model, D2F and LoPA k = 4, B = 1, 2, 4, 8, 16, prefix 1024, 4 rounds each (and
  vanilla, threshold and APD, whose verifier is a Qwen2.5-0.5B-shaped random model, at B = 1 and 16):
  request-rounds per second (the issue-15 GPU entry); the tokens of both paths are compared. On the GPU the batch
  also runs with its attention per request (B launches per layer instead of the pooled one: `per-req` column,
  tokens compared too), which measures what the KV pool's single pooled attention call buys (on the CPU both paths
  are per request: --dry-run only runs the code).

--dry-run: tiny shapes on the CPU (compile=True then means torch.compile; one k only) to catch errors without
a GPU. Usage: python bench/bench_round_captured.py --stage round|parity|batch|all [--dry-run] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lopa_fast` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopa_fast  # noqa: E402
from lopa_fast.testing import random_model, tiny_hf_config  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
WINDOW, PREFIX, KS = 32, 1024, (1, 2, 4, 8)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _gen(model, prompt, n_rounds, k, window, compile_):
    kw = dict(branching_factor=k, block_size=window, max_new_tokens=4 * window, block_add_threshold=1.0,
              skip_threshold=0.9, sampling_strategy="neg_entropy")  # windows stay one block per branch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return lopa_fast.generate(model, prompt, "lopa", "fast", max_rounds=n_rounds, compile=compile_, **kw)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def round_ms(model, prompt, k, window, compile_, rounds):
    """(ms per steady-state round, host reads per round, stats of the long run)."""
    dev = prompt.device
    t_warm = time.perf_counter()
    _gen(model, prompt, 1 + rounds, k, window, compile_)  # warm-up: allocations, kernel compiles, captures
    _sync(dev)
    t_warm = time.perf_counter() - t_warm
    ts, out = {}, None
    for n in (1, 1 + rounds):
        _sync(dev)
        t0 = time.perf_counter()
        out = _gen(model, prompt, n, k, window, compile_)
        _sync(dev)
        ts[n] = time.perf_counter() - t0
    done = max(1, out.stats["forwards"] - 1)
    return 1e3 * (ts[1 + rounds] - ts[1]) / done, out.stats.get("host_reads_per_round", float("nan")), t_warm, out


def stage_round(dry: bool) -> dict:
    if dry:
        dev = torch.device("cpu")
        model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
        window, prefix, ks, rounds, compile_ks = 8, 16, (1, 2), 2, (1,)
    else:
        from bench.bench_round_gpu import dream7b_random

        dev = torch.device("cuda")
        model = dream7b_random()
        window, prefix, ks, rounds, compile_ks = WINDOW, PREFIX, KS, 8, KS
    V = model.config.vocab_size
    g = torch.Generator(device=dev).manual_seed(1)
    prompt = torch.randint(0, V - 200 if V > 400 else V - 4, (prefix,), device=dev, generator=g)
    floor = 1e3 * weight_bytes(model) / HBM_BYTES_PER_S
    rows = []
    for k in ks:
        row = dict(k=k, seqs=k + 1 if k >= 2 else 1, window=window, prefix=prefix, floor_ms=floor)
        row["eager_ms"], row["eager_reads"], _, _ = round_ms(model, prompt, k, window, False, rounds)
        if k in compile_ks:
            ms, reads, warm, out = round_ms(model, prompt, k, window, True, rounds)
            row.update(captured_ms=ms, captured_reads=reads, capture_warmup_s=warm,
                       compile_seconds=out.stats.get("compile_seconds"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    by = {r["k"]: r for r in rows}
    summary = {}
    if 4 in by and "captured_ms" in by[4]:
        summary = dict(captured_k4_over_floor=by[4]["captured_ms"] / floor,
                       captured_k4_over_k1=by[4]["captured_ms"] / by[1]["captured_ms"])
    return dict(device=str(dev), gpu=torch.cuda.get_device_name() if dev.type == "cuda" else None,
                torch=torch.__version__, weight_bytes=weight_bytes(model), rows=rows, summary=summary)


PARITY_COMMON = dict(block_size=8, max_new_tokens=16, skip_threshold=0.8, block_add_threshold=0.1,
                     decoded_token_threshold=0.9)  # the D2F / LoPA rounds' knobs
VERIFIER = "verifier"  # a config's verifier=VERIFIER: the stage's tiny causal qwen2 model of the run's dtype
PARITY_CONFIGS = {
    "lopa_k2_full": dict(PARITY_COMMON, strategy="lopa", branching_factor=2, use_full_attention=True,
                         sampling_strategy="neg_entropy"),
    "lopa_k4_block": dict(PARITY_COMMON, strategy="lopa", branching_factor=4, use_full_attention=False,
                          sampling_strategy="default"),
    "d2f_block": dict(PARITY_COMMON, strategy="d2f", use_full_attention=False, sampling_strategy="margin"),
    # APD's captured step with its fused head (CUDA's default at T = 0)
    "apd_r07": dict(strategy="apd", apd_mixture_weight=0.7, kv_window=4, max_lookahead=8, max_new_tokens=16,
                    verifier=VERIFIER),
}


def stage_parity(dry: bool) -> dict:
    dev = torch.device("cpu" if dry else "cuda")
    configs = dict(list(PARITY_CONFIGS.items())[:1]) if dry else PARITY_CONFIGS
    dtypes = (torch.float32,) if dry else (torch.float32, torch.bfloat16)
    n_prompts = 1 if dry else 3
    res = {}
    for dtype in dtypes:
        model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6,
                             dtype=dtype).to(dev)
        verifier = random_model(tiny_hf_config("qwen2", vocab_size=64, num_kv_heads=2), seed=1, sharpen=6,
                                dtype=dtype).to(dev)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 60, (9,), generator=g).to(dev) for _ in range(n_prompts)]
        same = total = runs_exact = runs = 0
        per = {}
        for name, kw in configs.items():
            kw = dict(kw, verifier=verifier) if kw.get("verifier") == VERIFIER else dict(kw)
            strategy = kw.pop("strategy")
            for p in prompts:
                ref = lopa_fast.generate(model, p, strategy, "reference", **kw).generated_ids
                fast = lopa_fast.generate(model, p, strategy, "fast", compile=True, **kw).generated_ids
                n = max(len(ref), len(fast))
                eq = sum(int(a == b) for a, b in zip(ref, fast))
                same, total, runs = same + eq, total + n, runs + 1
                runs_exact += int(ref == fast)
                per.setdefault(name, []).append(dict(exact=ref == fast, agree=eq, n=n))
        key = str(dtype).replace("torch.", "")
        res[key] = dict(runs=runs, exact_runs=runs_exact, agreement=same / max(1, total), per_config=per)
        print(key, json.dumps({k: v for k, v in res[key].items() if k != "per_config"}), flush=True)
    return res


def _batched_vs_sequential(model, ps: list, strategy: str, kw: dict, dev, k) -> tuple[list, dict]:
    """One warm-up, then the B prompts `ps` batched and one after another (synchronised): (batched outputs, the
    row: k (LoPA's branching factor or the strategy's name), B, seconds, request-rounds per second, same tokens)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lopa_fast.generate(model, ps, strategy, "fast", **kw)  # warm-up
        _sync(dev)
        t0 = time.perf_counter()
        outs = lopa_fast.generate(model, ps, strategy, "fast", **kw)
        _sync(dev)
        tb = time.perf_counter() - t0
        t0 = time.perf_counter()
        seq = [lopa_fast.generate(model, p, strategy, "fast", **kw) for p in ps]
        _sync(dev)
        ts = time.perf_counter() - t0
    req_rounds = sum(o.stats["forwards"] for o in outs)
    return outs, dict(k=k, B=len(ps), batched_s=tb, sequential_s=ts, request_rounds=req_rounds,
                      batched_rounds_per_s=req_rounds / tb, sequential_rounds_per_s=req_rounds / ts,
                      same_tokens=all(a.generated_ids == b.generated_ids for a, b in zip(outs, seq)))


def stage_batch(dry: bool) -> dict:
    if dry:
        dev = torch.device("cpu")
        model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
        verifier = random_model(tiny_hf_config("qwen2", vocab_size=64, num_kv_heads=2), seed=1, sharpen=6)
        window, prefix, batches, ks = 8, 16, (1, 2), (1, 4)
    else:
        from bench.bench_round_gpu import QWEN05B, dream7b_random

        dev = torch.device("cuda")
        model = dream7b_random()
        verifier = dream7b_random(QWEN05B)  # APD's: a Qwen2.5-0.5B-shaped causal model
        window, prefix, batches, ks = WINDOW, PREFIX, (1, 2, 4, 8, 16), (1, 4)
    V = model.config.vocab_size
    g = torch.Generator(device=dev).manual_seed(2)
    prompts = [torch.randint(0, V - 200 if V > 400 else V - 4, (prefix,), device=dev, generator=g) for _ in range(max(batches))]
    kw = dict(block_size=window, max_new_tokens=4 * window, block_add_threshold=1.0, skip_threshold=0.9,
              sampling_strategy="neg_entropy", max_rounds=4)
    rows = []
    for k in ks:
        for B in batches:
            ps = prompts[:B]
            outs, row = _batched_vs_sequential(model, ps, "lopa", dict(kw, branching_factor=k), dev, k)
            req_rounds = row["request_rounds"]
            if B > 1:  # the same batch with per-request attention (forward_requests without pool; on CPU both are that)
                real = model.forward_requests
                model.forward_requests = lambda parts, mode, b=None, pool=None: real(parts, mode, b)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        _sync(dev)
                        t0 = time.perf_counter()
                        loop = lopa_fast.generate(model, ps, "lopa", "fast", branching_factor=k, **kw)
                        _sync(dev)
                        tl = time.perf_counter() - t0
                finally:
                    del model.forward_requests
                row.update(per_request_rounds_per_s=req_rounds / tl,
                           per_request_same_tokens=all(a.generated_ids == b.generated_ids for a, b in zip(outs, loop)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    # the strategies whose steps batch through their drivers (issue 25): 32 new tokens, a few B; apd's step is two
    # batched forwards (the 7B drafter's window, then the 0.5B verifier over the drafts)
    steps_kw = {"vanilla": dict(max_new_tokens=32, steps=8, alg="entropy"),
                "threshold": dict(max_new_tokens=32, block_length=8, threshold=0.9, cache="prefix", max_rounds=8),
                "apd": dict(max_new_tokens=32, apd_mixture_weight=0.7, kv_window=16, max_lookahead=16, max_rounds=8,
                            verifier=verifier)}
    for strategy, skw in steps_kw.items():
        for B in (batches[0], batches[-1]):  # B = 1 and the largest (16 on the GPU): the stage has 60 s
            _, row = _batched_vs_sequential(model, prompts[:B], strategy, skw, dev, strategy)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return dict(device=str(dev), torch=torch.__version__, rows=rows)


def table(results: dict) -> str:
    lines = []
    r = results.get("round")
    if r:
        lines.append(f"round latency ({r['device']}, prefix {r['rows'][0]['prefix']}, window {r['rows'][0]['window']})")
        lines.append(f"{'k':>2} {'seqs':>4} {'eager ms':>9} {'captured ms':>11} {'floor ms':>8} {'capt/floor':>10} "
                     f"{'reads/rnd':>9}")
        for x in r["rows"]:
            c = x.get("captured_ms", float("nan"))
            lines.append(f"{x['k']:>2} {x['seqs']:>4} {x['eager_ms']:>9.2f} {c:>11.2f} {x['floor_ms']:>8.2f} "
                         f"{c / x['floor_ms']:>10.2f} {x.get('captured_reads', float('nan')):>9.2f}")
        if r["summary"]:
            s = r["summary"]
            lines.append(f"captured k=4 / floor = {s['captured_k4_over_floor']:.2f} (target <= 1.5); "
                         f"k=4 / k=1 = {s['captured_k4_over_k1']:.2f} (target <= 1.3)")
    b = results.get("batch")
    if b:
        lines.append(f"batched generate ({b['device']}): request-rounds per second, batched vs sequential")
        lines.append(f"{'k':>9} {'B':>3} {'batched':>9} {'sequential':>10} {'speed-up':>8} {'same tokens':>11} "
                     f"{'per-req':>8} {'same':>5}")
        for x in b["rows"]:  # k: LoPA's branching factor, or the name of a step strategy (vanilla, threshold, apd)
            lines.append(f"{x['k']:>9} {x['B']:>3} {x['batched_rounds_per_s']:>9.1f} {x['sequential_rounds_per_s']:>10.1f} "
                         f"{x['batched_rounds_per_s'] / x['sequential_rounds_per_s']:>8.2f} {str(x['same_tokens']):>11} "
                         f"{x.get('per_request_rounds_per_s', float('nan')):>8.1f} "
                         f"{str(x.get('per_request_same_tokens', '-')):>5}")
    p = results.get("parity")
    if p:
        for dt, x in p.items():
            if not isinstance(x, dict):  # 'seconds'
                continue
            lines.append(f"parity {dt}: {x['exact_runs']}/{x['runs']} runs token-exact, agreement {x['agreement']:.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=("round", "parity", "batch", "all", "table"), default="all")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (no GPU needed)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_dry" if a.dry_run else ""
    if a.stage == "table":  # read back what the stages wrote (gpu_check.sh prints this last)
        res = {s: json.loads((out / f"{s}{suffix}.json").read_text()) for s in ("round", "parity", "batch")
               if (out / f"{s}{suffix}.json").exists()}
        print(table(res))
        return 0
    stages = ("round", "parity", "batch") if a.stage == "all" else (a.stage,)
    res = {}
    for s in stages:
        t0 = time.perf_counter()
        res[s] = {"round": stage_round, "parity": stage_parity, "batch": stage_batch}[s](a.dry_run)
        res[s]["seconds"] = time.perf_counter() - t0
        (out / f"{s}{suffix}.json").write_text(json.dumps(res[s], indent=1, default=str))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
