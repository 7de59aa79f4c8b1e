"""End-to-end decode benchmark on CPU: backend="fast" vs backend="reference", side by side in one run.

Two random-weight Dream-shaped models: `tiny` (2 layers, hidden 32: overhead-bound, where batching the
k+1 branches into one forward and keeping the round on the device pays most) and `mid` (~57M parameters:
8 layers, hidden 512, GQA 8/2 heads, vocab 32000: compute-bound on 2 cores, where one batched forward of
k+1 windows can save at most the per-call overhead). branching_factor in {1, 2, 4, 8} (1, 3, 5, 9
sequences per round). The two backends produce the same tokens and forwards (asserted), so the wall
ratio compares equal work.

Run (results + the exact command in bench/results/generate_cpu.md):
    python -m pytest bench/bench_generate.py -m bench -q \
        --benchmark-json=bench/results/generate_cpu.json
    python bench/bench_generate.py bench/results/generate_cpu.json > bench/results/generate_cpu.md
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
KS = (1, 2, 4, 8)

# per model: config, decode knobs, prompt length, benchmark rounds
SETUPS = {
    "tiny": dict(
        hf=dict(kind="dream", vocab_size=64),
        sharpen=6.0,
        prompt_len=16,
        knobs=dict(block_size=8, max_new_tokens=64, skip_threshold=0.9, sampling_strategy="neg_entropy",
                   eos_token_id=0),  # an id the random model rarely predicts: all 64 positions decode
        rounds=15,
        threads=1,  # overhead-bound: a second intra-op thread only adds synchronisation
    ),
    "mid": dict(
        hf=dict(kind="dream", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                num_kv_heads=2, max_position_embeddings=1024),
        sharpen=1.0,
        prompt_len=16,
        # few rounds, short prompt: the CPU is shared. Both backends stop at the same round cap.
        knobs=dict(block_size=16, max_new_tokens=32, skip_threshold=0.9, sampling_strategy="neg_entropy",
                   max_rounds=6),
        rounds=3,
        threads=2,
    ),
}
_models: dict = {}


def get_model(name: str):
    if name not in _models:
        s = SETUPS[name]
        hf = dict(s["hf"])
        _models[name] = random_model(tiny_hf_config(hf.pop("kind"), **hf), seed=0, sharpen=s["sharpen"])
    return _models[name]


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run(name: str, k: int, backend: str):
    s = SETUPS[name]
    m = get_model(name)
    prompt = torch.randint(0, m.config.vocab_size - 3, (s["prompt_len"],), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mid model stops at its round cap on purpose
        return lopa_fast.generate(m, prompt, "lopa", backend, branching_factor=k, **s["knobs"])


@pytest.mark.bench
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model", list(SETUPS))
def test_generate(benchmark, model, k):
    """One benchmark round = reference then fast on the same request, timed separately: the two backends
    alternate, so a burst of load on the shared CPU hits both sides alike (min and median per side go to
    extra_info; the ratio is computed from those)."""
    torch.set_num_threads(SETUPS[model]["threads"])
    ref = run(model, k, "reference")  # warm-up + the oracle for this config
    run(model, k, "fast")
    times = {"reference": [], "fast": []}
    outs = {}

    def pair():
        for backend in ("reference", "fast"):
            t0 = time.perf_counter()
            outs[backend] = run(model, k, backend)
            times[backend].append(time.perf_counter() - t0)

    benchmark.pedantic(pair, rounds=SETUPS[model]["rounds"], iterations=1)
    out = outs["fast"]
    assert out.generated_ids == ref.generated_ids and out.stats["forwards"] == ref.stats["forwards"]
    benchmark.extra_info.update(
        model=model, k=k, params=n_params(get_model(model)), forwards=out.stats["forwards"],
        ref_model_calls=outs["reference"].stats["model_calls"], generated_tokens=out.stats["generated_tokens"],
        lookahead_wins=out.stats.get("lookahead_wins"), host_reads=out.stats.get("host_reads"),
        kv_prefix_bytes=out.stats.get("kv_prefix_bytes"), kv_window_bytes=out.stats.get("kv_window_bytes"),
        ref_min=min(times["reference"]), ref_median=statistics.median(times["reference"]),
        fast_min=min(times["fast"]), fast_median=statistics.median(times["fast"]),
        torch=torch.__version__, threads=torch.get_num_threads(),
    )


def report(path: str) -> str:
    """Markdown table (reference vs fast wall time per generate, ratio, memory) from the JSON."""
    runs = [b["extra_info"] for b in json.load(open(path))["benchmarks"]]
    header = ["model", "params", "threads", "k (seqs/round)", "forwards", "ref model calls",
              "reference s (min / median)", "fast s (min / median)", "speed-up (min / median)",
              "fast host reads/round", "KV prefix MB", "KV window MB"]
    rows = []
    for e in sorted(runs, key=lambda e: (list(SETUPS).index(e["model"]), e["k"])):
        k = e["k"]
        rows.append([
            e["model"], f"{e['params'] / 1e6:.1f}M", e["threads"], f"{k} ({k + 1 if k > 1 else 1})", e["forwards"],
            e["ref_model_calls"], f"{e['ref_min']:.4f} / {e['ref_median']:.4f}",
            f"{e['fast_min']:.4f} / {e['fast_median']:.4f}",
            f"**{e['ref_min'] / e['fast_min']:.2f}x** / {e['ref_median'] / e['fast_median']:.2f}x",
            f"{e['host_reads'] / e['forwards']:.2f}", f"{e['kv_prefix_bytes'] / 2**20:.3f}",
            f"{e['kv_window_bytes'] / 2**20:.3f}",
        ])
    return tabulate(rows, header, tablefmt="github", disable_numparse=True)


if __name__ == "__main__":
    print(report(sys.argv[1]))
