"""Branch parallelism (lopa_fast.distributed) on CPU with gloo: bytes moved per round, ours vs upstream's scheme for
the same rounds, and wall time per round against one process, side by side in one run.

For each world size W the script spawns W processes (one thread each) that start one gloo group and decode
the same requests: per config, rank 0 first decodes alone (the single-process fast backend; the other ranks
wait at a barrier), then every rank decodes it with distributed=True; REPS alternations, the median taken.
Tokens and forwards of both are asserted equal.

Bytes are logical payload traffic, all ranks together (lopa_fast.distributed.Comm: an all_gather of c bytes
per rank delivers W * (W - 1) * c bytes, a broadcast of b bytes (W - 1) * b). Ours: counted by wrapping the
collectives (the request's one fingerprint all_gather excluded). Upstream's scheme (lopa_dist_nv, see
docs/distributed.md) computed for the same rounds (the trace's window lengths and cached spans) at the same W
and the same slot split: the full logits of every rank's windows all-gathered (padded to the longest window)
plus, when a span is cached, 2 x layers broadcasts of the winner's [Hkv, u, D] K and V; its small messages
(lengths broadcast, token scatter, 3 count all_gathers) are included, its pickled objects (task payloads,
cache-update metadata) are not, so the upstream figure is a lower bound. Both at the model's dtype.

Run (the markdown goes to stdout):
    python bench/bench_branch_parallel.py > bench/results/branch_parallel.md
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

WORLDS = (2, 3)
KS = (2, 4, 8)
REPS = 3
PROMPT_LEN, MAX_NEW, BLOCK = 48, 64, 16
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2)
# Dream-7B / D2F-Dream in bf16 (the upstream setting) for the computed rows
DREAM7B = dict(V=152064, layers=28, Hkv=4, D=128, elem=2)


def build_model():
    from lopa_fast.testing import random_model, tiny_hf_config

    return random_model(tiny_hf_config("dream", **MODEL, max_position_embeddings=256), seed=0, sharpen=2)


def configs() -> list[dict]:
    return [dict(strategy="lopa", branching_factor=k, use_full_attention=full, block_size=BLOCK,
                 max_new_tokens=MAX_NEW, block_add_threshold=0.1, decoded_token_threshold=0.95, skip_threshold=0.9)
            for k in KS for full in (True, False)]


def upstream_bytes(trace: list, W: int, V: int, layers: int, Hkv: int, D: int, elem: int) -> tuple[float, float]:
    """(logits bytes, K/V bytes) of upstream's exchange for the traced rounds, all ranks together."""
    from lopa_fast.strategies.lopa.distributed import slot_share

    logits = kv = 0
    for e in trace:
        nA = len(e["branches"])
        n = max(b["window_len"] for b in e["branches"])
        per_rank = max(hi - lo for lo, hi in (slot_share(nA, W, r) for r in range(W)))
        # dispatch: lengths broadcast (W int64) + token scatter (n int64 per branch) ; gather: 3 int64 all_gathers
        logits += (W - 1) * 8 * W + (W - 1) * per_rank * n * 8 + 3 * W * (W - 1) * 8
        logits += W * (W - 1) * per_rank * n * V * elem  # the padded full logits of every window
        u = e["cached"]
        if u > 0:
            kv += (W - 1) * 2 * layers * Hkv * u * D * elem  # 2 x layers broadcasts of [1, Hkv, u, D]
    return logits, kv


def _worker(rank: int, W: int, init_file: str, out: str) -> None:
    import warnings

    import lopa_fast

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=120))
    warnings.simplefilter("ignore", RuntimeWarning)
    m = build_model()
    prompt = torch.randint(0, MODEL["vocab_size"] - 3, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    rows = []
    for cfg in configs():
        # the traced run (its window lengths and spans give upstream's bytes) doubles as the warm-up
        traced = lopa_fast.generate(m, prompt, backend="fast", distributed=True, return_trace=True, **cfg)
        one_t, dist_t = [], []
        for _ in range(REPS):
            dist.barrier()
            if rank == 0:
                one = lopa_fast.generate(m, prompt, backend="fast", **cfg)
                one_t.append(one.stats["seconds"] / one.stats["forwards"])
            dist.barrier()
            out_d = lopa_fast.generate(m, prompt, backend="fast", distributed=True, **cfg)
            dist_t.append(out_d.stats["seconds"] / out_d.stats["forwards"])
        if rank == 0:
            assert out_d.generated_ids == one.generated_ids and out_d.stats["forwards"] == one.stats["forwards"]
            d = out_d.stats["distributed"]
            c = m.config
            up_logits, up_kv = upstream_bytes(traced.trace, W, c.vocab_size, c.num_layers, c.num_kv_heads,
                                              c.head_dim, m.dtype.itemsize)
            up7_logits, up7_kv = upstream_bytes(traced.trace, W, **DREAM7B)
            rounds = one.stats["forwards"]
            rows.append(dict(cfg=cfg, rounds=rounds, tpf=one.stats["tpf"], one_s=statistics.median(one_t),
                             dist_s=statistics.median(dist_t), ours_stats=d["bytes"]["stats"] / rounds,
                             ours_kv=d["bytes"]["kv"] / rounds, up_logits=up_logits / rounds, up_kv=up_kv / rounds,
                             up7_logits=up7_logits / rounds, up7_kv=up7_kv / rounds,
                             kv_rounds=d["kv_broadcast_rounds"], collectives=d["collectives"]))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def run_world(W: int) -> list[dict]:
    tmp = tempfile.mkdtemp()
    ctx = mp.get_context("spawn")
    out = os.path.join(tmp, "rows.json")
    procs = [ctx.Process(target=_worker, args=(r, W, os.path.join(tmp, "pg"), out)) for r in range(W)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
        if p.is_alive():
            p.kill()
            raise SystemExit(f"world {W}: a rank hung")
    with open(out) as f:
        return json.load(f)


def _kb(x: float) -> str:
    return f"{x / 1024:.1f}"


def main() -> None:
    t0 = time.time()
    results = {W: run_world(W) for W in WORLDS}
    c = MODEL
    print("# Branch parallelism (torch.distributed, gloo on CPU): bytes per round and wall time per round\n")
    print(f"Command: `python bench/bench_branch_parallel.py > bench/results/branch_parallel.md` "
          f"({datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} CPU cores shared with other jobs, "
          f"one thread per process, total {time.time() - t0:.0f} s, load average at the end "
          f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} over 1 / 5 / 15 min).\n")
    print(f"Model: random Dream-shaped fp32, {c['num_layers']} layers, hidden {c['hidden_size']}, vocab "
          f"{c['vocab_size']}, {c['num_heads']}/{c['num_kv_heads']} heads; prompt {PROMPT_LEN}, max_new_tokens "
          f"{MAX_NEW}, block {BLOCK}, thresholds (0.1, 0.95, 0.9) (upstream's GSM8K setting); REPS {REPS}, medians. Tokens and forwards of every distributed run equal "
          "the single-process run (asserted).\n")
    print("KB per round = logical payload bytes delivered, all ranks together, averaged over the request's rounds. "
          "Ours: counted (statistics all_gather + span K/V broadcast). Upstream: its scheme computed for the same "
          "rounds at the same world size (full logits all_gather + 2 x layers K/V broadcasts + its small int "
          "messages; pickled objects not counted: a lower bound). Dream-7B columns: the same rounds' shapes with "
          "Dream-7B's V = 152064, 28 layers, 4 KV heads x 128, bf16 (computed, not run).\n")
    header = ["W", "k", "attention", "rounds", "TPF", "ours KB (stats + K/V)", "upstream KB (logits + K/V)", "ratio",
              "Dream-7B ours KB", "Dream-7B upstream KB", "collectives / round ours vs upstream", "ms/round 1 proc",
              "ms/round W procs", "speed-up"]
    table = []
    for W, rows in results.items():
        for r in rows:
            cfg = r["cfg"]
            ours = r["ours_stats"] + r["ours_kv"]
            up = r["up_logits"] + r["up_kv"]
            # Dream-7B: our statistics message does not grow with V; the K/V span scales with layers x Hkv x D
            kv_scale = (DREAM7B["layers"] * DREAM7B["Hkv"] * DREAM7B["D"] * DREAM7B["elem"]) / (
                c["num_layers"] * c["num_kv_heads"] * (c["hidden_size"] // c["num_heads"]) * 4)
            ours7 = r["ours_stats"] + r["ours_kv"] * kv_scale
            up7 = r["up7_logits"] + r["up7_kv"]
            kv_share = r["kv_rounds"] / r["rounds"]
            coll_ours = 1 + kv_share
            coll_up = 2 + 3 + 5 + kv_share * (2 + 2 * c["num_layers"])  # dispatch 3, gather 5, commit 1 + 2 x layers
            table.append([
                W, cfg["branching_factor"], "full" if cfg["use_full_attention"] else "block-causal", r["rounds"],
                f"{r['tpf']:.2f}", f"{_kb(ours)} ({_kb(r['ours_stats'])} + {_kb(r['ours_kv'])})",
                f"{_kb(up)} ({_kb(r['up_logits'])} + {_kb(r['up_kv'])})", f"{up / max(ours, 1):.0f}x", _kb(ours7),
                _kb(up7), f"{coll_ours:.2f} vs {coll_up:.1f}", f"{1000 * r['one_s']:.1f}", f"{1000 * r['dist_s']:.1f}",
                f"{r['one_s'] / r['dist_s']:.2f}x",
            ])
    print(tabulate(table, header, tablefmt="github", disable_numparse=True))
    print("\nUpstream's collective count per round: dispatch (lengths broadcast, token scatter, payload "
          "scatter_object_list), gather (2 count all_gathers, metadata all_gather_object, numel all_gather, logits "
          "all_gather), and on rounds with a cached span a second dispatch + 2 x layers K/V broadcasts (here "
          f"{c['num_layers']} layers; Dream-7B: 56). Ours: one all_gather, plus one broadcast on full-attention rounds "
          "with a cached span. Upstream also needs W >= k + 1 (it drops branches beyond the world size); "
          "ours runs any k on any W.")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
