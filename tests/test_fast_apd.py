"""Parity gate of the fast APD path (lopa_fast/strategies/apd/driver.py): token for token, step for step (dLLM and verifier
forwards, acceptance counts) equal to backend="reference", fp32 on CPU.

The reference is token-exact with upstream's `apd_sample` on the committed goldens (tests/test_reference_apd.py);
the models here are the goldens' (seeded tiny Dream drafters, Qwen2 verifiers), so fast == reference is also
fast == upstream. The grid is the product of R (None = the leftright baseline with K = 1 / 3, 0.1 .. 1.0),
W (None, 0, 1, 4, 16), M (None, 1, 4, 8), the prompt length (1, 3, 9), the EOS id (one the models emit often,
so EOS stops happen, or one they never emit), exact_prev_logits and the two model pairs. CI runs the hand-picked
CI_CASES (each path at least once, counters asserted); `-m slow` runs the whole product.
"""
from __future__ import annotations

import copy
import itertools
import json
import os

import pytest
import torch

import lopa_fast
from lopa_fast.strategies.apd.step import ApdGeometry
from lopa_fast.decode import count_host_syncs
from lopa_fast.decode.shapes import stop_in_prefix, stop_table
from lopa_fast.errors import NonFiniteLogitsError, RoundCapError
from lopa_fast.output.progress import first_stop
from lopa_fast.testing import model_from_spec
from tests.utils import apd_models, emulated_capture

HERE = os.path.dirname(__file__)
PAIRS = {"a": ("d64", "q64"), "b": ("d66", "q64b")}  # (drafter, verifier) of tests/golden/apd_upstream.json
# EOS ids per pair, measured over 36 generations of 24 tokens: one the drafter emits often (d64's own EOS 62;
# d66's third most frequent token 6), so EOS stops happen, and one it never emitted, so runs go to the length
EOS_OFTEN = {"a": 62, "b": 6}
EOS_NEVER = {"a": 61, "b": 61}
PROMPTS = {1: [7], 3: [5, 9, 2], 9: [4, 8, 15, 16, 23, 42, 1, 3, 11]}
STATS = ("acceptance_counts", "dllm_forwards", "verifier_forwards", "forwards", "model_calls", "eos_detected",
         "hit_round_cap", "finish_reason", "generated_tokens", "tpf")


@pytest.fixture(scope="module")
def models():
    return apd_models()


def case(pair="a", R=0.7, W=4, M=8, P=3, eos="often", n=20, K=None, exact=False, **kw) -> dict:
    return dict(pair=pair, R=R, W=W, M=M, P=P, eos=eos, n=n, K=K, exact=exact, **kw)


def run_both(models, c: dict, fast_only: dict | None = None, **extra):
    d_name, q_name = PAIRS[c["pair"]]
    eos = (EOS_OFTEN if c["eos"] == "often" else EOS_NEVER)[c["pair"]]
    kw = dict(strategy="apd", apd_mixture_weight=c["R"], kv_window=c["W"], max_lookahead=c["M"],
              tokens_per_step=c["K"], max_new_tokens=c["n"], eos_token_id=eos,
              exact_prev_logits=c["exact"] or None,
              verifier=models[q_name] if c["R"] is not None else None)
    kw.update({k: v for k, v in c.items() if k not in ("pair", "R", "W", "M", "P", "eos", "n", "K", "exact")})
    kw.update(extra)
    d = models[d_name]
    ref = lopa_fast.generate(d, PROMPTS[c["P"]], backend="reference", **kw)
    fast = lopa_fast.generate(d, PROMPTS[c["P"]], backend="fast", **kw, **(fast_only or {}))
    return ref, fast


def assert_parity(ref, fast, c):
    assert fast.stats["backend"] == "fast"
    assert fast.generated_ids == ref.generated_ids, c
    for k in STATS:
        assert fast.stats[k] == ref.stats[k], (k, c)


# hand-picked: every knob's special values, both pairs, both EOS modes, leftright K = 1 / 3, all three prompts
CI_CASES = [
    case(),
    case(R=0.9, W=16, M=None, P=9, eos="never", n=24),
    case(R=0.1, W=None, M=4, P=1),
    case(R=1.0, W=0, M=8, eos="never", n=24),  # R = 1: every argmax draft accepted
    case(R=0.5, W=1, M=1, P=9, n=12),  # M = 1: one token per step, the Q3 branch every step
    case(R=0.7, W=4, M=8, exact=True, eos="never", n=24),
    case(pair="b", R=0.6, W=4, M=8, P=3, n=24),
    case(pair="b", R=0.9, W=None, M=None, P=1, eos="never", n=16),
    case(pair="b", R=0.3, W=16, M=4, P=9, exact=True),
    case(R=None, K=None, W=4, M=8, P=3, eos="never", n=12),  # leftright K = 1
    case(R=None, K=3, W=0, M=4, P=1, n=20),  # leftright K = 3
    case(pair="b", R=None, K=3, W=None, M=None, P=9, eos="never", n=16),
    case(R=0.7, W=2, M=4, P=3, eos="never", n=16, top_k=5, top_p=0.9),  # filters at T = 0
    case(R=0.7, W=4, M=8, P=3, eos="never", n=20, suppress_mask_token=True),
]


def test_fast_equals_reference_ci_cases(models):
    seen = dict(multi=0, all_accepted=0, first_only=0, eos_stop=0, full_length=0)
    for c in CI_CASES:
        ref, fast = run_both(models, c)
        assert_parity(ref, fast, c)
        counts = fast.stats["acceptance_counts"]
        seen["multi"] += any(a > 1 for a in counts)
        seen["all_accepted"] += c["M"] is not None and c["R"] is not None and any(a == c["M"] > 1 for a in counts)
        seen["first_only"] += c["R"] is not None and all(a == 1 for a in counts)
        seen["eos_stop"] += fast.stats["eos_detected"] and len(fast.generated_ids) < c["n"]
        seen["full_length"] += len(fast.generated_ids) == c["n"]
    # the grid cannot pass while a path never runs
    assert all(v > 0 for v in seen.values()), seen


def slow_grid() -> list[dict]:
    out = []
    for pair, R, W, M, P, eos in itertools.product("ab", (None, 0.1, 0.5, 0.7, 0.9, 1.0), (None, 0, 1, 4, 16),
                                                   (None, 1, 4, 8), (1, 3, 9), ("often", "never")):
        if R is None:
            for K in (None, 3):
                if M is None or (K or 1) <= M:
                    out.append(case(pair=pair, R=None, K=K, W=W, M=M, P=P, eos=eos, n=20))
        else:
            out.append(case(pair=pair, R=R, W=W, M=M, P=P, eos=eos, n=20, exact=(W == 1)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("c", slow_grid(), ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_fast_equals_reference_full_grid(models, c):
    ref, fast = run_both(models, c)
    assert_parity(ref, fast, c)


def test_one_host_read_per_step(models):
    d, q = models["d64"], models["q64"]
    for kw in (dict(apd_mixture_weight=0.7, verifier=q, kv_window=4, max_lookahead=8),
               dict(tokens_per_step=2, max_lookahead=4, stop=[[13, 39]])):
        with count_host_syncs() as counter:
            out = lopa_fast.generate(d, [5, 9, 2], strategy="apd", backend="fast", max_new_tokens=24,
                                     eos_token_id=61, **kw)
        steps = out.stats["forwards"]
        assert steps > 3 and counter.per_round == [1] * steps, counter.per_round
        assert out.stats["host_reads"] == steps and out.stats["host_reads_per_round"] == 1.0


def test_round_cap(models):
    c = case(R=0.5, W=4, M=4, eos="never", n=24)
    with pytest.warns(RuntimeWarning, match=r"apd: stopped at the round cap max_rounds=3"):
        ref, fast = run_both(models, c, max_rounds=3)
    assert_parity(ref, fast, c)
    assert fast.stats["hit_round_cap"] and fast.stats["finish_reason"] == "round_cap"
    assert fast.stats["forwards"] == 3 and len(fast.generated_ids) == sum(fast.stats["acceptance_counts"]) < 24
    d, q = models["d64"], models["q64"]
    with pytest.raises(RoundCapError, match=r"max_rounds=2"):
        lopa_fast.generate(d, [5, 9, 2], strategy="apd", backend="fast", verifier=q, apd_mixture_weight=0.5,
                           max_new_tokens=24, max_rounds=2, on_round_cap="error", eos_token_id=61)


def test_stop_sequences_end_at_the_same_step(models):
    d, q = models["d64"], models["q64"]
    base = lopa_fast.generate(d, [5, 9, 2], strategy="apd", backend="fast", verifier=q, apd_mixture_weight=0.7,
                              kv_window=4, max_lookahead=8, max_new_tokens=24, eos_token_id=61)
    ids = base.generated_ids
    stop = [ids[9:11], [60, 60, 60]]  # one that occurs (mid-answer), one that never does
    c = case(R=0.7, W=4, M=8, eos="never", n=24)
    ref, fast = run_both(models, c, stop=stop)
    assert_parity(ref, fast, c)
    at = first_stop(ids, stop)
    assert fast.stats["stopped"] and fast.stats["stop_sequence_at"] == at and fast.generated_ids == ids[:at]
    assert fast.stats["forwards"] < base.stats["forwards"]  # decoding ended early, not just cut


def test_device_stop_check_equals_first_stop():
    g = torch.Generator().manual_seed(0)
    mask = 9
    for trial in range(200):
        Lb, P = 24, int(torch.randint(1, 5, (1,), generator=g))
        x = torch.randint(0, 4, (Lb + 1,), generator=g)
        x[:P] = torch.randint(0, 4, (P,), generator=g)
        first_mask = int(torch.randint(P, Lb + 1, (1,), generator=g))
        x[first_mask:] = mask
        x[Lb] = 1  # the trash column is never read
        stops = [torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(2)]
        lens = tuple(len(q) for q in stops)
        want = first_stop(x[P:Lb].tolist(), stops, mask) is not None
        # as the APD step checks its committed prefix (commit): the canvas x[:Lb] from the prompt end on
        got = stop_in_prefix(x[:Lb], stop_table(stops, "cpu", min_rows=1), lens, mask, first=torch.tensor(P))
        assert bool(got) == want, (trial, x.tolist(), P, stops)


def test_nonfinite_logits_are_refused(models):
    """NaN / inf in a row a step reads: both backends refuse at the same step and position, naming the model."""
    d, q = models["d64"], models["q64"]
    bad_d = copy.deepcopy(d)
    with torch.no_grad():
        bad_d.head_weight()[7, 0] = float("nan")
    bad_q = copy.deepcopy(q)
    with torch.no_grad():
        bad_q.head_weight()[7, 0] = float("inf")  # logit 7 = +-inf (or NaN) in every row
    for drafter, verifier, which in ((bad_d, q, "drafter"), (d, bad_q, "verifier")):
        for backend in ("reference", "fast"):
            with pytest.raises(NonFiniteLogitsError, match=r"apd: non-finite logits .* in round 1 at sequence "
                                                           r"position 3") as e:
                lopa_fast.generate(drafter, [5, 9, 2], strategy="apd", backend=backend, verifier=verifier,
                                   apd_mixture_weight=0.7, max_new_tokens=8)
            assert (e.value.strategy, e.value.round, e.value.position) == ("apd", 1, 3)
            if backend == "fast":
                assert f"({which})" in str(e.value)


def _prefer(model, token: int, prompt: list[int], **kw):
    """A copy of `model` whose head row `token` is twice the row of the first token it drafts for `prompt`, so
    it drafts `token` there (a sharpened model's top logit is positive)."""
    first = lopa_fast.generate(model, prompt, strategy="apd", max_new_tokens=4, **kw).generated_ids[0]
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.head_weight()[token] = 2 * out.head_weight()[first]
    return out


def test_drafted_mask_and_outside_vocabulary_errors_match_the_reference(models):
    d = _prefer(models["d64"], models["d64"].mask_token_id, [5, 9, 2], eos_token_id=61)
    for backend in ("reference", "fast"):
        with pytest.raises(RuntimeError, match=r"drafter emitted the mask token as a draft token"):
            lopa_fast.generate(d, [5, 9, 2], strategy="apd", backend=backend, max_new_tokens=8, eos_token_id=61)
    q = models["q64b"]
    d66 = _prefer(models["d66"], 64, [7, 3])  # an id the verifier does not have
    for backend in ("reference", "fast"):
        with pytest.raises(RuntimeError, match=r"outside the verifier's vocabulary \[0, 64\)"):
            lopa_fast.generate(d66, [7, 3], strategy="apd", backend=backend, verifier=q, apd_mixture_weight=0.7,
                               max_new_tokens=8)


def test_trace_and_hook_equal_the_reference(models):
    c = case(R=0.7, W=4, M=8, eos="never", n=16)
    seen = {"reference": [], "fast": []}
    ref, fast = run_both(models, c, return_trace=True)
    assert fast.trace == ref.trace
    d, q = models["d64"], models["q64"]
    for backend in seen:
        lopa_fast.generate(d, [5, 9, 2], strategy="apd", backend=backend, verifier=q, apd_mixture_weight=0.7,
                           kv_window=4, max_lookahead=8, max_new_tokens=16, eos_token_id=61,
                           on_round=lambda prefix, info, b=backend: seen[b].append((prefix, info)))
    assert seen["fast"] == seen["reference"] and len(seen["fast"]) == fast.stats["forwards"]


# ---- compile=True: the step compiled once per bucket (CPU: torch.compile fullgraph; CUDA: a captured graph) ----
# W = 2, M = 4, 12 new tokens: every step's window (<= M + W - 1 + M = 9 columns) and draft (<= 4 rows) fall in the
# smallest bucket (16 x 16), so CI compiles ONE graph; the second request replays it.
COMPILE_KW = dict(strategy="apd", apd_mixture_weight=0.7, kv_window=2, max_lookahead=4, max_new_tokens=12,
                  eos_token_id=61)


@pytest.fixture(scope="session")
def compiled_apd_runs():
    """CI's only real-Inductor APD step (solo, the drafter's and the verifier's forwards in one graph): it stays in
    the default run; the compile grid below is `-m slow`."""
    spec = json.load(open(os.path.join(HERE, "golden", "apd_upstream.json")))["models"]
    d, q = (model_from_spec(spec[k]["hf"], spec[k]["random"]) for k in PAIRS["a"])
    runs = []
    for prompt in ([5, 9, 2], [4, 8, 15]):
        ref = lopa_fast.generate(d, prompt, backend="reference", verifier=q, **COMPILE_KW)
        comp = lopa_fast.generate(d, prompt, backend="fast", compile=True, verifier=q, **COMPILE_KW)
        runs.append((ref, comp))
    return runs


def test_compiled_step_is_exact_and_compiles_once(compiled_apd_runs):
    for ref, comp in compiled_apd_runs:
        assert_parity(ref, comp, COMPILE_KW)
        assert comp.stats["host_reads_per_round"] == 1.0
    first, second = compiled_apd_runs[0][1].stats, compiled_apd_runs[1][1].stats
    # the steps after the prefill ran compiled, all in one bucket
    assert first["forwards"] >= 3 and first["compiled_buckets"] == [(16, 16, "x1")], first  # batch bucket 1
    assert first["compiled_graphs"] == 1 and list(first["compile_seconds"]) == ["apd_16x16_x1"]
    assert second["compiled_graphs"] == 0 and second["compile_seconds"] == {}  # a replay: nothing recompiled


def test_captured_step_workspace_logic_on_cpu(models, monkeypatch):
    """The CUDA-graph path of the APD step (the workspace per ApdGeometry, a request's state loaded into it, the
    caches written in place, the step's draft graph-owned) with the capture emulated on CPU (as
    tests/test_compiled_round.py does for the D2F / LoPA round): token-exact, traces included, over requests
    whose buckets differ."""
    from lopa_fast.decode.compiled import CompiledRounds

    d, q = models["d64"], models["q64"]
    cr = CompiledRounds.for_model(d)
    cr.emulate_graphs = True
    monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
    try:
        stats = []
        for prompt, R in (([5, 9, 2], 0.7), ([4, 8, 15], 0.7), ([1, 2, 3], 0.9)):
            kw = dict(COMPILE_KW, apd_mixture_weight=R, kv_window=4, max_lookahead=8, max_new_tokens=24,
                      return_trace=True)
            ref = lopa_fast.generate(d, prompt, backend="reference", verifier=q, **kw)
            got = lopa_fast.generate(d, prompt, backend="fast", compile=True, verifier=q, **kw)
            assert_parity(ref, got, kw)
            assert got.trace == ref.trace
            stats.append(got.stats)
        assert stats[0]["compiled_graphs"] >= 1 and len(stats[0]["compiled_buckets"]) >= 1
        assert sum(s["compiled_graphs"] for s in stats[1:]) < sum(len(s["compiled_buckets"]) for s in stats[1:])
        # R is a runtime input (the tables), not a constant: one workspace serves both values
        assert len([k for k in cr.workspaces if is_apd_workspace(k)]) == 1
    finally:
        cr.emulate_graphs = False  # the per-model compiled steps are shared with later tests
        for key in [k for k in cr.fns if k[0] == "batch" and k[2][0] == "apd"]:
            del cr.fns[key]
        for key in [k for k in cr.workspaces if is_apd_workspace(k)]:
            del cr.workspaces[key]


def is_apd_workspace(key) -> bool:
    """A compiled batch's workspace of APD steps: ("batch", ("apd", id(verifier), ApdGeometry))."""
    return key[0] == "batch" and isinstance(key[1][-1], ApdGeometry)


@pytest.mark.slow
@pytest.mark.parametrize("c", [case(R=0.5, W=None, M=None, P=9, eos="never", n=24),
                               case(R=None, K=2, W=1, M=4, P=1, n=24),
                               case(pair="b", R=0.3, W=16, M=4, P=9, eos="never", n=24,
                                    suppress_mask_token=True)])
def test_compile_grid(models, c):
    ref, comp = run_both(models, c, fast_only={"compile": True})
    assert_parity(ref, comp, c)
    assert comp.stats["forwards"] >= 3 and comp.stats["compiled_buckets"], comp.stats  # steps after the prefill


# ---- T > 0 with the keyed sampler (sampler="keyed"): the fast draft draws what the reference draws
KEYED_CASES = [
    case(temperature=0.2), case(temperature=1.0), case(temperature=1.0, single_temperature=True),
    case(temperature=0.7, coupled_gumbel=True), case(pair="b", temperature=1.0, top_p=0.9, W=None),
    case(R=None, K=2, temperature=1.0), case(temperature=1.0, top_k=5, M=None, eos="never"),
]


@pytest.mark.parametrize("c", KEYED_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_keyed_sampling_fast_equals_reference(models, c):
    ref, fast = run_both(models, c, sampler="keyed", seed=11)
    assert_parity(ref, fast, c)


def test_keyed_sampling_seeds_matter_and_upstream_stays_on_the_reference(models):
    c = case(temperature=1.0, eos="never", n=24)
    runs = [run_both(models, c, sampler="keyed", seed=s)[1].generated_ids for s in (1, 2, 3)]
    assert len({tuple(r) for r in runs}) > 1  # the draws depend on the seed
    d_name, q_name = PAIRS["a"]
    with pytest.warns(RuntimeWarning, match="sampler='upstream'"):  # APD's default at T > 0: upstream's order
        out = lopa_fast.generate(models[d_name], PROMPTS[3], strategy="apd", backend="auto", verifier=models[q_name],
                                 apd_mixture_weight=0.7, kv_window=4, max_lookahead=8, max_new_tokens=16,
                                 temperature=1.0, seed=1)
    assert out.stats["backend"] == "reference"
