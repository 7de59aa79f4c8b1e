"""CPU, one thread: reference vs eager fast vs compiled fast (compile=True, after warm-up), side by side.

The grid of the compiled-round issue: LoPA/D2F with branching_factor k in {1, 2, 4} (1, 3, 5 sequences
per round), both attention modes, block sizes 4 and 8, on the project's tiny random Dream model (2 layers,
hidden 32, vocab 64, sharpened), three prompts of one length per config (so the compiled rounds of the
first prompt serve the others). Three paths: the reference; the eager fast round (the round that compile and
CUDA graphs trace, run op by op); compile=True. All produce the same tokens and forwards (asserted), so the
ratios compare equal work. One benchmark round runs the paths alternately on the three prompts, so a burst of
load on the shared CPU hits all of them alike. Compile seconds (first request, per config) are reported.

Run (results + the exact command in bench/results/round_cpu.md; with a fresh Inductor cache directory the
compile seconds are cold ones, as on a new machine; without, warm):
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -m pytest bench/bench_round_cpu.py -m bench -q \
        --benchmark-json=bench/results/round_cpu.json
    python bench/bench_round_cpu.py bench/results/round_cpu.json > bench/results/round_cpu.md
The eager paths alone (no Inductor compile, seconds instead of an hour on a loaded 2-core machine):
    ROUND_CPU_PATHS=reference,fast python -m pytest bench/bench_round_cpu.py -m bench -q ...
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import pytest
import torch
from tabulate import tabulate

import lopa_fast
from lopa_fast.testing import random_model, tiny_hf_config

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA
# ROUND_CPU_PATHS=reference,fast: the eager paths only (no Inductor compile: minutes per config)
PATHS = tuple(os.environ.get("ROUND_CPU_PATHS", "reference,fast,compiled").split(","))
PROMPTS, PROMPT_LEN, ROUNDS = 3, 16, 5
_model = None


def model():
    global _model
    if _model is None:
        _model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    return _model


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 60, (PROMPT_LEN,), generator=g) for _ in range(PROMPTS)]


def knobs(k: int, full: bool, bs: int) -> dict:
    return dict(branching_factor=k, use_full_attention=full, block_size=bs, max_new_tokens=32, skip_threshold=0.9,
                sampling_strategy="neg_entropy", eos_token_id=0)  # eos 0: rarely predicted, all 32 decode


def run(path: str, p, kw: dict):
    """reference; fast: the eager round; compiled: compile=True."""
    backend = "reference" if path == "reference" else "fast"
    return lopa_fast.generate(model(), p, "lopa", backend, compile=path == "compiled", **kw)


@pytest.mark.bench
@pytest.mark.parametrize("bs", [4, 8])
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_round_cpu(benchmark, k, full, bs):
    torch.set_num_threads(1)
    kw = knobs(k, full, bs)
    ps = prompts()
    t0 = time.perf_counter()
    compiled = "compiled" in PATHS
    warm = [run("compiled", p, kw) for p in ps] if compiled else []  # compiles every bucket (the explicit warm-up)
    warm_s = time.perf_counter() - t0
    compile_s = sum(sum(o.stats["compile_seconds"].values()) for o in warm)  # this config's buckets only
    graphs = sum(o.stats["compiled_graphs"] for o in warm)
    refs = [run("reference", p, kw) for p in ps]
    times = {path: [] for path in PATHS}
    outs = {}

    def triple():
        for path in PATHS:
            t = time.perf_counter()
            outs[path] = [run(path, p, kw) for p in ps]
            times[path].append(time.perf_counter() - t)

    benchmark.pedantic(triple, rounds=ROUNDS, iterations=1)
    for path in PATHS[1:]:
        for o, r in zip(outs[path], refs):
            assert o.generated_ids == r.generated_ids and o.stats["forwards"] == r.stats["forwards"], path
    assert all(o.stats["compiled_graphs"] == 0 for o in outs.get("compiled", []))  # replays only after warm-up
    med = {path: statistics.median(v) for path, v in times.items()}
    benchmark.extra_info.update(
        k=k, full=full, bs=bs, forwards=sum(o.stats["forwards"] for o in refs), graphs=graphs,
        buckets=sorted({tuple(b) for o in warm for b in o.stats["compiled_buckets"]}), compile_s=compile_s,
        warmup_s=warm_s, **{f"{p}_median": med[p] for p in PATHS}, **{f"{p}_min": min(times[p]) for p in PATHS},
        torch=torch.__version__, threads=torch.get_num_threads(),
    )


NAMES = {"reference": "reference", "fast": "fast", "compiled": "compiled"}


def report(path: str) -> str:
    """Markdown table from the JSON: seconds per 3 requests (median of the rounds) of the paths measured, the ratios
    to the reference and (with compiled) the compile cost."""
    runs = [b["extra_info"] for b in json.load(open(path))["benchmarks"]]
    paths = [p for p in PATHS if f"{p}_median" in runs[0]]
    fast = [p for p in paths if p != "reference"]
    compiled = "compiled" in paths
    header = ["k (seqs)", "attention", "block", "forwards", *(f"{NAMES[p]} s" for p in paths),
              *(f"{NAMES[p]} vs ref" for p in fast),
              *(["graphs", "compile s", "pays off after"] if compiled else [])]
    rows = []
    tot = dict.fromkeys(paths, 0.0)
    for e in sorted(runs, key=lambda e: (e["k"], not e["full"], e["bs"])):
        med = {p: e[f"{p}_median"] for p in paths}
        for p in paths:
            tot[p] += med[p]
        k = e["k"]
        row = [f"{k} ({k + 1 if k > 1 else 1})", "full" if e["full"] else "block-causal", e["bs"], e["forwards"],
               *(f"{med[p]:.4f}" for p in paths), *(f"**{med['reference'] / med[p]:.2f}x**" for p in fast)]
        if compiled:
            per_req_gain = (med["fast"] - med["compiled"]) / PROMPTS  # against the default eager path
            pay = f"{e['compile_s'] / per_req_gain:.0f} requests" if per_req_gain > 0 else "never"
            row += [e["graphs"], f"{e['compile_s']:.1f}", pay]
        rows.append(row)
    last = ["all", "", "", "", *(f"{tot[p]:.3f}" for p in paths),
            *(f"**{tot['reference'] / tot[p]:.2f}x**" for p in fast)]
    rows.append(last + ([""] * 3 if compiled else []))
    return tabulate(rows, header, tablefmt="github", disable_numparse=True)


if __name__ == "__main__":
    print(report(sys.argv[1]))
