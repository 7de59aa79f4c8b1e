"""Side by side with upstream's own loop, in one process: the golden configs of tests/golden/lopa_upstream.json.

What runs (each config, interleaved within every repetition, warm: one untimed pass first):
  upstream   zhijie-group/LoPA's `_generate_enhanced_speculative` (LoPA) / `_generate_original_single_branch` (D2F),
             its loop and bookkeeping unchanged, our tiny network as its model (tests/golden/make_lopa_golden.py's
             harness: the adapter is a dense-mask SDPA forward, the contract of upstream's modified Dream model)
  reference  lopa_fast.generate(..., backend="reference")
  fast       lopa_fast.generate(..., backend="fast") (the eager fast path: on CPU its round selection is the C++
             `select_round` when lopa_fast._C is built, else its torch backend; LOPA_FAST_BACKEND=torch forces that)
Every path must return the same tokens (asserted: the goldens are upstream's own). Upstream's LoPA loop calls
`gc.collect()` after every multi-branch round (for GPU memory); in a process that has imported torch and
transformers one call costs ~0.2 s on this machine, so it is reported both ways: `upstream` (as published) and
`upstream_nogc` (its gc.collect() stubbed: the loop itself; the ratios the issue's goals are judged by).

The configs: the LoPA-repository cases of the golden file (D2F k = 1, LoPA k = 1 / 2 / 4 in both attention modes and
three confidence rules, plus four top-p / top-k ones), 52 in all; D2F's own decoder cases are not run (another repo).

Run (results: bench/results/vs_upstream.md / .json; the upstream checkout is never copied into this repository):
    git clone https://github.com/zhijie-group/LoPA /path/to/LoPA   # 433177a
    nice -n 5 python bench/bench_vs_upstream.py --upstream /path/to/LoPA --reps 3 \
        --json bench/results/vs_upstream.json > bench/results/vs_upstream.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from collections import defaultdict

import torch
from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
sys.path.insert(0, ROOT)

import lopa_fast  # noqa: E402
from lopa_fast.testing import model_from_spec  # noqa: E402

PATHS = ("upstream", "upstream_nogc", "reference", "fast")
KNOBS = ("max_new_tokens", "block_size", "block_add_threshold", "decoded_token_threshold", "skip_threshold",
         "use_full_attention", "sampling_strategy", "branching_factor", "branch_topp", "selection_conf_alpha",
         "top_p", "top_k", "eos_token_id")


def family(c: dict) -> str:
    return f"{c['strategy']} k={c['branching_factor']} {'full' if c['use_full_attention'] else 'block-causal'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="a zhijie-group/LoPA checkout (433177a)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (interleaved); default 3")
    ap.add_argument("--threads", type=int, default=1, help="torch threads; default 1")
    ap.add_argument("--json", help="write the raw timings here")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.upstream, "scale_dream_d2f", "scale_dream_d2f.py")):
        sys.exit(f"--upstream {a.upstream!r}: no scale_dream_d2f/scale_dream_d2f.py (a zhijie-group/LoPA checkout)")
    import make_lopa_golden as harness

    torch.set_num_threads(a.threads)
    up = harness.import_upstream(a.upstream)
    real_gc = up.gc
    no_gc = types.SimpleNamespace(collect=lambda *args: 0)
    golden = json.load(open(os.path.join(ROOT, "tests", "golden", "lopa_upstream.json")))
    models = {n: model_from_spec(s["hf"], s["random"]) for n, s in golden["models"].items()}
    cases = [c for c in golden["cases"] if c.get("source") != "D2F-eval"]

    def run(path: str, c: dict) -> list:
        m = models[c["model"]]
        if path.startswith("upstream"):
            up.gc = no_gc if path == "upstream_nogc" else real_gc
            return harness.run_case(up, m, c)["generated_ids"]
        knobs = {k: c[k] for k in KNOBS if c.get(k) is not None}
        return lopa_fast.generate(m, torch.tensor(c["prompt"]), c["strategy"], backend=path, **knobs).generated_ids

    times = defaultdict(list)  # (case index, path) -> seconds
    load = []
    for rep in range(a.reps + 1):  # rep 0: warm-up, untimed
        for i, c in enumerate(cases):
            ids = {}
            for path in PATHS:
                t = time.perf_counter()
                ids[path] = run(path, c)
                if rep:
                    times[(i, path)].append(time.perf_counter() - t)
            want = c["generated_ids"]
            bad = [p for p in PATHS if ids[p] != want]
            if bad:
                raise SystemExit(f"case {i} ({family(c)}): {bad} differ from the golden tokens")
        load.append(os.getloadavg()[0])

    per_case = {(i, p): min(v) for (i, p), v in times.items()}  # min over reps: the least-disturbed run
    fams = defaultdict(list)
    for i, c in enumerate(cases):
        fams[family(c)].append(i)

    def ratio(num: str, den: str, idx) -> tuple[float, float]:
        """(total-time ratio, geometric mean of per-case ratios) num / den over cases idx."""
        tot = sum(per_case[(i, num)] for i in idx) / sum(per_case[(i, den)] for i in idx)
        geo = math.exp(sum(math.log(per_case[(i, num)] / per_case[(i, den)]) for i in idx) / len(idx))
        return tot, geo

    rows = []
    for name, idx in list(fams.items()) + [("all", list(range(len(cases))))]:
        r = [name, len(idx)] + [f"{sum(per_case[(i, p)] for i in idx):.3f}" for p in PATHS]
        for den in ("upstream_nogc", "upstream", "reference"):
            tot, geo = ratio(den, "fast", idx)
            r.append(f"**{tot:.2f}x** ({geo:.2f}x)")
        rows.append(r)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    from lopa_fast.ops import _backend

    print("# Side by side with upstream LoPA's own loop (tiny models, CPU, fp32, T = 0)\n")
    print(f"Commit {sha.strip()}, torch {torch.__version__}, {a.threads} thread(s), {platform.processor() or 'cpu'},"
          f" select_round backend on CPU: {_backend.resolve('select_round', None, torch.device('cpu'))}; "
          f"load average during the reps: {', '.join(f'{x:.1f}' for x in load)}. Seconds: the sum over the family's "
          f"cases of each case's fastest of {a.reps} interleaved repetitions. Ratios: that path's time / fast's "
          "(total, and in brackets the geometric mean of per-case ratios); > 1 means fast is faster. Every path "
          "returned the golden tokens.\n")
    print(tabulate(rows, headers=["configs", "n", *[f"{p} s" for p in PATHS], "fast vs upstream (no gc)",
                                  "fast vs upstream (as published)", "fast vs reference"], tablefmt="github"))
    print("\nCommand: `" + " ".join(["python", "bench/bench_vs_upstream.py", *sys.argv[1:]]) + "`")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": sha.strip(), "threads": a.threads, "load": load, "cases": [
                {"family": family(c), **{p: times[(i, p)] for p in PATHS}} for i, c in enumerate(cases)]}, f, indent=1)


if __name__ == "__main__":
    main()
