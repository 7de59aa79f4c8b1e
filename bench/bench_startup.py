"""What a user waits for, measured the way users measure it: wall clock of fresh processes, cold and warm caches.

Every measurement is a new process (`python -m lopa_fast ...` or `python -c ...`) on the embedded model, CPU, fp32:

  help          `python -m lopa_fast --help` (no torch import)
  bad_flag      `python -m lopa_fast generate --no-such-flag` (a one-line error, exit 2)
  cli_generate  `python -m lopa_fast generate --prompt P`: start to exit (the answer printed)
  cli_stream    `python -m lopa_fast generate --stream --prompt P`: start to the first text on stdout
  api_cold      `import lopa_fast; load_model; load_tokenizer; generate`: start to the first answer
  api_warm      the same process's second `generate` (what a long-lived program pays per call)
  serve_ready   `python -m lopa_fast serve --port N`: start to /health "ok" (its warm-up decode included)
  lm_eval_first the lm-eval model (`lopa_fast.lm_eval.LopaFastLM`): start to its first generate_until answer
  demo          `python -m lopa_fast demo`: start to exit

"fresh cache": every cache directory the package or torch writes to (LOPA_FAST_CACHE_DIR, TRITON_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR, XDG_CACHE_HOME) is a new empty one per process; "warm cache": one set shared by every run,
populated by a first run that is not counted. The Python bytecode of the package and of its dependencies is
compiled at install (the first import after `pip install` is not measured here). Runs alternate fresh / warm (and
checkouts, with `--tree`), so load on the shared machine hits all alike; the median of `--reps` runs is reported with
the load average.

Run (results + this command in bench/results/startup.md):
    nice -n 5 python bench/bench_startup.py --reps 3 --out bench/results/startup.md
Side by side with another checkout (each with its own .venv, e.g. a `git worktree` of an older commit):
    nice -n 5 python bench/bench_startup.py --tree now=. --tree before=../wt-old --out bench/results/startup.md
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . He gives away 5 pens . How many pens does Tom have now ?"
CACHE_VARS = ("LOPA_FAST_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")
PY = sys.executable  # the python of the tree being measured (`run` sets it per tree)
CWD = None  # that tree's root (None: this process's working directory)

API = """
import sys, time, json
t0 = float(sys.argv[1])
import torch, lopa_fast
from lopa_fast.assets import model_dir
m = lopa_fast.load_model(model_dir()); tok = lopa_fast.load_tokenizer(model_dir())
ids = tok(sys.argv[2])["input_ids"]
lopa_fast.generate(m, ids, strategy="lopa", branching_factor=4, block_size=8, max_new_tokens=32)
first = time.time() - t0
t1 = time.perf_counter()
lopa_fast.generate(m, ids, strategy="lopa", branching_factor=4, block_size=8, max_new_tokens=32)
print(json.dumps({"api_cold": first, "api_warm": time.perf_counter() - t1}))
"""
LM_EVAL = """
import sys, time, json
t0 = float(sys.argv[1])
from lm_eval.api.instance import Instance
from lopa_fast.lm_eval import LopaFastLM
lm = LopaFastLM(strategy="lopa", block_size=8, device="cpu")
req = Instance(request_type="generate_until", doc={}, arguments=(sys.argv[2] + " Answer :", {"max_gen_toks": 32}), idx=0)
lm.generate_until([req])
print(json.dumps({"lm_eval_first": time.time() - t0}))
"""


def _env(cache: Path) -> dict:
    env = {**os.environ, **{v: str(cache / v.lower()) for v in CACHE_VARS}}
    env.pop("LOPA_FAST_BACKEND", None)
    return env


def _timed(argv: list[str], env: dict, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=CWD)
    dt = time.perf_counter() - t0
    if r.returncode not in (0, 2):
        raise RuntimeError(f"{argv} exited {r.returncode}: {r.stderr[-2000:]}")
    return dt


def _first_stdout(argv: list[str], env: dict, timeout: float = 600) -> float:
    """Seconds from start to the first byte on stdout."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=CWD)
    try:
        first = p.stdout.read(1)
        dt = time.perf_counter() - t0
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    if not first:
        raise RuntimeError(f"{argv} printed nothing")
    return dt


def _json(code: str, env: dict) -> dict:
    r = subprocess.run([PY, "-c", code, repr(time.time()), PROMPT], env=env, capture_output=True, text=True,
                       timeout=600, cwd=CWD)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _serve_ready(env: dict, timeout: float = 300) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    p = subprocess.Popen([PY, "-m", "lopa_fast", "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, cwd=CWD)
    try:
        while time.perf_counter() - t0 < timeout:
            if p.poll() is not None:
                raise RuntimeError(f"serve exited {p.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if json.loads(r.read())["status"] == "ok":
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"serve not ready within {timeout} s")
    finally:
        p.kill()  # measured: the first answer; how the server shuts down is tests/test_server.py's
        p.wait()


def measure(name: str, env: dict) -> dict[str, float]:
    """{metric: seconds} of one fresh process for measurement `name`."""
    cli = [PY, "-m", "lopa_fast"]
    if name == "help":
        return {name: _timed([*cli, "--help"], env)}
    if name == "bad_flag":
        return {name: _timed([*cli, "generate", "--no-such-flag"], env)}
    if name == "cli_generate":
        return {name: _timed([*cli, "generate", "--prompt", PROMPT], env)}
    if name == "cli_stream":
        return {name: _first_stdout([*cli, "generate", "--stream", "--prompt", PROMPT], env)}
    if name == "api":
        return _json(API, env)
    if name == "serve_ready":
        return {name: _serve_ready(env)}
    if name == "lm_eval_first":
        return _json(LM_EVAL, env)
    if name == "demo":
        return {name: _timed([*cli, "demo"], env)}
    raise ValueError(f"measurement {name!r}; allowed: {', '.join(NAMES)}")


NAMES = ("help", "bad_flag", "cli_generate", "cli_stream", "api", "serve_ready", "lm_eval_first", "demo")


def _use(tree: Path | None) -> None:
    global PY, CWD
    PY, CWD = (sys.executable, None) if tree is None else (str(tree / ".venv" / "bin" / "python"), str(tree))


def run(names, reps: int, trees: dict[str, Path | None]) -> dict:
    """{metric: {"<tree> fresh": [s, ...], "<tree> warm": [s, ...]}} over `reps` runs per measurement, the trees
    and the two cache kinds alternating inside each repetition."""
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t, tree in trees.items():  # populate each tree's shared caches (not counted)
            _use(tree)
            for name in names:
                measure(name, _env(Path(tmp) / f"warm-{t}"))
        for name in names:
            for i in range(reps):
                for t, tree in trees.items():
                    _use(tree)
                    for kind in ("fresh", "warm"):
                        env = _env(Path(tmp) / (f"fresh-{t}-{name}-{i}" if kind == "fresh" else f"warm-{t}"))
                        for metric, s in measure(name, env).items():
                            out.setdefault(metric, {}).setdefault(f"{t} {kind}".strip(), []).append(s)
            print(name, {m: {k: [round(x, 2) for x in v] for k, v in d.items()} for m, d in out.items()},
                  file=sys.stderr, flush=True)
    _use(None)
    return out


def markdown(res: dict, command: str, loads: tuple) -> str:
    import platform

    import torch

    lines = ["# Start-up: what a user waits for (fresh processes, wall clock)", "",
             f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}; load average before / after: {loads[0]:.1f} / {loads[1]:.1f} (the 2 cores "
             "are shared with other work); embedded model, CPU, fp32. Median of the runs in seconds (min-max).", "",
             ]
    cols = list(next(iter(res.values())))
    lines += ["| measurement | " + " | ".join(f"{c} cache s" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for metric, d in res.items():
        cells = [f"{statistics.median(d[c]):.2f} ({min(d[c]):.2f}-{max(d[c]):.2f})" if c in d else "-" for c in cols]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default=",".join(NAMES), help=f"comma-separated: {', '.join(NAMES)}")
    ap.add_argument("--out", default=None, help="markdown file to write (default: print)")
    ap.add_argument("--tree", action="append", default=None, metavar="NAME=DIR",
                    help="a checkout with its own .venv to measure (repeatable; default: this process's python)")
    args = ap.parse_args(argv)
    trees: dict[str, Path | None] = {"": None}
    if args.tree:
        try:
            trees = {n: Path(d).resolve() for n, d in (t.split("=", 1) for t in args.tree)}
        except ValueError:
            ap.error(f"--tree {args.tree}: expected NAME=DIR")
        missing = [str(d) for d in trees.values() if not (d / ".venv" / "bin" / "python").is_file()]
        if missing:
            ap.error(f"--tree: no .venv/bin/python under {missing}")
    names = [n for n in args.only.split(",") if n]
    bad = [n for n in names if n not in NAMES]
    if bad or args.reps < 1:
        ap.error(f"--only {bad} / --reps {args.reps}; allowed: {', '.join(NAMES)} and reps >= 1")
    l0 = os.getloadavg()[0]
    res = run(names, args.reps, trees)
    text = markdown(res, "python bench/bench_startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    (l0, os.getloadavg()[0]))
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
