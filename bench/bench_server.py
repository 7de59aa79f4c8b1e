"""The server's cost over in-process decoding, and what concurrent requests get from the one-at-a-time worker.

CPU, one torch thread, the embedded d2f-arith model with serve's defaults (the lopa-k4 row, 32 new tokens), N
held-out arith problems (`tasks.generate('test', N, seed=0)`). Three ways, in one run, alternating per round so a
burst of load on the shared CPU hits all alike:
  in-process   lopa_fast.generate, one prompt after another (the floor)
  http-seq     POST /v1/completions (openai client) one after another: + tokenising, validation, the worker
               thread, the decoding thread, JSON over HTTP
  http-conc    the N requests sent at once from N threads: today's worker runs them one at a time, so the wall
               time stays about N x one request; the batched scheduler (issue 15) is what changes this row
Every HTTP answer is checked equal to the in-process text. Reported: median latency per request, wall per round,
generated tokens per second (returned positions, the decoding's own count), TPF (the same for all three).

    python bench/bench_server.py --n 16 --rounds 3 > bench/results/server_cpu.md
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import torch
from tabulate import tabulate

import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.tasks import generate as task_problems
from lopa_fast.tasks.evaluate import GEN_LEN, ROWS
from lopa_fast.request.text import answer_text, text_decoder

KNOBS = dict(ROWS["lopa-k4"], max_new_tokens=GEN_LEN, temperature=0.0, backend="auto")  # serve's embedded defaults


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lopa_fast", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not start within 180 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = lopa_fast.load_model(model_dir(), dtype=torch.float32)
    tok = lopa_fast.load_tokenizer(model_dir())
    decode = text_decoder(tok)
    prompts = [p.prompt for p in task_problems("test", args.n, seed=0)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    lat = {"in-process": [], "http-seq": [], "http-conc": []}
    wall = {k: [] for k in lat}
    tokens = tpf = None
    try:
        def http(prompt):
            t0 = time.perf_counter()
            r = client.completions.create(model="d2f-arith", prompt=prompt)
            return r.choices[0].text, time.perf_counter() - t0, r.model_extra["stats"]

        client.completions.create(model="d2f-arith", prompt=prompts[0])  # warm-up (first-request imports)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            ref, n_tok, fw = [], 0, 0
            for p in prompts:
                t1 = time.perf_counter()
                out = lopa_fast.generate(model, tok(p)["input_ids"], **KNOBS)
                lat["in-process"].append(time.perf_counter() - t1)
                ref.append(answer_text(out, decode, model.eos_token_id))
                n_tok, fw = n_tok + out.stats["generated_tokens"], fw + out.stats["forwards"]
            wall["in-process"].append(time.perf_counter() - t0)
            tokens, tpf = n_tok, n_tok / fw
            t0 = time.perf_counter()
            seq = [http(p) for p in prompts]
            wall["http-seq"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                conc = list(pool.map(http, prompts))
            wall["http-conc"].append(time.perf_counter() - t0)
            for name, got in (("http-seq", seq), ("http-conc", conc)):
                assert [g[0] for g in got] == ref, f"{name}: a text differs from the in-process one"
                lat[name] += [g[1] for g in got]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    base = statistics.median(wall["in-process"])
    print("# Server vs in-process decoding (CPU, 1 thread, embedded d2f-arith, lopa-k4, 32 new tokens)\n")
    print(f"`python bench/bench_server.py --n {args.n} --rounds {args.rounds}` ({args.n} held-out arith prompts "
          f"per round, {args.rounds} rounds, the three ways alternating; every HTTP text equal to the in-process "
          f"one; TPF {tpf:.2f} for all three, {tokens} returned positions per round)\n")
    header = ["way", "median latency / request (ms)", "median wall / round (s)", "tokens/s", "wall vs in-process"]
    rows = []
    for name in lat:
        w = statistics.median(wall[name])
        rows.append([name, f"{1000 * statistics.median(lat[name]):.1f}", f"{w:.2f}", f"{tokens / w:.0f}",
                     f"{w / base:.2f}x"])
    print(tabulate(rows, header, tablefmt="github", disable_numparse=True))
    print("\nhttp-conc latency is a request's wait in the queue plus its own decoding (one request at a time today).")


if __name__ == "__main__":
    main()
