"""Batched generate vs B sequential single-prompt runs (CPU, one thread), side by side in one run.

For batch sizes B in {1, 2, 4, 8, 16}, D2F (k = 1) and LoPA k = 4 (and B in {1, 2, 4, 8} for vanilla, threshold
and APD, whose verifier is the shipped `ar-arith` / a random 4-layer qwen2), on the embedded `d2f-arith` model and
on a ~60M-parameter Dream-shaped random model (12 layers, hidden 576, GQA 9/3, vocab 4096; 32 new tokens, capped
at max_rounds so a point takes seconds): the same B prompts decoded by `generate(model, [ids...])` (one
forward per round for every live request) and by B calls of `generate(model, ids)`; both give the same tokens
(asserted). Throughput = generated tokens / wall seconds; latency = the mean per-request wall time (batched:
every request waits for the batch). The two paths alternate inside each repetition (median of 3).

Run (results + the exact command in bench/results/batching.md):
    python -m pytest bench/bench_batching.py -m bench -q --benchmark-json=bench/results/batching.json
    python bench/bench_batching.py bench/results/batching.json > bench/results/batching.md
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import pytest
import torch
from tabulate import tabulate

import lopa_fast
from lopa_fast.testing import random_model, tiny_hf_config

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA
BATCH = (1, 2, 4, 8, 16)
REPS = 3
_models: dict = {}


def model(name: str):
    if name not in _models:
        if name == "d2f-arith":
            from lopa_fast.assets import model_dir

            _models[name] = lopa_fast.load_model(model_dir("d2f-arith"))
        else:  # a Dream-shaped ~60M model (random weights, sharpened so decoding is not all fallbacks)
            cfg = tiny_hf_config("dream", vocab_size=4096, hidden_size=576, num_layers=12, num_heads=9, num_kv_heads=3,
                                 intermediate_size=1536)
            _models[name] = random_model(cfg, seed=0, sharpen=4)
    return _models[name]


def prompts(m, B: int) -> list:
    if m.config.vocab_size <= 200:  # the embedded task's held-out prompts
        from lopa_fast.assets import model_dir
        from lopa_fast.tasks import arith
        from lopa_fast.tasks.evaluate import prompt_ids

        tok = lopa_fast.load_tokenizer(model_dir("d2f-arith"))
        return [torch.tensor(prompt_ids(tok, p)) for p in arith.generate("test", B, seed=0)]
    g = torch.Generator().manual_seed(B)
    return [torch.randint(0, m.config.vocab_size - 8, (int(n),), generator=g) for n in torch.randint(8, 40, (B,), generator=g)]


@pytest.mark.bench
@pytest.mark.parametrize("B", BATCH)
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", ["d2f-arith", "dream-60m"])
def test_batching(benchmark, name, k, B):
    torch.set_num_threads(1)
    m = model(name)
    ps = prompts(m, B)
    kw = dict(branching_factor=k, block_size=8, max_new_tokens=32, max_rounds=40, on_round_cap="warn")
    times = {"batched": [], "sequential": []}
    outs = {}

    def both():
        t = time.perf_counter()
        outs["batched"] = lopa_fast.generate(m, ps, "lopa", "fast", **kw)
        times["batched"].append(time.perf_counter() - t)
        t = time.perf_counter()
        outs["sequential"] = [lopa_fast.generate(m, p, "lopa", "fast", **kw) for p in ps]
        times["sequential"].append(time.perf_counter() - t)

    benchmark.pedantic(both, rounds=REPS, iterations=1, warmup_rounds=1)
    for a, b in zip(outs["batched"], outs["sequential"]):
        assert a.generated_ids == b.generated_ids and a.stats["forwards"] == b.stats["forwards"]
    toks = sum(len(o.generated_ids) for o in outs["sequential"])
    med = {p: statistics.median(v) for p, v in times.items()}
    benchmark.extra_info.update(
        model=name, k=k, B=B, tokens=toks, forwards=sum(o.stats["forwards"] for o in outs["sequential"]),
        batched_s=med["batched"], sequential_s=med["sequential"],
        params=sum(p.numel() for p in m.parameters()), torch=torch.__version__,
    )


STEP_STRATEGIES = {  # the strategies whose steps batch since the driver protocol (issue 25): 32 new tokens
    "vanilla": dict(steps=16, alg="entropy"),
    "threshold": dict(block_length=8, threshold=0.9, cache="prefix"),
    # two forwards per step (the drafter's, then the verifier's over the drafts), each one call for the batch
    "apd": dict(apd_mixture_weight=0.7, kv_window=16, max_lookahead=16),
}
_verifiers: dict = {}


def verifier(name: str):
    """APD's verifier for the model `name`: the shipped causal `ar-arith` for d2f-arith (its tokenizer), a random
    causal qwen2 model (4 layers, hidden 256) over the same 4096 ids for dream-60m."""
    if name not in _verifiers:
        if name == "d2f-arith":
            from lopa_fast.tasks.evaluate import load_verifier

            _verifiers[name] = load_verifier()
        else:
            cfg = tiny_hf_config("qwen2", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                 intermediate_size=768)
            _verifiers[name] = random_model(cfg, seed=1, sharpen=4)
    return _verifiers[name]


@pytest.mark.bench
@pytest.mark.parametrize("B", (1, 2, 4, 8))
@pytest.mark.parametrize("strategy", sorted(STEP_STRATEGIES))
@pytest.mark.parametrize("name", ["d2f-arith", "dream-60m"])
def test_batching_steps(benchmark, name, strategy, B):
    """Vanilla / threshold / apd: B prompts batched (one forward per step for all; apd: one drafter and one verifier
    forward) vs B sequential runs, same tokens."""
    torch.set_num_threads(1)
    m = model(name)
    ps = prompts(m, B)
    kw = dict(STEP_STRATEGIES[strategy], max_new_tokens=32)
    if lopa_fast.strategies.get(strategy).takes_verifier:
        kw["verifier"] = verifier(name)
    times = {"batched": [], "sequential": []}
    outs = {}

    def both():
        t = time.perf_counter()
        outs["batched"] = lopa_fast.generate(m, ps, strategy, "fast", **kw)
        times["batched"].append(time.perf_counter() - t)
        t = time.perf_counter()
        outs["sequential"] = [lopa_fast.generate(m, p, strategy, "fast", **kw) for p in ps]
        times["sequential"].append(time.perf_counter() - t)

    benchmark.pedantic(both, rounds=REPS, iterations=1, warmup_rounds=1)
    for a, b in zip(outs["batched"], outs["sequential"]):
        assert a.generated_ids == b.generated_ids and a.stats["forwards"] == b.stats["forwards"]
    med = {p: statistics.median(v) for p, v in times.items()}
    benchmark.extra_info.update(
        model=name, strategy=strategy, k="-", B=B, tokens=sum(len(o.generated_ids) for o in outs["sequential"]),
        forwards=sum(o.stats["forwards"] for o in outs["sequential"]), batched_s=med["batched"],
        sequential_s=med["sequential"], params=sum(p.numel() for p in m.parameters()), torch=torch.__version__,
    )


def report(path: str) -> str:
    runs = [b["extra_info"] for b in json.load(open(path))["benchmarks"]]
    header = ["model", "strategy", "k", "B", "tokens", "sequential s", "batched s", "sequential tok/s", "batched tok/s",
              "speed-up", "latency seq. (mean per request) s", "latency batched s"]
    rows = []
    for e in sorted(runs, key=lambda e: (e["model"], e.get("strategy", "lopa"), str(e["k"]), e["B"])):
        s, b = e["sequential_s"], e["batched_s"]
        # sequential: request i waits for the i-1 before it, so the mean latency is about (B + 1) / 2 runs
        lat_seq = s * (e["B"] + 1) / (2 * e["B"])
        rows.append([f"{e['model']} ({e['params'] / 1e6:.1f}M)", e.get("strategy", "d2f / lopa"), e["k"], e["B"], e["tokens"], f"{s:.3f}", f"{b:.3f}",
                     f"{e['tokens'] / s:.0f}", f"{e['tokens'] / b:.0f}", f"**{s / b:.2f}x**", f"{lat_seq:.3f}",
                     f"{b:.3f}"])
    return tabulate(rows, header, tablefmt="github", disable_numparse=True)


if __name__ == "__main__":
    print(report(sys.argv[1]))
