"""CPU, one thread: APD on the reference vs the fast backend, side by side, on the embedded task.

The embedded `d2f-arith` drafter with the shipped causal `ar-arith` verifier, at the eval's APD rows (upstream's
Pareto presets (R, W, M) = (0.6, 32, 200) and (0.7, 16, 100) scaled by 32/256 to (0.6, 4, 25) and (0.7, 2, 13),
plus R = 0.9 at (2, 13): lopa_fast.tasks.evaluate.apd_rows) and the verifier-free leftright baseline (K = 1,
W = 2, M = 13: one token per step, so the per-step cost dominates), on PROBLEMS held-out problems
(`tasks.generate('test', PROBLEMS, seed=0)`). Both paths return the same tokens, acceptance counts and forwards
(asserted per problem), so the ratio compares equal work; accuracy and TPF are reported beside it. One benchmark
round runs the two paths alternately over all problems, so a burst of load on the shared CPU hits both alike.

Three paths: the reference; the eager fast step; compile=True (torch.compile fullgraph per (Nb, Db) bucket),
after a warm-up request per problem that compiles every bucket (its compile seconds are reported; later requests
replay: `compiled_graphs == 0` asserted). The prefill step (its verifier window is the whole draft) always runs
eagerly, and on this task an APD answer takes 1.6-2.6 steps, so compile pays mostly on the leftright row.

Run (results + the exact command in bench/results/apd_cpu.md):
    python -m pytest bench/bench_apd_cpu.py -m bench -q --benchmark-json=bench/results/apd_cpu.json
    python bench/bench_apd_cpu.py bench/results/apd_cpu.json > bench/results/apd_cpu.md
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
from lopa_fast import tasks
from lopa_fast.tasks import evaluate

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA
PATHS = ("reference", "fast", "compiled")
PROBLEMS, ROUNDS = 48, 5
ROWS = {**evaluate.apd_rows(evaluate.GEN_LEN),
        "leftright-k1": dict(strategy="apd", apd_mixture_weight=None, kv_window=2, max_lookahead=13)}
_cache: dict = {}


def setup():
    if not _cache:
        model, tok, _ = evaluate.load_default()
        verifier = evaluate.load_verifier()
        problems = tasks.generate("test", PROBLEMS, seed=0)
        prompts = [torch.tensor(evaluate.prompt_ids(tok, p), dtype=torch.long) for p in problems]
        _cache.update(model=model, tok=tok, verifier=verifier, problems=problems, prompts=prompts)
    return _cache


def run(path: str, row: str):
    c = setup()
    knobs = ROWS[row]
    extra = {"verifier": c["verifier"]} if knobs["apd_mixture_weight"] is not None else {}
    backend = "reference" if path == "reference" else "fast"
    return [lopa_fast.generate(c["model"], p, backend=backend, max_new_tokens=evaluate.GEN_LEN, temperature=0.0,
                               compile=path == "compiled", **knobs, **extra) for p in c["prompts"]]


@pytest.mark.bench
@pytest.mark.parametrize("row", list(ROWS))
def test_apd_cpu(benchmark, row):
    torch.set_num_threads(1)
    c = setup()
    t0 = time.perf_counter()
    warm = run("compiled", row)  # compiles every bucket (the explicit warm-up)
    warm_s = time.perf_counter() - t0
    compile_s = sum(sum(o.stats["compile_seconds"].values()) for o in warm)
    graphs = sum(o.stats["compiled_graphs"] for o in warm)
    times = {path: [] for path in PATHS}
    outs = {}

    def both():
        for path in PATHS:
            t = time.perf_counter()
            outs[path] = run(path, row)
            times[path].append(time.perf_counter() - t)

    benchmark.pedantic(both, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    for path in ("fast", "compiled"):
        for f, r in zip(outs[path], outs["reference"]):
            assert f.generated_ids == r.generated_ids, path
            for k in ("acceptance_counts", "dllm_forwards", "verifier_forwards"):
                assert f.stats[k] == r.stats[k], (path, k)
            assert f.stats["backend"] == "fast" and r.stats["backend"] == "reference"
    assert all(o.stats["compiled_graphs"] == 0 for o in outs["compiled"])  # replays only after the warm-up
    refs = outs["reference"]
    tok = c["tok"]
    correct = sum(int(tasks.extract_answer(tok.decode(o.generated_ids, skip_special_tokens=True)) == p.answer)
                  for o, p in zip(refs, c["problems"]))
    counts = [a for o in refs for a in o.stats["acceptance_counts"]]
    fw = sum(o.stats["dllm_forwards"] for o in refs)
    benchmark.extra_info.update(
        row=row, knobs={k: v for k, v in ROWS[row].items() if k != "strategy"}, problems=len(refs),
        accuracy=correct / len(refs), tpf=sum(o.stats["generated_tokens"] for o in refs) / fw,
        dllm_forwards_per_answer=fw / len(refs), graphs=graphs, compile_s=compile_s, warmup_s=warm_s,
        buckets=sorted({tuple(b) for o in warm for b in o.stats["compiled_buckets"]}),
        verifier_forwards_per_answer=sum(o.stats["verifier_forwards"] for o in refs) / len(refs),
        mean_accepted=sum(counts) / len(counts),
        host_reads_per_step=sum(o.stats["host_reads"] for o in outs["fast"]) / fw,
        **{f"{p}_median": statistics.median(times[p]) for p in PATHS}, **{f"{p}_min": min(times[p]) for p in PATHS},
        torch=torch.__version__, threads=torch.get_num_threads(),
    )


def report(path: str) -> str:
    """Markdown table from the JSON: seconds for all problems (median of the rounds) and the ratios."""
    runs = [b["extra_info"] for b in json.load(open(path))["benchmarks"]]
    header = ["row", "(R, W, M)", "accuracy", "TPF", "dLLM fw / answer", "verifier fw / answer", "accepted / step",
              "host reads / step", "reference s", "fast s", "compiled s", "fast vs ref", "compiled vs ref", "graphs",
              "compile s"]
    rows = []
    tot = {p: 0.0 for p in PATHS}
    for e in runs:
        k = e["knobs"]
        r, f, c = (e[f"{p}_median"] for p in PATHS)
        for p in PATHS:
            tot[p] += e[f"{p}_median"]
        rows.append([
            e["row"], f"({k['apd_mixture_weight']}, {k['kv_window']}, {k['max_lookahead']})", f"{e['accuracy']:.1%}",
            f"{e['tpf']:.2f}", f"{e['dllm_forwards_per_answer']:.2f}", f"{e['verifier_forwards_per_answer']:.2f}",
            f"{e['mean_accepted']:.2f}", f"{e['host_reads_per_step']:.2f}", f"{r:.3f}", f"{f:.3f}", f"{c:.3f}",
            f"**{r / f:.2f}x**", f"**{r / c:.2f}x**", e["graphs"], f"{e['compile_s']:.0f}",
        ])
    t = tot
    rows.append(["all", "", "", "", "", "", "", "", f"{t['reference']:.3f}", f"{t['fast']:.3f}", f"{t['compiled']:.3f}",
                 f"**{t['reference'] / t['fast']:.2f}x**", f"**{t['reference'] / t['compiled']:.2f}x**", "", ""])
    return tabulate(rows, header, tablefmt="github", disable_numparse=True)


if __name__ == "__main__":
    print(report(sys.argv[1]))
