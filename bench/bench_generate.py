"""End-to-end decode benchmark on CPU: backend="fast" vs backend="reference", side by side in one run.

Two random-weight Dream-shaped models: `tiny` (2 layers, hidden 32: overhead-bound, where batching the
k+1 branches into one forward and keeping the round on the device pays most) and `mid` (~57M parameters:
8 layers, hidden 512, GQA 8/2 heads, vocab 32000: compute-bound on 2 cores, where one batched forward of
k+1 windows can save at most the per-call overhead). branching_factor in {1, 2, 4, 8} (1, 3, 5, 9
sequences per round). The two backends produce the same tokens and forwards (asserted), so the wall
ratio compares equal work.

Run (results + the exact command in bench/results/generate_cpu.md):
    python -m pytest bench/bench_generate.py -m bench -q -p no:randomly \
        --benchmark-json=bench/results/generate_cpu.json
    python bench/bench_generate.py bench/results/generate_cpu.json > bench/results/generate_cpu.md
"""
from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

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
        rounds=7,
    ),
    "mid": dict(
        hf=dict(kind="dream", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                num_kv_heads=2, max_position_embeddings=1024),  # fmt: skip
        sharpen=1.0,
        prompt_len=16,
        # few rounds, short prompt: the CPU is shared. Both backends stop at the same round cap.
        knobs=dict(block_size=16, max_new_tokens=32, skip_threshold=0.9, sampling_strategy="neg_entropy",
                   max_rounds=6),  # fmt: skip
        rounds=2,
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
@pytest.mark.parametrize("backend", ["reference", "fast"])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model", list(SETUPS))
def test_generate(benchmark, model, k, backend):
    torch.set_num_threads(2)
    ref = run(model, k, "reference")  # warm-up + the oracle for this config
    out = benchmark.pedantic(run, args=(model, k, backend), rounds=SETUPS[model]["rounds"], iterations=1)
    assert out.generated_ids == ref.generated_ids and out.stats["forwards"] == ref.stats["forwards"]
    benchmark.extra_info.update(
        model=model, k=k, backend=backend, params=n_params(get_model(model)), forwards=out.stats["forwards"],
        model_calls=out.stats["model_calls"], generated_tokens=out.stats["generated_tokens"],
        lookahead_wins=out.stats.get("lookahead_wins"), host_reads=out.stats.get("host_reads"),
        kv_prefix_bytes=out.stats.get("kv_prefix_bytes"), kv_window_bytes=out.stats.get("kv_window_bytes"),
        torch=torch.__version__, threads=torch.get_num_threads(),
    )  # fmt: skip


def report(path: str) -> str:
    """Markdown table (fast vs reference median wall time per generate, ratio, memory) from the JSON."""
    rows = json.load(open(path))["benchmarks"]
    by = {}
    for b in rows:
        e = b["extra_info"]
        by[(e["model"], e["k"], e["backend"])] = ((b["stats"]["median"], b["stats"]["min"]), e)
    out = ["| model | params | k (seqs/round) | forwards | ref model calls | reference s (min / median) "
           "| fast s (min / median) | speed-up (min / median) | fast host reads/round | KV prefix MB | KV window MB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model in SETUPS:
        for k in KS:
            if (model, k, "fast") not in by or (model, k, "reference") not in by:
                continue
            (rmed, rmin), er = by[(model, k, "reference")]
            (fmed, fmin), ef = by[(model, k, "fast")]
            out.append(
                f"| {model} | {ef['params'] / 1e6:.1f}M | {k} ({k + 1 if k > 1 else 1}) | {ef['forwards']} "
                f"| {er['model_calls']} | {rmin:.4f} / {rmed:.4f} | {fmin:.4f} / {fmed:.4f} "
                f"| **{rmin / fmin:.2f}x** / {rmed / fmed:.2f}x "
                f"| {ef['host_reads'] / ef['forwards']:.2f} | {ef['kv_prefix_bytes'] / 2**20:.3f} "
                f"| {ef['kv_window_bytes'] / 2**20:.3f} |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    print(report(sys.argv[1]))
