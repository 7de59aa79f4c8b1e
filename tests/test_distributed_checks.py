"""Issue 28, finding 7: distributed ranks check what they decode with, and every error path reaches the collective
protocol. In one gloo group of 2 (spawned, bounded by JOIN_TIMEOUT_S): (1) the last rank's weights differ in one
element: both ranks refuse at setup (before: a silently wrong answer); (2) its dtype differs: both refuse (before:
a gloo size mismatch, SIGABRT); (3) its progress hook raises in round 2: it gets its own exception, its peer a
DistributedError naming it, in the same round, and (4) the next request decodes on both (before: the retry's setup
message met the peer's round message: SIGABRT). Issue 36: (1b) a LoRA-like change to the q / v / o projections of
the last rank is refused too (the fingerprint covers every weight; before it sampled three parameters' ends)."""
from __future__ import annotations

import datetime
import json
import os
import warnings

import torch
import torch.distributed as dist

import lopa_fast
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import run_ranks

JOIN_TIMEOUT_S = 600  # a hang guard only: a busy 2-core machine starts a spawned rank in 5-30 s
CASE = dict(strategy="lopa", branching_factor=4, block_size=4, max_new_tokens=32, use_full_attention=True)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    prompt = torch.randint(0, 61, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    last = rank == world - 1
    res = []

    def run(m, on_round=None):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out = lopa_fast.generate(m, prompt, backend="fast", distributed=True, on_round=on_round, **CASE)
            res.append({"ids": out.generated_ids})
        except Exception as e:  # noqa: BLE001 - reported to the parent
            res.append({"error": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)})
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)

    other = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    if last:
        with torch.no_grad():
            next(other.parameters()).view(-1)[0] += 1.0
    run(other)  # (1) one element of the last rank's weights differs
    lora = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)
    if last:  # (1b) a rank-2 update of every q / v / o projection (none of the parameters sampled before issue 36)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if name.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight")):
                    p += 0.05 * torch.randn(p.shape[0], 2, generator=g) @ torch.randn(2, p.shape[1], generator=g)
    run(lora)
    run(model.to(torch.float64) if last else model)  # (2) its dtype differs
    model = model.to(torch.float32)

    def hook(prefix, info):
        if last and info["round"] == 2:
            raise RuntimeError("hook fault")

    run(model, hook)  # (3)
    run(model)  # (4) the retry
    dist.destroy_process_group()


def test_ranks_refuse_other_weights_or_dtype_and_a_hook_error_ends_both(tmp_path):
    procs = run_ranks(_worker, [(r, 2, str(tmp_path / "pg"), str(tmp_path)) for r in range(2)], JOIN_TIMEOUT_S)
    assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]  # no SIGABRT
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for res in (r0, r1):
        for i in (0, 1, 2):
            assert res[i].get("error") == "DistributedError" and "different requests" in res[i]["message"], res[i]
    assert r1[3] == {"error": "RuntimeError", "message": "hook fault", "rank": None}
    assert r0[3]["error"] == "DistributedError" and r0[3]["rank"] == 1 and "hook fault" in r0[3]["message"]
    assert "ids" in r0[4] and r0[4] == r1[4]
