"""The APD step's GPU kernel launches, counted on the CPU, with and without the fused LM head.

What a GPU runs for one APD step (the drafter's forward, the draft, the verifier's forward, the acceptance, the
commit) is counted by bench/roundcount.py's `gpu_sequence` (the Triton backend, each kernel ONE custom op, its body
computed by the torch reference) under its dispatch counter, on the embedded `d2f-arith` drafter and the shipped
`ar-arith` verifier at the eval's APD rows (lopa_fast.tasks.evaluate.apd_rows) and the leftright baseline, over
PROBLEMS held-out problems. Two columns: LOPA_FAST_FUSED_HEAD=0 (the head as F.linear, then the draft's arg-max,
the suppression's fill and each model's finiteness pass over [rows, V]) and =1 (both forwards end in
`ops.head_confidence`: strategies/apd/step.py). Tokens are asserted equal between the two. Launch counts, not
seconds: no GPU measured these (bench/gpu_check.sh runs on a device).

Run (results: bench/results/apd_launches.md):
    python bench/apd_step_launches.py > bench/results/apd_launches.md
"""
from __future__ import annotations

import os
import sys
import warnings
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend resolves on CPU (kernel bodies run in torch)

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import lopa_fast  # noqa: E402
import roundcount as rc  # noqa: E402
from lopa_fast import tasks  # noqa: E402
from lopa_fast.tasks import evaluate  # noqa: E402

PROBLEMS = 8
ROWS = {**evaluate.apd_rows(evaluate.GEN_LEN),
        "leftright-k1": dict(strategy="apd", apd_mixture_weight=None, kv_window=2, max_lookahead=13)}


def count(model, verifier, prompts, knobs: dict, fused: str) -> tuple[int, int, list]:
    """(launches, steps, tokens) of the rows' requests with LOPA_FAST_FUSED_HEAD=fused (one warm pass first)."""
    extra = {"verifier": verifier} if knobs["apd_mixture_weight"] is not None else {}
    kw = dict(backend="fast", max_new_tokens=evaluate.GEN_LEN, temperature=0.0, **knobs, **extra)
    with rc.gpu_sequence(), mock.patch.dict(os.environ, {"LOPA_FAST_FUSED_HEAD": fused}):
        lopa_fast.generate(model, prompts[0], **kw)  # warm: first-use setup is not a step's
        rounds = rc.Rounds(model.config.num_layers)
        with torch.inference_mode(), rc.OpCounter(rounds):
            outs = [lopa_fast.generate(model, p, **kw) for p in prompts]
    return _launches(rounds), sum(o.stats["forwards"] for o in outs), [o.generated_ids for o in outs]


STAGES = ("draft_inputs", "drafted", "verify_inputs", "verified", "commit")  # strategies/apd/step.py's functions


def stage_launches(model, verifier, prompts, knobs: dict) -> tuple[dict, int]:
    """({stage: launches}, steps) with the fused head: the launches of each of step.py's functions (STAGES; the rest,
    the two forwards and the driver, under "forwards / driver"), counted by the same counter."""
    from lopa_fast.strategies.apd import driver, step

    rounds = rc.Rounds(model.config.num_layers)
    per = dict.fromkeys(("forwards / driver",) + STAGES, 0)
    where = ["forwards / driver"]
    real = {name: getattr(step, name) for name in STAGES}

    def timed(name):
        def run(*a, **k):
            before, prev = _launches(rounds), where[0]
            where[0] = name
            try:
                return real[name](*a, **k)
            finally:
                per[name] += _launches(rounds) - before
                where[0] = prev
        return run

    extra = {"verifier": verifier} if knobs["apd_mixture_weight"] is not None else {}
    kw = dict(backend="fast", max_new_tokens=evaluate.GEN_LEN, temperature=0.0, **knobs, **extra)
    with rc.gpu_sequence(), mock.patch.dict(os.environ, {"LOPA_FAST_FUSED_HEAD": "1"}), \
            mock.patch.multiple(driver, **{name: timed(name) for name in STAGES}):
        lopa_fast.generate(model, prompts[0], **kw)
        with torch.inference_mode(), rc.OpCounter(rounds):
            start = _launches(rounds)
            outs = [lopa_fast.generate(model, p, **kw) for p in prompts]
            total = _launches(rounds) - start
    per = {k: v for k, v in per.items() if k != "forwards / driver"}
    per["forwards / driver"] = total - sum(per.values())
    return per, sum(o.stats["forwards"] for o in outs)


def _launches(rounds) -> float:
    return sum(st["launches"] for rec in rounds.records for name, st in rec.items() if name != "meta")


def main() -> None:
    warnings.simplefilter("ignore")
    model, tok, _ = evaluate.load_default()
    verifier = evaluate.load_verifier()
    prompts = [torch.tensor(evaluate.prompt_ids(tok, p), dtype=torch.long)
               for p in tasks.generate("test", PROBLEMS, seed=0)]
    rows = []
    for name, knobs in ROWS.items():
        (n0, s0, t0), (n1, s1, t1) = (count(model, verifier, prompts, knobs, f) for f in ("0", "1"))
        assert t0 == t1 and s0 == s1, f"{name}: the fused head changed the tokens"
        rows.append([name, s0, f"{n0 / s0:.1f}", f"{n1 / s1:.1f}", f"{(n0 - n1) / s0:.1f}"])
    print("# The APD step's GPU kernel launches, with and without the fused LM head (counted on the CPU)\n")
    print(f"Embedded d2f-arith drafter ({model.config.num_layers} layers) + ar-arith verifier "
          f"({verifier.config.num_layers} layers), {PROBLEMS} held-out problems, {evaluate.GEN_LEN} new tokens, "
          "T = 0; `bench/roundcount.gpu_sequence` (each Triton kernel one launch). Tokens equal in both columns.\n")
    print(tabulate(rows, headers=["row", "steps", "launches / step (unfused head)", "fused head", "fewer"],
                   tablefmt="github"))
    print("\nWhere a step's launches are, with the fused head (step.py's functions; the rest: the two forwards and the "
          "driver):\n")
    srows = []
    for name in ("apd-r0.7", "leftright-k1"):
        per, steps = stage_launches(model, verifier, prompts, ROWS[name])
        srows.append([name] + [f"{per[k] / steps:.1f}" for k in ("forwards / driver",) + STAGES])
    print(tabulate(srows, headers=["row", "forwards / driver", *STAGES], tablefmt="github"))
    print("\nCommand: `python bench/apd_step_launches.py > bench/results/apd_launches.md`")


if __name__ == "__main__":
    main()
