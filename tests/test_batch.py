"""Batched generate (lopa_fast.decode.batch): several requests' branch windows in one forward per round, each
request token-, forward- and stats-exact with running it alone (fp32, CPU); the scheduler admitting requests mid-flight and capping rows; APD's two-forward steps
(one drafter forward, then one verifier forward, for every live request)."""
from __future__ import annotations

import itertools
import re
import threading
import time

import pytest
import torch

import lopa_fast
from lopa_fast.decode import batch
from lopa_fast.errors import KnobError
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import spec_of

STATS = ("forwards", "accepted_by_threshold", "fallback_fills", "multi_token_rounds", "eos_fills", "eos_detected",
         "finish_reason")


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)


@pytest.fixture(scope="module")
def llada():
    return random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=6)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 60, (n,), generator=g) for n in lengths]


def same(a, b, stats=STATS):
    assert a.generated_ids == b.generated_ids
    for k in stats:
        assert a.stats.get(k) == b.stats.get(k), k


def knobs(k, full, bs, **kw):
    return dict(branching_factor=k, use_full_attention=full, block_size=bs, max_new_tokens=24, eos_token_id=5,
                skip_threshold=0.9, **kw)


@pytest.mark.parametrize("k,full,bs", list(itertools.product((1, 2, 4), (True, False), (4, 8))))
def test_batched_equals_solo(model, k, full, bs):
    ps = prompts((3, 17, 9, 30), seed=k * 10 + bs)
    kw = knobs(k, full, bs)
    solo = [lopa_fast.generate(model, p, "lopa", "fast", **kw) for p in ps]
    calls = []
    fr = model.forward_requests
    model.forward_requests = lambda *a, **kk: calls.append(len(a[0])) or fr(*a, **kk)
    try:
        outs = lopa_fast.generate(model, ps, "lopa", "fast", **kw)
    finally:
        del model.forward_requests
    assert isinstance(outs, list) and len(outs) == len(ps)
    for o, s in zip(outs, solo):
        same(o, s)
    # one forward per round for every live request; requests leave as they finish
    assert len(calls) == max(s.stats["forwards"] for s in solo)
    assert calls[0] == len(ps) and sum(calls) == sum(s.stats["forwards"] for s in solo)


def test_batched_equals_reference_and_llada(llada):
    ps = prompts((4, 12, 21), seed=3)
    kw = knobs(2, True, 4, sampling_strategy="margin")
    outs = lopa_fast.generate(llada, ps, "lopa", "fast", **kw)
    for o, p in zip(outs, ps):
        same(o, lopa_fast.generate(llada, p, "lopa", "reference", **kw))


def test_batched_k1_block_causal_and_k4_full(model):
    """The batch runs the round's stages (prepare / forward / finish) and stays exact at both ends of the grid."""
    ps = prompts((5, 14), seed=7)
    for k, full in ((1, False), (4, True)):
        kw = knobs(k, full, 4)
        outs = lopa_fast.generate(model, ps, "lopa", "fast", **kw)
        for o, p in zip(outs, ps):
            same(o, lopa_fast.generate(model, p, "lopa", "fast", **kw))


def test_scheduler_admits_mid_flight_and_caps_rows(model):
    ps = prompts((6, 19, 11, 25, 8), seed=11)
    kw = knobs(4, True, 4)
    cfg = lopa_fast.GenerateConfig(strategy="lopa", backend="fast", **kw).bind(model)
    solo = [lopa_fast.generate(model, p, "lopa", "fast", **kw) for p in ps]
    sched = batch.Scheduler(model, cfg, max_rows=10, spec=spec_of(cfg))  # two LoPA k=4 requests (5 slots each) at once
    ids = [sched.submit(p) for p in ps[:2]]
    live_sizes = []
    for _ in range(3):
        sched.step()
        live_sizes.append(len(sched.live))
    ids += [sched.submit(p) for p in ps[2:]]  # admitted at later round boundaries, as rows free up
    while sched.queue or sched.live:
        sched.step()
        live_sizes.append(len(sched.live))
    assert max(live_sizes) == 2
    for i, s in zip(ids, solo):  # the scheduler's raw outputs (generate adds finish_reason when it cuts)
        same(sched.done[i], s, STATS[:-1])


def test_scheduler_bad_cap(model):
    cfg = lopa_fast.GenerateConfig(strategy="lopa", backend="fast", **knobs(4, True, 4)).bind(model)
    with pytest.raises(KnobError, match="max_rows"):
        batch.Scheduler(model, cfg, max_rows=0, spec=spec_of(cfg))
    sched = batch.Scheduler(model, cfg, max_rows=3, spec=spec_of(cfg))
    with pytest.raises(KnobError, match="smaller than one request's 5 branch slots"):  # refused at submission
        sched.submit(prompts((5,))[0])
    assert not sched.queue


def test_single_prompt_still_returns_one_output(model):
    p = prompts((7,))[0]
    out = lopa_fast.generate(model, p, "lopa", "fast", **knobs(2, True, 4))
    assert isinstance(out, lopa_fast.GenerateOutput)
    one = lopa_fast.generate(model, [p], "lopa", "fast", **knobs(2, True, 4))
    assert isinstance(one, list) and len(one) == 1
    same(one[0], out)


def test_batched_reference_backend_loops(model):
    ps = prompts((4, 9), seed=2)
    kw = knobs(2, False, 4)
    outs = lopa_fast.generate(model, ps, "lopa", "reference", **kw)
    for o, p in zip(outs, ps):
        same(o, lopa_fast.generate(model, p, "lopa", "reference", **kw))


def test_one_request_error_leaves_the_others_running(model):
    """A request whose hook raises (e.g. a cancelled stream) leaves the batch with its exception; the others finish
    with their solo results; generate(list) raises that prompt's error as decoding it alone would."""
    ps = prompts((6, 13, 9), seed=5)
    kw = knobs(2, True, 4)
    cfg = lopa_fast.GenerateConfig(strategy="lopa", backend="fast", **kw).bind(model)
    solo = [lopa_fast.generate(model, p, "lopa", "fast", **kw) for p in ps]

    class Cancelled(Exception):
        pass

    def cancel_at_round_2(prefix, info):
        if info["round"] >= 2:
            raise Cancelled

    sched = batch.Scheduler(model, cfg, spec=spec_of(cfg))
    ids = [sched.submit(ps[0]), sched.submit(ps[1], cancel_at_round_2), sched.submit(ps[2])]
    sched.run()
    assert isinstance(sched.failed[ids[1]], Cancelled) and ids[1] not in sched.done
    for i, s in ((ids[0], solo[0]), (ids[2], solo[2])):
        same(sched.done[i], s, STATS[:-1])
    with pytest.raises(Cancelled):
        lopa_fast.generate(model, ps, "lopa", "fast", on_round=[None, cancel_at_round_2, None], **kw)


def test_batch_engine_serves_threads_in_one_batch(model):
    """BatchEngine (the server's): requests from several threads decode in one running batch, each with its solo
    result; one request's error (its hook) reaches only its caller."""
    ps = prompts((5, 12, 8), seed=9)
    kw = knobs(2, False, 4)
    cfg = lopa_fast.GenerateConfig(strategy="lopa", backend="fast", **kw).bind(model)
    solo = [lopa_fast.generate(model, p, "lopa", "fast", **kw) for p in ps]
    engine = batch.BatchEngine(model, start=False)
    results = [None] * 3

    def bad_hook(prefix, info):
        raise KeyError("cancelled by its client")

    def call(i):
        try:
            results[i] = engine.generate(ps[i], cfg, bad_hook if i == 1 else None, spec=spec_of(cfg))
        except Exception as e:  # noqa: BLE001
            results[i] = e

    _start_together(engine, call, 3)
    deadline = time.monotonic() + 30  # the engine thread drops the idle scheduler right after its last step
    while engine._schedulers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._schedulers == {}  # the idle scheduler and its KV pool were dropped (no memory held)
    engine.close()
    assert isinstance(results[1], KeyError)
    same(results[0], solo[0], STATS[:-1])
    same(results[2], solo[2], STATS[:-1])
    assert engine.max_live == 3


VANILLA = [  # (family, knobs): LLaDA blocks + its CFG batch of two rows, random remasking at T > 0; Dream's algs
    ("llada", dict(max_new_tokens=16, block_length=8, steps=8)),
    ("llada", dict(max_new_tokens=16, block_length=16, steps=8, cfg_scale=1.5)),
    ("llada", dict(max_new_tokens=16, block_length=8, steps=16, remasking="random", temperature=0.7, seed=3)),
    ("dream", dict(max_new_tokens=16, steps=8, alg="entropy")),
    ("dream", dict(max_new_tokens=16, steps=16, alg="origin", seed=5)),
    ("dream", dict(max_new_tokens=16, steps=8, alg="topk_margin", alg_temp=0.5, temperature=0.4, seed=1)),
]
VANILLA_STATS = ("forwards", "transferred", "masks_left", "finish_reason")


@pytest.mark.parametrize("family, kw", VANILLA, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_batched_vanilla_equals_solo(model, llada, family, kw):
    """Vanilla's cache-free steps of several requests in one forward per step (the VanillaDriver through the
    scheduler): each request's tokens, forwards, stats and trace equal its solo run's and the reference's."""
    _batched_equals_solo_and_reference(llada if family == "llada" else model, "vanilla", kw, 21, VANILLA_STATS, 1)


def _batched_equals_solo_and_reference(m, strategy: str, kw: dict, seed: int, stats: tuple, ref_stats: int):
    """Three prompts decoded together: each one's tokens, `stats` and trace equal its solo run's, and its tokens and
    first `ref_stats` stats the reference's."""
    ps = prompts((5, 11, 8), seed=seed)
    solo = [lopa_fast.generate(m, p, strategy, "fast", return_trace=True, **kw) for p in ps]
    outs = lopa_fast.generate(m, ps, strategy, "fast", return_trace=True, **kw)
    for o, s, p in zip(outs, solo, ps):
        assert o.stats["batched"] == 3
        same(o, s, stats)
        assert o.trace == s.trace
        same(o, lopa_fast.generate(m, p, strategy, "reference", **kw), stats[:ref_stats])


def test_batched_vanilla_stop_and_hooks(model):
    """A stop sequence ends one request of the batch early (the others go on); per-prompt hooks see each step."""
    ps = prompts((6, 9), seed=4)
    kw = dict(max_new_tokens=16, steps=16, alg="entropy")
    base = lopa_fast.generate(model, ps[0], "vanilla", "fast", **kw)
    stop = [base.generated_ids[3:5]]
    seen = [[], []]
    hooks = [lambda p, i, j=j: seen[j].append(i["round"]) for j in range(2)]
    outs = lopa_fast.generate(model, ps, "vanilla", "fast", stop=stop, on_round=hooks, **kw)
    for o, p, j in zip(outs, ps, range(2)):
        s = lopa_fast.generate(model, p, "vanilla", "fast", stop=stop, **kw)
        same(o, s, VANILLA_STATS)
        assert seen[j] == list(range(1, o.stats["forwards"] + 1))
    assert outs[0].stats["finish_reason"] == "stop"


THRESHOLD = [  # (family, knobs): the three rules, every cache mode, Dream's refresh_first, keyed T > 0
    ("llada", dict(block_length=8, threshold=0.5)),
    ("llada", dict(block_length=8, factor=1.0, cache="prefix")),
    ("dream", dict(block_length=4, entropy_threshold=0.6, cache="prefix", count_noop_forward=True)),
    ("dream", dict(block_length=8, threshold=0.7, temperature=0.6, seed=2)),
    ("llada", dict(block_length=4, threshold=0.6, cache="dual")),
    ("dream", dict(block_length=4, factor=1.0, cache="dual", count_noop_forward=True, temperature=0.5, seed=4)),
]
THRESHOLD_STATS = ("forwards", "refresh_forwards", "multi_token_steps", "noop_forwards", "finish_reason")


@pytest.mark.parametrize("family, kw", THRESHOLD, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_batched_threshold_equals_solo(model, llada, family, kw):
    """Threshold's steps of several requests in one forward per step (ThresholdDriver through the scheduler; the
    prefix cache in the pool's slots): tokens, forwards, counters and trace equal the solo and reference runs."""
    m = llada if family == "llada" else model
    _batched_equals_solo_and_reference(m, "threshold", dict(kw, max_new_tokens=16), 23, THRESHOLD_STATS, 2)


def test_dual_cache_steps_share_one_forward(llada):
    """Threshold's dual cache: a round's dual steps (the window's K/V written into each request's cache in place,
    then attention over the whole cache) run as ONE packed forward (steps.DualForward: `model.forward_dual`), beside
    the refresh steps' shared forward when the requests are in different phases; tokens and forwards equal the solo
    runs'."""
    ps = prompts((5, 9, 14), seed=2)
    kw = dict(block_length=4, threshold=0.6, cache="dual", max_new_tokens=16)
    solo = [lopa_fast.generate(llada, p, "threshold", "fast", **kw) for p in ps]
    calls = {"dual": [], "model": []}
    real = llada.forward_dual
    llada.forward_dual = lambda parts: calls["dual"].append(len(parts)) or real(parts)
    counting(llada, calls["model"])
    try:
        outs = lopa_fast.generate(llada, ps, "threshold", "fast", **kw)
    finally:
        del llada.forward_requests, llada.forward_dual
    for o, s in zip(outs, solo):
        assert o.stats["batched"] == 3
        same(o, s, THRESHOLD_STATS)
    assert max(calls["dual"]) >= 2  # requests whose dual steps fall in one round share its one dual forward
    refresh = sum(s.stats["refresh_forwards"] for s in solo)
    assert sum(calls["dual"]) == sum(s.stats["forwards"] for s in solo) - refresh and sum(calls["model"]) == refresh


# ---- APD: a step of two forwards (the drafter's, then the verifier's over the drafts), each ONE forward_requests
# for every live request (the driver's `forwards`)
APD_STATS = ("acceptance_counts", "dllm_forwards", "verifier_forwards", "forwards", "model_calls", "eos_detected",
             "hit_round_cap", "finish_reason")
APD_PROMPTS = ([5, 9, 2], [7], [4, 8, 15, 16, 23, 42, 1, 3, 11], [1, 2])
APD = [  # (pair, knobs): a drafter cache (W) or none, M or the whole canvas, the prefill's exact prev row (Q3
    # fix), the verifier-free leftright baseline (one forward per step), top-k / top-p and the keyed draw at T > 0
    ("a", dict(apd_mixture_weight=0.7, kv_window=4, max_lookahead=8, eos_token_id=62)),
    ("a", dict(apd_mixture_weight=0.5, kv_window=None, max_lookahead=None, exact_prev_logits=True, eos_token_id=61)),
    ("a", dict(apd_mixture_weight=None, tokens_per_step=3, kv_window=0, max_lookahead=4, eos_token_id=62)),
    ("b", dict(apd_mixture_weight=0.6, kv_window=16, max_lookahead=4, top_k=5, top_p=0.9, eos_token_id=6)),
    ("b", dict(apd_mixture_weight=0.7, kv_window=2, max_lookahead=8, temperature=1.0, sampler="keyed", seed=11,
               eos_token_id=61)),
]


@pytest.fixture(scope="module")
def apd():
    from tests.utils import apd_models

    return apd_models()


def apd_pair(apd, pair: str, kw: dict):
    """(drafter, knobs with the verifier when the config has one) of a tests/test_fast_apd.py pair."""
    d, q = {"a": ("d64", "q64"), "b": ("d66", "q64b")}[pair]
    return apd[d], dict(kw, strategy="apd", max_new_tokens=20,
                        verifier=apd[q] if kw["apd_mixture_weight"] is not None else None)


def counting(m, calls: list):
    """Record the batch size of every forward_requests of model `m` (undo: `del m.forward_requests`)."""
    fr = m.forward_requests
    m.forward_requests = lambda parts, *a, **k: calls.append(len(parts)) or fr(parts, *a, **k)


@pytest.mark.parametrize("pair, kw", APD, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_batched_apd_equals_solo_and_reference(apd, pair, kw):
    """Every APD step of the batch runs ONE drafter forward and ONE verifier forward for all live requests; each
    request's tokens, drafter / verifier forwards, acceptance counts and trace equal its solo and reference runs."""
    d, kw = apd_pair(apd, pair, kw)
    q = kw["verifier"]
    solo = [lopa_fast.generate(d, p, backend="fast", return_trace=True, **kw) for p in APD_PROMPTS]
    d_calls, q_calls = [], []
    counting(d, d_calls)
    if q is not None:
        counting(q, q_calls)
    try:
        outs = lopa_fast.generate(d, list(APD_PROMPTS), backend="fast", return_trace=True, **kw)
    finally:
        del d.forward_requests
        if q is not None:
            del q.forward_requests
    for o, s, p in zip(outs, solo, APD_PROMPTS):
        assert o.stats["batched"] == len(APD_PROMPTS)
        same(o, s, APD_STATS)
        assert o.trace == s.trace
        same(o, lopa_fast.generate(d, p, backend="reference", **kw), APD_STATS)
    # one drafter forward per step for every live request (they leave as they finish), one verifier forward after it
    assert d_calls[0] == len(APD_PROMPTS) and len(d_calls) == max(s.stats["dllm_forwards"] for s in solo)
    assert sum(d_calls) == sum(s.stats["dllm_forwards"] for s in solo)
    assert q_calls == (d_calls if q is not None else [])
    assert sum(q_calls) == sum(s.stats["verifier_forwards"] for s in solo)


def test_apd_scheduler_admits_mid_flight(apd):
    """Continuous admission of APD requests (two at a time: max_slots=2), each equal to its solo run."""
    d, kw = apd_pair(apd, *APD[0])
    q = kw.pop("verifier")
    cfg = lopa_fast.GenerateConfig(backend="fast", **kw).bind(d)
    ps = [torch.tensor(p) for p in APD_PROMPTS]
    solo = [lopa_fast.generate(d, p, backend="fast", verifier=q, **kw) for p in ps]
    sched = batch.Scheduler(d, cfg, max_slots=2, verifier=q, spec=spec_of(cfg))
    ids = [sched.submit(p) for p in ps[:1]]
    sched.step()
    ids += [sched.submit(p) for p in ps[1:]]  # admitted at later step boundaries, as slots free up
    live = []
    while sched.queue or sched.live:
        sched.step()
        live.append(len(sched.live))
    assert max(live) == 2 and not sched.failed
    for i, s in zip(ids, solo):
        same(sched.done[i], s, APD_STATS[:-1])


@pytest.mark.parametrize("which", ("drafter", "verifier"))
def test_apd_request_with_nonfinite_logits_ends_alone(apd, which):
    """A request whose drafter (or verifier) logits are NaN (its prompt holds a token whose embedding is NaN) ends
    with the solo run's NonFiniteLogitsError; the other requests of the batch finish with their solo results."""
    import copy

    from lopa_fast.errors import NonFiniteLogitsError

    d, kw = apd_pair(apd, *APD[0])
    q = kw.pop("verifier")
    bad = copy.deepcopy(d if which == "drafter" else q)
    with torch.no_grad():
        bad.embed_weight()[59] = float("nan")  # token 59: only in the poisoned prompt
    d, q = (bad, q) if which == "drafter" else (d, bad)
    ps = [torch.tensor(p) for p in ([5, 9, 2], [7, 59, 3], [4, 8, 15])]
    with pytest.raises(NonFiniteLogitsError, match=re.escape(f"({which})")) as solo_err:
        lopa_fast.generate(d, ps[1], backend="fast", verifier=q, **kw)
    solo = [lopa_fast.generate(d, ps[i], backend="fast", verifier=q, **kw) for i in (0, 2)]
    cfg = lopa_fast.GenerateConfig(backend="fast", **kw).bind(d)
    sched = batch.Scheduler(d, cfg, verifier=q, spec=spec_of(cfg))
    ids = [sched.submit(p) for p in ps]
    sched.run()
    err = sched.failed[ids[1]]
    assert isinstance(err, NonFiniteLogitsError) and str(err) == str(solo_err.value)
    for i, s in zip((ids[0], ids[2]), solo):
        same(sched.done[i], s, APD_STATS[:-1])
    with pytest.raises(NonFiniteLogitsError, match=re.escape(f"({which})")):  # generate(list): as the solo run
        lopa_fast.generate(d, ps, backend="fast", verifier=q, **kw)


def test_batch_engine_keys_apd_schedulers_by_verifier(apd):
    """BatchEngine: APD requests with one verifier share a scheduler (one verifier forward per step); another
    verifier object gets its own; each caller gets its solo result."""
    import copy

    d, kw = apd_pair(apd, *APD[0])
    q = kw.pop("verifier")
    q2 = copy.deepcopy(q)
    cfg = lopa_fast.GenerateConfig(backend="fast", **kw).bind(d)
    ps = [torch.tensor(p) for p in APD_PROMPTS[:3]]
    verifiers = [q, q, q2]
    solo = [lopa_fast.generate(d, p, backend="fast", verifier=v, **kw) for p, v in zip(ps, verifiers)]
    engine = batch.BatchEngine(d, start=False)
    results = [None] * 3

    def call(i):
        results[i] = engine.generate(ps[i], cfg, verifier=verifiers[i], spec=spec_of(cfg))

    _start_together(engine, call, 3)
    engine.close()
    assert engine.max_live == 2  # q's two requests in one batch, q2's in its own scheduler
    for r, s in zip(results, solo):
        same(r, s, APD_STATS[:-1])


def _start_together(engine, call, n: int) -> None:
    """Run call(0..n-1) on n threads, line all n requests up in the engine before it takes its first step, start
    it and join them (bounded waits)."""
    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:
        with engine._cv:
            if len(engine._incoming) == n:
                break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.start()
    for t in threads:
        t.join(timeout=120)


def test_an_out_of_memory_forward_fails_only_the_request_that_cannot_fit_alone(model, monkeypatch):
    """Issue 43, finding 7. Before: one forward that ran out of memory failed every request of its batch. Now the
    shared forward is retried in halves; a request whose forward alone still runs out of memory (the 13-token prompt
    here) fails with that error and the others finish with exactly their solo results."""
    from lopa_fast.strategies.lopa.driver import FastDecoder

    ps = prompts((6, 13, 9), seed=5)
    kw = knobs(2, True, 4)
    cfg = lopa_fast.GenerateConfig(strategy="lopa", backend="fast", **kw).bind(model)
    solo = [lopa_fast.generate(model, p, "lopa", "fast", **kw) for p in ps]
    real_args, real_forward = FastDecoder.forward_args, model.forward_requests
    monkeypatch.setattr(FastDecoder, "forward_args", lambda self, w: dict(real_args(self, w), big=self.P == 13))

    def forward_requests(parts, *a, **k):  # the 13-token request needs more memory than there is, even alone
        if any(p.get("big") for p in parts):
            raise torch.OutOfMemoryError("out of memory (stand-in)")
        return real_forward([{k_: v for k_, v in p.items() if k_ != "big"} for p in parts], *a, **k)

    monkeypatch.setattr(model, "forward_requests", forward_requests)
    sched = batch.Scheduler(model, cfg, spec=spec_of(cfg))
    ids = [sched.submit(p) for p in ps]
    sched.run()
    assert isinstance(sched.failed.get(ids[1]), torch.OutOfMemoryError), sched.failed
    for i in (0, 2):
        same(sched.done[ids[i]], solo[i], STATS[:-1])
    assert sched.oom_splits >= 1
