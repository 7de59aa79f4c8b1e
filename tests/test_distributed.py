"""Branch parallelism (lopa_fast.distributed) on CPU with gloo: processes spawned here with torch.multiprocessing,
one process group per world size, every config of the grid decoded inside it.

Parity: world sizes 2 and 3 x {full, block-causal} x k in {1, 2, 4, 5} (k + 1 = 2, 3, 5, 6 slots: not always
a multiple of the world size; k = 1 and round 1 leave ranks without a slot), at temperature 0 and (sampler
'keyed') at TEMPERATURE: tokens, forwards, the coverage counters and the trace's per-round winners and
accepted tokens equal to the single-process fast backend, on every rank. compile=True: COMPILE_CASE (T > 0,
Dream's shift, full attention, a span won by the second rank's slot) at world size 2 in the default run, a
grid of both modes, k and temperatures at world sizes 2 and 3 under -m slow (Inductor compiles in every
spawned rank: minutes). Faults: a rank that raises
mid-round ends every rank with DistributedError naming it; a rank that dies ends its peer with
DistributedError; ranks given different requests refuse; all within a bounded time (a stalled rank: its peer
at the group's timeout, under -m slow). Each spawned group is bounded by JOIN_TIMEOUT_S.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import lopa_fast
from lopa_fast.strategies.lopa.distributed import slot_owner, slot_share
from lopa_fast.errors import DistributedError, KnobError
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import run_ranks

KS = (1, 2, 4, 5)
COUNTERS = ("accepted_by_threshold", "fallback_fills", "eos_fills", "multi_token_rounds", "lookahead_wins",
            "branch_growth", "winner_grew", "hit_round_cap", "eos_detected")
# the process group's collective timeout in the spawned workers (bounds a dead peer's wait); it also bounds the first
# collective, which waits for the slowest rank's start-up: 20 s failed with a second test suite beside this one
PG_TIMEOUT_S = 120
STALL_S = 40  # how long the "stall" fault sleeps: far longer than the 5 s group timeout of its test
JOIN_TIMEOUT_S = 600  # a whole spawned group, a hang guard only (start-up 5-30 s per process on a busy 2-core machine)
# a group whose ranks compile (compile=True): two Inductor graphs per bucket per rank, the ranks compiling at
# once; cold (empty Inductor cache) on the loaded 2-core machine ~370 s for COMPILE_CASE, warm ~60 s
COMPILE_JOIN_TIMEOUT_S = 900
COMPILE_GRID_JOIN_TIMEOUT_S = 2400  # -m slow: compile_grid at world size 2 took 885 s cold
TEMPERATURE = 0.8


def build_models() -> dict:
    """A Dream-family model (logit shift, GQA) and a LLaDA one (no shift), seeded: the same in every process."""
    return {
        "dream": random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6),
        "llada": random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=6),
    }


def grid() -> list[dict]:
    """16 cases: k x attention mode, the model, block size, thresholds, prompt length and EOS varying with them."""
    cases = []
    ths = ((0.1, 0.95, 0.9), (0.5, 0.8, 0.7), (0.3, 0.5, 0.95), (0.0, 0.0, 0.99))
    for i, (k, full) in enumerate((k, full) for k in KS for full in (True, False)):
        th = ths[i % len(ths)]
        bs = (4, 8)[i % 2]
        cases.append(dict(
            model=("dream", "llada")[(k + full) % 2], prompt_len=3 + 5 * i, prompt_seed=i, eos=i % 3 == 0,
            strategy="d2f" if (k == 1 and full) else "lopa", branching_factor=k, use_full_attention=full,
            block_size=bs, max_new_tokens=bs * (2 + i % 3), block_add_threshold=th[0],
            decoded_token_threshold=th[1], skip_threshold=th[2],
            sampling_strategy=("default", "margin", "neg_entropy")[i % 3],
        ))
    return cases


def hot_grid() -> list[dict]:
    """The grid at TEMPERATURE (sampler 'keyed', the default; a seed per case)."""
    return [dict(c, temperature=TEMPERATURE, seed=10 + i) for i, c in enumerate(grid())]


# compile=True in the default run: one geometry and two buckets (block 4, two blocks), T > 0 with the keyed
# sampler, Dream's shift, full attention; at world size 2 its round 3 caches a span won by slot 2 (rank 1's):
# the K/V broadcast and the last_logit row moving to rank 1 run compiled
COMPILE_CASE = dict(model="dream", prompt_len=9, prompt_seed=2, eos=False, strategy="lopa", branching_factor=2,
                    use_full_attention=True, block_size=4, max_new_tokens=8, skip_threshold=0.9,
                    block_add_threshold=0.1, decoded_token_threshold=0.9, sampling_strategy="neg_entropy",
                    temperature=TEMPERATURE, seed=1)


def compile_grid() -> list[dict]:
    """-m slow: both modes, k in {1, 2, 4}, T = 0 and TEMPERATURE, on grid geometries (several buckets each)."""
    g = grid()
    return [dict(g[0], temperature=0.0), dict(g[3], temperature=TEMPERATURE, seed=3), dict(g[4], temperature=0.0),
            dict(g[5], temperature=TEMPERATURE, seed=5), dict(COMPILE_CASE, temperature=0.0)]


def _frequent_token(model) -> int:
    g = torch.Generator().manual_seed(0)
    pred = model(torch.randint(0, 61, (4, 48), generator=g)).argmax(-1).flatten()
    pred = pred[pred != model.mask_token_id]
    return int(torch.bincount(pred, minlength=model.config.vocab_size).argmax())


def run_case(models: dict, case: dict, **extra):
    """generate() on one case (the fast backend; distributed=True etc. via extra)."""
    case = dict(case)
    m = models[case.pop("model")]
    g = torch.Generator().manual_seed(case.pop("prompt_seed"))
    prompt = torch.randint(0, 61, (case.pop("prompt_len"),), generator=g).tolist()  # ids go to the model's device
    if case.pop("eos"):
        case["eos_token_id"] = _frequent_token(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return lopa_fast.generate(m, prompt, backend="fast", return_trace=True, **case, **extra)


def summary(out) -> dict:
    """Tokens, forwards, counters and, per round, the trace's window start, cached span, winner and accepted
    (position, token) pairs (scores are floats: equal in practice, compared through the winners)."""
    rounds = [[e["window_start"], e["cached"], e["winner"], e["accepted"]] for e in out.trace]
    return {"ids": out.generated_ids, "forwards": out.stats["forwards"], "rounds": rounds,
            **{k: out.stats.get(k) for k in COUNTERS}}


def _worker(rank: int, world: int, init_file: str, out_dir: str, cases: list, backend: str = "gloo",
            pg_timeout: float = PG_TIMEOUT_S) -> None:
    """One rank: start the group, decode every case with distributed=True, write rank<r>.json: per case its
    summary or its error (the loop goes on after an error). A case's "fault" acts on the last rank: "mismatch"
    (a different prompt), "raise" / "die" / "stall" (its 2nd forward raises, exits the process, or sleeps
    STALL_S and then raises). backend "nccl": the models on cuda:rank, and each case also decoded by this
    process alone ("local")."""
    torch.set_num_threads(1)
    t0 = time.monotonic()
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    models = build_models()
    if backend == "nccl":
        models = {k: m.cuda() for k, m in models.items()}
    cls = type(models["dream"])
    fwd = cls.forward_static
    res: dict = {"rank": rank, "cases": []}
    for case in cases:
        case = dict(case)
        fault = case.pop("fault", None)
        if rank != world - 1:
            fault = None
        if fault == "mismatch":
            case["prompt_seed"] += 1000
        if fault in ("raise", "die", "stall"):  # the 2nd forward of this rank (round >= 3: no slot in round 1)
            calls = [0]

            def broken(self, *a, _calls=calls, _fault=fault, **k):
                _calls[0] += 1
                if _calls[0] == 2:
                    if _fault == "die":
                        os._exit(3)
                    if _fault == "stall":
                        time.sleep(STALL_S)
                    raise RuntimeError("injected fault")
                return fwd(self, *a, **k)

            cls.forward_static = broken
        tc = time.monotonic()
        try:
            hook = []  # the progress hook runs on every rank, once per round
            out = run_case(models, case, distributed=True, on_round=lambda prefix, info: hook.append(info["round"]))
            res["cases"].append({**summary(out), "dist": out.stats["distributed"], "hook": hook,
                                 "compiled": out.stats.get("compiled_buckets"),
                                 "graphs": out.stats.get("compiled_graphs")})
            if backend == "nccl":
                res["cases"][-1]["local"] = summary(run_case(models, case))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts on it
            res["cases"].append({"error": {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None),
                                           "seconds": time.monotonic() - t0,
                                           "case_seconds": time.monotonic() - tc}})
        finally:
            cls.forward_static = fwd
        res["seconds"] = time.monotonic() - t0
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # after every case: a rank that dies
            json.dump(res, f)  # leaves the cases it finished
    if not any("error" in c for c in res["cases"]):
        dist.destroy_process_group()


def spawn_group(world: int, tmp_path, cases: list, backend: str = "gloo", pg_timeout: float = PG_TIMEOUT_S,
                join_timeout: float = JOIN_TIMEOUT_S) -> list:
    """Run _worker on `world` spawned processes; every process must end within join_timeout seconds (else it is
    killed and the test fails). Returns each rank's json (None for a rank that wrote none)."""
    init_file = str(tmp_path / f"pg{world}")
    run_ranks(_worker, [(r, world, init_file, str(tmp_path), cases, backend, pg_timeout) for r in range(world)],
              join_timeout)
    out = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else None)
        if path.exists():
            path.unlink()
    return out


@pytest.fixture(scope="module")
def expected():
    """The single-process fast backend's results on the grid, at T = 0 and at TEMPERATURE."""
    models = build_models()
    return [summary(run_case(models, c)) for c in grid() + hot_grid()]


def _assert_parity(ranks: list, cases: list, expected: list, world: int) -> None:
    """Every rank's summary of every case equals the single-process one; the hook ran once per round."""
    for r, res in enumerate(ranks):
        assert res is not None, f"rank {r} wrote nothing"
        assert len(res["cases"]) == len(expected)
        for case, got, want in zip(cases, res["cases"], expected):
            assert "error" not in got, f"rank {r} world {world} case {case}: {got['error']}"
            dist_stats = got["dist"]
            mine = {k: v for k, v in got.items() if k not in ("dist", "hook", "compiled", "graphs")}
            assert mine == want, f"rank {r} world {world} case {case}"
            assert got["hook"] == list(range(1, want["forwards"] + 1))
            assert dist_stats["world_size"] == world and dist_stats["rank"] == r


@pytest.mark.parametrize("world", (2, 3))
def test_parity_with_one_process(world, tmp_path, expected):
    ranks = spawn_group(world, tmp_path, grid() + hot_grid())
    _assert_parity(ranks, grid() + hot_grid(), expected, world)
    # the temperature has teeth: the hot grid's tokens differ from the cold grid's somewhere
    n = len(grid())
    assert any(a["ids"] != b["ids"] for a, b in zip(expected[:n], expected[n:]))
    cases0 = ranks[0]["cases"][:n]
    # the paths the grid must exercise: lookahead wins, span K/V broadcasts (full attention), ranks without a
    # slot (k = 1 or round 1 with world > 1), the statistics all_gather once per round
    assert sum(c["lookahead_wins"] or 0 for c in expected) > 0
    full_kv = [c["dist"]["kv_broadcast_rounds"] for c, g in zip(cases0, grid()) if g["use_full_attention"]]
    causal_kv = [c["dist"]["kv_broadcast_rounds"] for c, g in zip(cases0, grid()) if not g["use_full_attention"]]
    assert sum(full_kv) > 0 and sum(causal_kv) == 0
    for c in cases0:
        d = c["dist"]
        assert d["collectives"]["all_gather"] == c["forwards"] + 1  # one per round + the request fingerprint
        assert d["collectives"]["broadcast"] == d["kv_broadcast_rounds"]
        assert d["bytes"]["stats"] > 0


def test_parity_with_one_process_on_the_fused_head(tmp_path, monkeypatch):
    """LOPA_FAST_FUSED_HEAD=1 (what CUDA runs by default): each rank's message carries `ops.head_confidence`'s
    statistics of its hidden rows (no fp32 [rows, V] logits), the winner's owner takes the next last_logit row from
    the logits its fused head kept; every rank equals the single-process fused round on the T = 0 grid (world 2)."""
    monkeypatch.setenv("LOPA_FAST_FUSED_HEAD", "1")  # (the spawned ranks inherit it)
    models = build_models()
    want = [summary(run_case(models, c)) for c in grid()]
    ranks = spawn_group(2, tmp_path, grid())
    _assert_parity(ranks, grid(), want, 2)
    assert all(c["dist"]["fused_head"] for res in ranks for c in res["cases"])


def _compiled_parity(world: int, tmp_path, cases: list, join_timeout: float = COMPILE_JOIN_TIMEOUT_S) -> list:
    """compile=True on every rank of a group of `world`: equal to the single-process eager fast backend (the
    compiled single-process round is token-exact with it: tests/test_compiled_round.py); the rounds after the
    prefill ran compiled (two graphs per bucket: the rank's share, the part after the exchange)."""
    models = build_models()
    want = [summary(run_case(models, c)) for c in cases]
    ranks = spawn_group(world, tmp_path, [dict(c, compile=True) for c in cases], join_timeout=join_timeout)
    _assert_parity(ranks, cases, want, world)
    for res in ranks:
        for got in res["cases"]:
            assert got["forwards"] >= 2 and got["compiled"], got  # decode rounds ran through the compiled parts
    return ranks


@pytest.mark.slow  # two ranks compiling with Inductor at once: 50 s warm, ~385 s cold on the 2-core CI machine
def test_compiled_parity_with_one_process(tmp_path):
    """COMPILE_CASE at world size 2 (one geometry, two buckets)."""
    ranks = _compiled_parity(2, tmp_path, [COMPILE_CASE])
    for res in ranks:  # two graphs per bucket (the share, the part after the exchange), no recompile
        got = res["cases"][0]
        assert len(got["compiled"]) == 2 and got["graphs"] == 2 * len(got["compiled"]), got
    case = {k: v for k, v in COMPILE_CASE.items()}
    assert summary(run_case(build_models(), case))["rounds"][2][2] == 2  # round 3's winner: slot 2 (rank 1)


@pytest.mark.slow
def test_compiled_parity_on_the_fused_head(tmp_path, monkeypatch):
    """compile=True with LOPA_FAST_FUSED_HEAD=1 at world 2 on the T = 0 cases of the compiled grid: each rank's
    compiled share returns the logits its fused head kept (the winner's owner's next last_logit row), equal to the
    single-process fused round."""
    monkeypatch.setenv("LOPA_FAST_FUSED_HEAD", "1")
    cases = [c for c in compile_grid() if c["temperature"] == 0.0]
    ranks = _compiled_parity(2, tmp_path, cases, COMPILE_GRID_JOIN_TIMEOUT_S)
    assert all(c["dist"]["fused_head"] for res in ranks for c in res["cases"])


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 3))
def test_compiled_parity_grid(world, tmp_path):
    _compiled_parity(world, tmp_path, compile_grid(), COMPILE_GRID_JOIN_TIMEOUT_S)


def _error(res: dict | None, i: int = -1) -> dict:
    assert res is not None, "the rank wrote nothing"
    err = res["cases"][i].get("error")
    assert err is not None and err["type"] == "DistributedError", res["cases"][i]
    return err


def test_faults_end_every_rank(tmp_path):
    """In one group of 2: (1) the ranks are given different prompts: both refuse at once, naming it; (2) the last
    rank raises in its 2nd forward: both ranks end with DistributedError naming rank 1 and the message, at once
    (the round's error flag), and the group stays usable; (4) seed=None at T > 0: the ranks agree on one seed;
    (5) the last rank dies (os._exit) mid-round: its peer ends with DistributedError (gloo: connection reset),
    well within the group's timeout."""
    case = dict(grid()[6], model="dream", block_size=4, max_new_tokens=32)  # k = 4, full attention: many rounds
    seedless = dict(case, temperature=TEMPERATURE, seed=None)  # each process draws a seed: rank 0's is used
    cases = [dict(case, fault="mismatch"), dict(case, fault="raise"), case, seedless, dict(case, fault="die")]
    ranks = spawn_group(2, tmp_path, cases)
    assert ranks[0]["cases"][3]["ids"] == ranks[1]["cases"][3]["ids"]  # (4) seed=None at T > 0: one draw
    for r in (0, 1):
        err = _error(ranks[r], 0)
        assert "different requests" in err["message"]
        err = _error(ranks[r], 1)
        assert err["rank"] == 1 and "injected fault" in err["message"] and "round 3" in err["message"]
        assert "error" not in ranks[r]["cases"][2]  # after a clean fault the group still decodes
    err = _error(ranks[0], 4)
    assert "a peer died or timed out" in err["message"]
    assert err["case_seconds"] < 60 < PG_TIMEOUT_S  # a dead peer is a connection reset, seen at once, not at the timeout
    assert len(ranks[1]["cases"]) == 4  # it died in the 5th case


@pytest.mark.slow
def test_stalled_rank_ends_its_peer_at_the_group_timeout(tmp_path):
    """The last rank sleeps STALL_S (40 s) in its 2nd forward: its peer ends with DistributedError after the
    group's 5 s timeout, long before the sleeper wakes."""
    case = dict(grid()[6], model="dream", block_size=4, max_new_tokens=32, fault="stall")
    ranks = spawn_group(2, tmp_path, [case], pg_timeout=5)
    err = _error(ranks[0], 0)
    assert "a peer died or timed out" in err["message"]
    assert err["case_seconds"] < STALL_S - 10


@pytest.mark.gpu
def test_nccl_path_on_one_gpu(tmp_path):
    """The NCCL path (device tensors, cuda:LOCAL_RANK) on the one GPU a machine here may have: NCCL refuses two
    ranks on one device, so world size 1 (the collectives run, nothing crosses a device): tokens and forwards
    equal to the same process's single-process fast backend on that GPU."""
    ranks = spawn_group(1, tmp_path, grid(), backend="nccl")
    res = ranks[0]
    assert res is not None and "error" not in res, res
    for case, got in zip(grid(), res["cases"]):
        assert {k: v for k, v in got.items() if k not in ("dist", "local", "hook")} == got["local"], case
        assert got["dist"]["backend"] == "nccl"


def test_slot_share_partitions_any_count():
    for world in range(1, 6):
        for n in range(0, 13):
            shares = [slot_share(n, world, r) for r in range(world)]
            sizes = [hi - lo for lo, hi in shares]
            assert [s for lo, hi in shares for s in range(lo, hi)] == list(range(n))  # contiguous, in order
            assert max(sizes) - min(sizes) <= 1
            assert all(slot_share(n, world, slot_owner(s, n, world))[0] <= s for s in range(n))


def test_refused_without_group_or_with_uncovered_knobs():
    m = build_models()["dream"]
    prompt = [1, 2, 3]
    assert not dist.is_initialized()
    with pytest.raises(KnobError) as e:
        lopa_fast.generate(m, prompt, "lopa", "fast", distributed=True, max_new_tokens=8, block_size=4)
    assert e.value.knob == "distributed" and "init_process_group" in str(e.value)
    for kw, knob in ((dict(backend="reference"), "backend"), (dict(temperature=0.5, sampler="upstream"), "sampler"),
                     (dict(strategy="vanilla"), "strategy"), (dict(compile=True), "distributed"),
                     (dict(temperature=0.5), "distributed")):
        with pytest.raises(KnobError) as e:  # compile=True and keyed T > 0 are covered: only the missing group
            lopa_fast.generate(m, prompt, **{"strategy": "lopa", "backend": "fast", **kw}, distributed=True,
                               max_new_tokens=8, block_size=4)
        assert e.value.knob == knob
        if knob == "sampler":
            assert "sampler='keyed'" in str(e.value) and "0.5" in str(e.value)
    assert issubclass(DistributedError, RuntimeError) and issubclass(KnobError, ValueError)


def test_cli_distributed_without_torchrun(monkeypatch, capsys):
    """--distributed outside torchrun: one line naming what is missing, exit 2 (no traceback)."""
    from lopa_fast import cli

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("sys.argv", ["lopa_fast", "generate", "--prompt", "1 + 2", "--backend", "fast", "--distributed"])
    assert cli.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun" in err[0] and "RANK" in err[0]


@pytest.mark.slow
def test_cli_under_torchrun_matches_one_process(tmp_path):
    """`python -m torch.distributed.run --nproc-per-node 2 -m lopa_fast generate ... --distributed` prints (rank 0
    only) the single-process result."""
    import subprocess
    import sys

    args = ["-m", "lopa_fast", "generate", "--prompt", "Tom has 23 pens .", "--backend", "fast", "--json"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=True)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *args, "--distributed"], capture_output=True, text=True, timeout=300, check=True)
    outs = [json.loads(line) for line in two.stdout.splitlines() if line.startswith("{")]
    assert len(outs) == 1  # rank 0 prints
    assert outs[0]["generated_ids"] == json.loads(one.stdout)["generated_ids"]
    assert outs[0]["stats"]["distributed"]["world_size"] == 2
