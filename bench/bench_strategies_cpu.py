"""CPU, one thread: per strategy, backend="reference" vs backend="fast", side by side in one run.

Strategies: vanilla (Dream `entropy`, one token per step), threshold (Fast-dLLM, tau 0.9, blocks of 8) with each
cache (None, "prefix", "dual"), d2f, lopa (k = 2), and at T = 0.7 with the keyed sampler threshold (dual) and
lopa (k = 2). Models: the project's tiny random Dream model (2 layers, hidden 32, vocab 64, sharpened) and a
mid-size random Dream model (4 layers, hidden 256, 8 / 2 heads, vocab 4096, sharpened). Two prompts of 24
tokens, 32 new tokens each. Both backends produce the same tokens and forwards (asserted), so the ratio
compares equal work; one benchmark round runs the two paths alternately on the prompts, so a burst of load on
the shared CPU hits both alike. TPF (tokens per forward) is reported beside the ratio: the fast backend does
not change it (same forwards), it changes the seconds per forward.

Run (results + this command in bench/results/strategies_cpu.md):
    python -m pytest bench/bench_strategies_cpu.py -m bench -q --benchmark-json=bench/results/strategies_cpu.json
    python bench/bench_strategies_cpu.py bench/results/strategies_cpu.json > bench/results/strategies_cpu.md
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings

import pytest
import torch
from tabulate import tabulate

import lopa_fast
from lopa_fast.testing import random_model, tiny_hf_config

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA
PATHS = ("reference", "fast")
PROMPTS, PROMPT_LEN, NEW, ROUNDS = 2, 24, 32, 3
MODELS = {
    "tiny": dict(cfg=dict(vocab_size=64, num_kv_heads=2), sharpen=6),
    "mid": dict(cfg=dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                         num_kv_heads=2), sharpen=30),
}
ROWS = {
    "vanilla": ("vanilla", dict(steps=NEW, alg="entropy")),
    "threshold": ("threshold", dict(threshold=0.9, block_length=8)),
    "threshold-prefix": ("threshold", dict(threshold=0.9, block_length=8, cache="prefix")),
    "threshold-dual": ("threshold", dict(threshold=0.9, block_length=8, cache="dual")),
    "d2f": ("d2f", dict(block_size=8)),
    "lopa-k2": ("lopa", dict(block_size=8, branching_factor=2)),
    "threshold-dual T0.7": ("threshold", dict(threshold=0.9, block_length=8, cache="dual", temperature=0.7, seed=1)),
    "lopa-k2 T0.7": ("lopa", dict(block_size=8, branching_factor=2, temperature=0.7, seed=1)),
}
_models: dict = {}


def model(name: str):
    if name not in _models:
        spec = MODELS[name]
        _models[name] = random_model(tiny_hf_config("dream", **spec["cfg"]), seed=0, sharpen=spec["sharpen"])
    return _models[name]


def prompts(name: str):
    g = torch.Generator().manual_seed(0)
    V = model(name).config.vocab_size
    return [torch.randint(0, V - 3, (PROMPT_LEN,), generator=g) for _ in range(PROMPTS)]


@pytest.mark.bench
@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("mname", list(MODELS))
def test_strategies_cpu(benchmark, mname, row):
    torch.set_num_threads(1)
    strategy, kw = ROWS[row]
    kw = dict(kw, max_new_tokens=NEW, eos_token_id=0)  # eos 0: rarely predicted, all 32 positions decode
    m, ps = model(mname), prompts(mname)
    times = {p: [] for p in PATHS}
    outs = {}

    def run(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [lopa_fast.generate(m, p, strategy, path, **kw) for p in ps]

    run("fast")  # first-use costs (the fused weight view) out of the timed rounds

    def pair():
        for path in PATHS:
            t = time.perf_counter()
            outs[path] = run(path)
            times[path].append(time.perf_counter() - t)

    benchmark.pedantic(pair, rounds=ROUNDS, iterations=1)
    for o, r in zip(outs["fast"], outs["reference"]):
        assert o.generated_ids == r.generated_ids and o.stats["forwards"] == r.stats["forwards"], row
        assert o.stats["backend"] == "fast"
    med = {p: statistics.median(v) for p, v in times.items()}
    fw = sum(o.stats["forwards"] for o in outs["reference"])
    benchmark.extra_info.update(
        model=mname, row=row, forwards=fw, tpf=PROMPTS * NEW / fw, **{f"{p}_median": med[p] for p in PATHS},
        torch=torch.__version__, threads=torch.get_num_threads(),
    )


def report(path: str) -> str:
    """Markdown table from the JSON: milliseconds per request (median of the rounds) and the ratio."""
    runs = [b["extra_info"] for b in json.load(open(path))["benchmarks"]]
    header = ["model", "strategy", "forwards / request", "TPF", "reference ms / request", "fast ms / request",
              "fast vs reference"]
    order = list(ROWS)
    rows = []
    for e in sorted(runs, key=lambda e: (list(MODELS).index(e["model"]), order.index(e["row"]))):
        r, f = e["reference_median"] / PROMPTS * 1e3, e["fast_median"] / PROMPTS * 1e3
        rows.append([e["model"], e["row"], f"{e['forwards'] / PROMPTS:.1f}", f"{e['tpf']:.2f}", f"{r:.1f}", f"{f:.1f}",
                     f"**{r / f:.2f}x**"])
    return tabulate(rows, header, tablefmt="github", disable_numparse=True)


if __name__ == "__main__":
    print(report(sys.argv[1]))
