"""Real shapes on the CPU: one D2F / LoPA round at the width and vocabulary of the models users run, per stage,
for the fast path, the reference path and upstream's own loop, counted and projected to one H200 (issue 33).

Shapes: bench/shapes.py REAL_SHAPES (Dream-7B / D2F-Dream / DiffuCoder, LLaDA-8B, Qwen2.5-0.5B) at reduced depth
(`--layers`, default 1; random weights, fp32 unless `--dtype bf16`). Knobs (every path the same): prompt 64, block
32, 64 new tokens, tau_add 1.0 (a new block only once the last is decoded, so a branch's window stays 32 tokens:
T = 32 x branches query rows, bench/bench_round_gpu.py's shape), tau_act 0.95, tau_conf 0.9, neg_entropy,
branch_topp 1, alpha 0, full attention, T = 0. Each config runs `--rounds` steady rounds after the prefill round
(the cap ends the request; the prefill and the tail after the cap are not averaged).

Paths:
  fast       lopa_fast.generate(..., backend="fast"): all branches in one forward, one host read per round
  fastgpu    the same round with the GPU's layer kernels (LOPA_FAST_BACKEND=triton) and its fused LM head + statistics
             (LOPA_FAST_FUSED_HEAD=1, CUDA's default at T = 0): each Triton kernel is ONE
             custom op to the counter, so its launches and bytes are the GPU round's (the CUDA-graph capture replays
             exactly these kernels); on a CPU the kernel bodies run as their torch references
             (roundcount.kernel_bodies_in_torch; TRITON_INTERPRET=1, which this script sets, only makes triton
             importable). Its time is not a GPU time; the H200 projection of the fast path is taken from this row.
             (The statistics ride in the fused head: one op, its kernels, FLOPs and [R, V] buffer traffic counted by
             roundcount._head_confidence_cost.)
  fastcap    fastgpu with compile=True: the round captured as a CUDA graph (emulated: roundcount.captured_sequence),
             counted as the graph replays it (the device-start RoPE tables, the masked commit, the state written
             back into the workspace): what a GPU runs by default. The first compiled round also moves the
             request's state into its lane (~7 copies outside the graph, once a request; `lane_entry_launches` in
             the JSON): it is counted apart, and the steady rounds start after it (0 launches outside the graph)
  reference  lopa_fast.generate(..., backend="reference"): one forward per branch (the semantics oracle)
  upstream   zhijie-group/LoPA scale_dream_d2f.DreamLoRA's loop, imported from a checkout (`--upstream DIR`;
             fetched beside the repo, never copied into it) through tests/golden/make_lopa_golden.py's harness:
             upstream's bookkeeping, our network as its model (a dense-mask SDPA forward, full logits rows)

Per round and stage (bench/roundcount.py): CPU wall time, FLOPs, bytes, launches (aten ops), host syncs, the
transient memory peak; then the counts scaled to the real depth and projected to one H200 (eager and captured).

Run (the JSON feeds bench/results/projection.md; `--render` prints its tables from the JSON):
  nice -n 10 python bench/bench_real_shapes.py --shape dream7b --paths fast,reference,upstream --ks 1,2,4,8 \\
      --upstream /work/upstream/LoPA --out bench/results/real_shapes_dream7b.json
  python bench/bench_real_shapes.py --render bench/results/real_shapes_dream7b.json
pytest -m bench bench/bench_real_shapes.py runs the fast path's LoPA k=4 round at Dream-7B width (a few minutes).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

if shutil.which("nvidia-smi") is None:  # no GPU: the fastgpu path's Triton kernels run in the interpreter, which
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be on before triton is first imported (torch may import it)

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import roundcount as rc  # noqa: E402
from bench.shapes import REAL_SHAPES, kv_bytes_per_token, streamed_params  # noqa: E402

RUNS_ON_CPU = True  # bench/conftest.py: not skipped without CUDA

PROMPT, BLOCK, NEW = 64, 32, 64
KNOBS = dict(block_size=BLOCK, max_new_tokens=NEW, block_add_threshold=1.0, decoded_token_threshold=0.95,
             skip_threshold=0.9, sampling_strategy="neg_entropy", branch_topp=1.0, selection_conf_alpha=0.0,
             use_full_attention=True)
# tokens per forward for tokens/s: the paper's D2F-Dream LoPA GSM8K TPF (bench/results/projection.md), the goal's 10
TPF_PAPER = 10.1
TPF_GOAL = 10.0


def build(shape: dict, layers: int, dtype: torch.dtype, seed: int = 0):
    """A random model of `shape` at `layers` depth, weights drawn in place (no fp32 temporaries of the 2 GB
    embedding / head)."""
    from lopa_fast.models.config import parse_config
    from lopa_fast.models.loading import build_model
    from lopa_fast.testing import tiny_hf_config

    # Qwen2.5-0.5B (APD's causal verifier) has no mask token: its geometry is run as a Dream-kind (D2F) model, the
    # same layers, widths and tied head, so the per-round counts are its forward's at a D2F round's shapes
    kind = "dream" if shape["kind"] == "qwen2" else shape["kind"]
    cfg = parse_config(tiny_hf_config(**dict(shape, kind=kind, num_layers=layers)))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_model(cfg)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_f." in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval().requires_grad_(False)


def prompt_ids(model, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size - 512, (PROMPT,), generator=g)


def import_upstream(checkout: str):
    sys.path.insert(0, str(REPO / "tests" / "golden"))
    import transformers.modeling_utils  # noqa: F401  (before the harness stubs accelerate)
    import make_lopa_golden as golden

    return golden.import_upstream(checkout), golden


def run_config(model, path: str, k: int, rounds: int, upstream=None) -> dict:
    """One path at one k: the per-round records, summarised over the steady rounds."""
    import lopa_fast

    prompt = prompt_ids(model)
    up = None
    if path == "upstream":
        mod, golden = upstream
        up = rc.Upstream(mod, golden, k, 1 + rounds)
        knobs = dict(KNOBS, eos_token_id=model.config.eos_token_id)
        run = up.runner(model, prompt.tolist(), knobs)
    else:
        strategy = "lopa" if k > 1 else "d2f"
        kw = dict(KNOBS, max_rounds=1 + rounds + (path == "fastcap"))  # (fastcap: + the lane-entry round)
        if k > 1:
            kw["branching_factor"] = k
        backend = "fast" if path in ("fastgpu", "fastcap") else path
        if path == "fastcap":
            kw["compile"] = True
        seq = {"fastgpu": rc.gpu_sequence, "fastcap": lambda: rc.captured_sequence(model)}.get(path)

        def run():
            with warnings.catch_warnings(), (seq() if seq else contextlib.nullcontext()):
                warnings.simplefilter("ignore", RuntimeWarning)  # the round cap
                return lopa_fast.generate(model, prompt, strategy, backend, **kw)

    if path == "fastcap":  # every key captured first (uncounted): the counted request replays graphs only
        run()
    t0 = time.perf_counter()
    records = rc.count_rounds(model, run, upstream=up)
    wall = time.perf_counter() - t0
    # fastcap: the first compiled round also moves the request's state into its lane (compiled_batch._call: ~7
    # multi-tensor copies, once per request; measured 0 launches outside the graph on every later round), so it is
    # counted apart (`lane_entry_launches`) and the steady rounds start after it
    skip = 2 if path == "fastcap" else 1
    summ = rc.summarize(records, skip=skip)
    extra = {}
    if path == "fastcap":
        extra["lane_entry_launches"] = sum(rc.steady(records, 1)[0][s]["eager"] for s in rc.STAGES)
    return dict(path=path, k=k, summary=summ, wall_s=wall,
                per_round_t=[sum(r[s]["t"] for s in rc.STAGES) for r in rc.steady(records, skip)], **extra)


def project_config(row: dict, shape: dict, layers: int) -> dict:
    scaled = rc.scale_depth(row["summary"], layers, shape["num_layers"], row.get("summary_deeper"))
    p = rc.project(scaled)
    branches = row["k"] + 1 if row["k"] > 1 else 1
    T = branches * BLOCK
    streamed = streamed_params(shape) * 2
    fl = rc.floor_ms(T, PROMPT, streamed=streamed, kv_per_token=kv_bytes_per_token(shape))
    p.update(T=T, floor_ms=fl, frac_floor=tuple(c / fl for c in p["captured_ms"]),
             tok_s_paper=tuple(TPF_PAPER * 1e3 / c for c in p["captured_ms"]),
             tok_s_goal=tuple(TPF_GOAL * 1e3 / c for c in p["captured_ms"]),
             weight_passes=row["summary"]["calls"])
    # CPU time at the real depth: the layer stages' measured time x depth (counter overhead removed)
    cpu = {s: max(0.0, row["summary"][s]["t"] - row["summary"][s]["ovh"]) for s in rc.STAGES}
    f = shape["num_layers"] / layers
    cpu_real = {s: v * (f if s in rc.LAYER_STAGES else 1.0) for s, v in cpu.items()}
    p["cpu_s"], p["cpu_real_s"] = cpu, cpu_real
    return p


def machine() -> dict:
    load = os.getloadavg()
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    return dict(torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(),
                load_avg=[round(x, 2) for x in load], git=sha.strip(),
                uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="dream7b", choices=sorted(REAL_SHAPES))
    ap.add_argument("--paths", default="fast,fastgpu,fastcap,reference,upstream")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--configs", default=None, help="path:k,... in this order (instead of --paths x --ks)")
    ap.add_argument("--rounds", type=int, default=2, help="steady rounds measured after the prefill round")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--fit", action="store_true",
                    help="also count each config at --layers + 1 and project by the two-point fit (exact per-layer "
                         "counts; roundcount.scale_depth)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--upstream", default=None, help="a zhijie-group/LoPA checkout (for the upstream path)")
    ap.add_argument("--out", default=None, help="JSON to write (merged with an existing one: rows replaced by key)")
    ap.add_argument("--render", default=None, help="print the markdown tables of this JSON and exit")
    a = ap.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return 0
    torch.set_num_threads(a.threads)
    shape = REAL_SHAPES[a.shape]
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    if a.configs:
        configs = [(c.split(":")[0], int(c.split(":")[1])) for c in a.configs.split(",") if c]
    else:
        configs = [(p, int(k)) for p in a.paths.split(",") if p for k in a.ks.split(",")]
    paths = {p for p, _ in configs}
    upstream = import_upstream(a.upstream) if "upstream" in paths else None
    if "upstream" in paths and shape["kind"] != "dream":
        raise SystemExit("upstream's loop is Dream's (a logits shift, DreamLoRA): --shape dream7b only")
    out = Path(a.out) if a.out else None
    doc = json.loads(out.read_text()) if out and out.exists() else {"rows": []}
    doc.update(shape_name=a.shape, shape=shape, kv_bytes_per_token=kv_bytes_per_token(shape), layers=a.layers,
               dtype=a.dtype, knobs=dict(KNOBS, prompt=PROMPT),
               rounds=a.rounds)
    doc.setdefault("machine", []).append(machine())
    t0 = time.perf_counter()
    model = build(shape, a.layers, dtype)
    deeper = build(shape, a.layers + 1, dtype) if a.fit else None
    print(f"built {a.shape} x{a.layers} layer(s) {a.dtype} in {time.perf_counter() - t0:.1f} s", flush=True)
    for path, k in configs:
        if True:
            row = run_config(model, path, k, a.rounds, upstream)
            if deeper is not None:
                row["summary_deeper"] = run_config(deeper, path, k, a.rounds, upstream)["summary"]
            row["projection"] = project_config(row, shape, a.layers)
            row["machine"] = machine()
            doc["rows"] = [r for r in doc["rows"] if (r["path"], r["k"]) != (path, k)] + [row]
            p = row["projection"]
            print(f"{path:>9} k={k}: CPU {sum(row['per_round_t']) / len(row['per_round_t']):.2f} s/round "
                  f"(calls {row['summary']['calls']:.0f}, launches {p['launches']:.0f}, syncs {p['syncs']:.1f}); "
                  f"H200 captured {p['captured_ms'][0]:.2f}-{p['captured_ms'][1]:.2f} ms "
                  f"({p['frac_floor'][0]:.2f}x floor {p['floor_ms']:.2f}), eager {p['eager_ms'][0]:.1f}-"
                  f"{p['eager_ms'][1]:.1f} ms; load {row['machine']['load_avg']}", flush=True)
            if out:
                out.write_text(json.dumps(doc, indent=1))
            gc.collect()
    del model, deeper
    gc.collect()
    return 0


PATHS = ["fast", "fastgpu", "fastcap", "reference", "upstream"]


# ---- markdown -----------------------------------------------------------------------------------------------------
def _ms(x):
    return f"{x * 1e3:.0f}" if x >= 0.0095 else f"{x * 1e3:.1f}"


def render(doc: dict) -> str:
    """The per-stage CPU table, the counts and the projection of one JSON (bench/results/projection.md)."""
    shape = doc["shape"]
    L = shape["num_layers"]
    rows = sorted(doc["rows"], key=lambda r: (PATHS.index(r["path"]), r["k"]))
    name = lambda r: f"{r['path']} {'d2f' if r['k'] == 1 else 'k=' + str(r['k'])}"  # noqa: E731
    out = [f"### {doc['shape_name']}: CPU per round at {doc['layers']} layer(s), {doc['dtype']} (ms; mean of "
           f"{doc['rounds']} steady rounds; counter overhead removed)", "",
           "| path | " + " | ".join(rc.STAGES) + " | round | non-model share | transient peak MB |",
           "|---|" + "---:|" * (len(rc.STAGES) + 3)]
    for r in rows:
        cpu = r["projection"]["cpu_s"]
        tot = sum(cpu.values())
        nm = sum(cpu[s] for s in ("stats", "select", "host")) / tot
        peak = max(r["summary"][s]["peak"] for s in rc.STAGES) / 2**20
        out.append(f"| {name(r)} | " + " | ".join(_ms(cpu[s]) for s in rc.STAGES) +
                   f" | {_ms(tot)} | {nm:.1%} | {peak:.0f} |")
    out += ["", f"### {doc['shape_name']}: the same rounds at the real depth ({L} layers: layer stages x {L}), "
            "CPU ms", "", "| path | model stages | stats | select | host | round | non-model share |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["projection"]["cpu_real_s"]
        model = sum(c[s] for s in rc.MODEL_STAGES)
        tot = sum(c.values())
        out.append(f"| {name(r)} | {_ms(model)} | {_ms(c['stats'])} | {_ms(c['select'])} | {_ms(c['host'])} | "
                   f"{_ms(tot)} | {(tot - model) / tot:.2%} |")
    out += ["", f"### {doc['shape_name']}: counted per round at {L} layers, projected to one H200 (bf16)", "",
            "| path | model calls (weight passes) | GFLOP | GB moved (bf16) | launches | host syncs | roofline ms | "
            "eager ms | captured ms | floor ms (T) | captured / floor | tok/s @ TPF 10.1 | tok/s @ TPF 10 |",
            "|---|" + "---:|" * 12]
    for r in rows:
        p = r["projection"]
        out.append(
            f"| {name(r)} | {p['weight_passes']:.0f} | {p['flops'] / 1e9:.0f} | {p['bytes_bf16'] / 1e9:.2f} | "
            f"{p['launches']:.0f} | {p['syncs']:.1f} | {p['roofline_ms']:.2f} | {p['eager_ms'][0]:.1f}-"
            f"{p['eager_ms'][1]:.1f} | {p['captured_ms'][0]:.2f}-{p['captured_ms'][1]:.2f} | "
            f"{p['floor_ms']:.2f} ({p['T']}) | {p['frac_floor'][0]:.2f}-{p['frac_floor'][1]:.2f} | "
            f"{p['tok_s_paper'][1]:.0f}-{p['tok_s_paper'][0]:.0f} | "
            f"{p['tok_s_goal'][1]:.0f}-{p['tok_s_goal'][0]:.0f} |")
    out += ["", f"### {doc['shape_name']}: projected H200 roofline ms per stage at {L} layers", "",
            "| path | " + " | ".join(rc.STAGES) + " |", "|---|" + "---:|" * len(rc.STAGES)]
    for r in rows:
        sr = r["projection"]["stage_roof_ms"]
        out.append(f"| {name(r)} | " + " | ".join(f"{sr[s]:.3f}" for s in rc.STAGES) + " |")
    loads = sorted({str(m["load_avg"]) for m in doc.get("machine", [])})
    out += ["", f"Load averages seen while measuring: {', '.join(loads)} ({doc['machine'][0]['cpus']} CPUs, "
            f"{doc['machine'][0]['threads']} torch threads, torch {doc['machine'][0]['torch']})."]
    return "\n".join(out)


@pytest.mark.bench
def test_real_shape_fast_lopa_k4():
    """The fast path's LoPA k=4 round at Dream-7B width (1 layer): one host read per round, one model call."""
    doc_path = Path(os.environ.get("OUT", "/tmp")) / "real_shapes_bench.json"
    assert main(["--shape", "dream7b", "--paths", "fast", "--ks", "4", "--rounds", "1", "--out", str(doc_path)]) == 0
    row = json.loads(doc_path.read_text())["rows"][-1]
    assert row["projection"]["syncs"] == 1 and row["summary"]["calls"] == 1


if __name__ == "__main__":
    raise SystemExit(main())
