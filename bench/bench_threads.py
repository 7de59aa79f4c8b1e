"""The CPU thread policy (lopa_fast.request.threads), side by side in one run: ms per `generate` through the Python API under
LOPA_FAST_THREADS=auto (the default), =keep (torch's own count) and =1, and through the CLI (its --threads 1; the
stats' wall time, process start excluded), on the embedded model and on a ~60M-parameter Dream-shaped random model.

    python bench/bench_threads.py > bench/results/threads.md

Each row: the median of REPS calls after one warm-up (the same prompt, LoPA k=4 as the embedded model's preset, 32
new tokens). The machine's load average is printed with the table: on the shared 2-core machine other work
changes the absolute numbers, the ratios of one run are the measurement.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

import lopa_fast
from lopa_fast import tasks
from lopa_fast.request import threads
from lopa_fast.assets import model_dir
from lopa_fast.testing import random_model, tiny_hf_config

REPS = 5
KNOBS = dict(strategy="lopa", branching_factor=4, block_size=8, max_new_tokens=32)


def _ms(model, ids, policy: str) -> float:
    os.environ[threads.ENV] = policy
    lopa_fast.generate(model, ids, **KNOBS)  # warm-up (caches)
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        lopa_fast.generate(model, ids, **KNOBS)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def _cli_ms(prompt: str) -> float:
    """The CLI's own wall time of one generate (stats seconds: decoding only, as the API rows time it)."""
    cmd = [sys.executable, "-m", "lopa_fast", "generate", "--prompt", prompt, "--json", "-q",
           "--strategy", "lopa", "--branching-factor", "4", "--block-size", "8", "--max-new-tokens", "32"]
    out = []
    for _ in range(3):
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out.append(1000 * json.loads(r.stdout)["stats"]["seconds"])
    return statistics.median(out)


def main() -> None:
    embedded = lopa_fast.load_model(model_dir(), dtype=torch.float32)
    tok = lopa_fast.load_tokenizer(model_dir())
    prompt = tasks.generate("test", 1, seed=0)[0].prompt
    ids = tok(prompt)["input_ids"]
    big = random_model(tiny_hf_config("dream", vocab_size=4096, hidden_size=576, num_layers=12, num_heads=9,
                                      num_kv_heads=3, intermediate_size=1536, max_position_embeddings=256),
                       seed=0, sharpen=6)
    torch_default = torch.get_num_threads()
    rows = []
    for name, model, p_ids in (("embedded d2f-arith", embedded, ids), ("60M random Dream", big, [5, 9, 2, 7] * 8)):
        keep = _ms(model, p_ids, "keep")  # torch's own count first, then the policy's
        auto = _ms(model, p_ids, "auto")
        one = _ms(model, p_ids, "1")
        os.environ[threads.ENV] = "auto"
        picked = threads.threads_for(model)
        rows.append((name, f"{threads.body_params(model) / 1e6:.1f}M", picked or torch_default, auto, keep, one))
    os.environ[threads.ENV] = "auto"
    cli = _cli_ms(prompt)
    print("# CPU thread policy of the Python API (issue 26)\n")
    print(f"Command: `python bench/bench_threads.py > bench/results/threads.md`; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, torch's default {torch_default} threads, load average "
          f"{os.getloadavg()[0]:.1f} at the end (other work shares the machine). LoPA k=4, block 8, 32 new tokens; "
          f"median of {REPS} calls after a warm-up.\n")
    print("| model | body params | threads under `auto` | API `auto` ms | API `keep` ms | API 1 thread ms | "
          "keep / auto | 1 thread / auto |")
    print("|---|---|---|---|---|---|---|---|")
    for name, params, picked, auto, keep, one in rows:
        print(f"| {name} | {params} | {picked} | {auto:.1f} | {keep:.1f} | {one:.1f} | {keep / auto:.2f}x | "
              f"{one / auto:.2f}x |")
    print(f"\nCLI (`python -m lopa_fast generate ...`, --threads 1, stats wall time) on the embedded model: {cli:.1f} ms "
          f"(API `auto` / CLI: {rows[0][3] / cli:.2f}x).")


if __name__ == "__main__":
    main()
