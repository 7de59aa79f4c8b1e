"""The batch's static KV pool (lopa_fast.decode.kv_pool) and forward_requests' pooled attention path.

CPU (torch backend): the pool hands out and frees slots (admission mid-flight, an early finisher's slot reused by a
queued request, growth while requests are live, the caps' refusals), and batched == solo with every request's cache
in the pool. Triton interpreter (TRITON_INTERPRET=1, tests/conftest.py): the GPU path's ONE pooled attention call per
layer equals the per-request path (logits within tolerance, tokens exact). `gpu`: the same on the real device."""
from __future__ import annotations

import pytest
import torch

import lopa_fast
from lopa_fast.decode import batch
from lopa_fast.decode.kv_pool import KVPool
from lopa_fast.errors import KnobError
from lopa_fast.testing import random_model, tiny_hf_config
from tests.test_batch import STATS, knobs, prompts, same
from tests.utils import cuda_emu  # noqa: F401 - fixture
from tests.utils import spec_of


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)


@pytest.fixture(scope="module")
def model1():
    """One layer: the Triton interpreter runs every op of the layer in Python, so fewer layers keep it short."""
    return random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2, num_layers=1), seed=2, sharpen=6)


def bound(model, **kw):
    return lopa_fast.GenerateConfig(strategy="lopa", backend="fast", **kw).bind(model)


def test_pool_grows_keeps_rows_and_frees_slots(model):
    pool = KVPool(model)
    assert pool.slots == 0 and pool.nbytes() == 0
    assert not pool.ensure(65, 1)  # the first allocation replaces nothing
    assert (pool.slots, pool.slot_len) == (1, 128)  # lengths in steps of 64
    s0 = pool.acquire(65)
    k, v = pool.views(s0, 65)
    assert k.shape == (model.config.num_layers, 65, model.config.num_kv_heads, model.config.head_dim)
    k.fill_(1.5)
    v[:, 3].fill_(-2.0)
    assert pool.ensure(200, 3)  # grown: both dimensions, the old rows copied into the corner
    assert (pool.slots, pool.slot_len) == (3, 256) and pool.growths == 1
    k2, v2 = pool.views(s0, 65)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert not pool.ensure(256, 3) and pool.ensure(257, 3, max_len=300) and pool.slot_len == 300  # capped
    s1, s2 = pool.acquire(201), pool.acquire(10)
    assert (s0, s1, s2) == (0, 1, 2) and not pool.free
    with pytest.raises(RuntimeError, match="no slot"):
        pool.acquire(10)
    pool.release(s1)
    pool.views(s1, 50)[0].fill_(9.0)
    assert pool.acquire(50) == s1 and not pool.views(s1, 50)[0].any()  # an acquired slot starts from zeros
    with pytest.raises(RuntimeError, match="not in use"):
        pool.release(7)


def test_scheduler_slots_admission_mid_flight_early_finish_and_growth(model):
    """max_slots=2: at most two requests live, each on its own slot; the short request (4 new tokens) finishes early
    and its slot goes to the first queued request at the next round boundary; a long prompt admitted mid-flight
    grows the pool's slot length while the others run; every request equals its solo run; all slots free at the
    end."""
    kw = knobs(2, True, 4)
    ps = prompts((6, 9, 11, 70), seed=4)
    lens = (24, 4, 24, 24)  # request 1 finishes early
    cfgs = [bound(model, **dict(kw, max_new_tokens=n)) for n in lens]
    solo = [lopa_fast.generate(model, p, "lopa", "fast", **dict(kw, max_new_tokens=n)) for p, n in zip(ps, lens)]
    sched = batch.Scheduler(model, cfgs[0], max_slots=2, spec=spec_of(cfgs[0]))
    ids = [sched.submit(p, None, c) for p, c in zip(ps[:3], cfgs[:3])]
    slot_log, ends = [], {}
    sched.step()
    assert sched.pool.slot_len == 128  # 65 rows (a 64-row buffer + its trash row), in steps of 64
    ids.append(sched.submit(ps[3], None, cfgs[3]))  # a 70-token prompt: 128 + 1 rows, admitted mid-flight
    while sched.queue or sched.live:
        for rid in sched.step():
            ends[rid] = sched.rounds
        assert len(sched.live) <= 2 and sched.pool.slots <= 2
        assert set(sched.slot_of) == set(sched.live)
        assert sorted(sched.slot_of.values()) == sorted(sched.pool.used)  # one slot per live request
        slot_log.append(dict(sched.slot_of))
    assert ends[ids[1]] < ends[ids[0]]  # the short one ended first ...
    first_with_2 = next(i for i, m in enumerate(slot_log) if ids[2] in m)
    assert slot_log[first_with_2][ids[2]] == 1  # ... and request 2 took its slot (1) at the next boundary
    assert sched.pool.slot_len >= 129 and sched.pool.growths >= 1
    assert not sched.pool.used and sorted(sched.pool.free) == [0, 1]
    for i, s in zip(ids, solo):
        same(sched.done[i], s, STATS[:-1])


def test_scheduler_caps_refuse_what_can_never_fit(model):
    cfg = bound(model, **knobs(1, False, 4))
    for knob in ("max_slots", "slot_len"):
        with pytest.raises(KnobError, match=knob):
            batch.Scheduler(model, cfg, **{knob: 0}, spec=spec_of(cfg))
    sched = batch.Scheduler(model, cfg, slot_len=64, spec=spec_of(cfg))
    with pytest.raises(KnobError, match="slot_len=64 is smaller than this request's 65 cache rows") as e:
        sched.submit(prompts((10,))[0])  # 10 + 24 -> a 64-row buffer + its trash row
    assert e.value.knob == "slot_len" and not sched.queue
    engine = batch.BatchEngine(model, slot_len=64)  # the server's engine: only that caller hears the refusal
    try:
        with pytest.raises(KnobError, match="slot_len"):
            engine.generate(prompts((10,))[0], cfg, spec=spec_of(cfg))
        ok = batch.BatchEngine(model, max_slots=1)
        try:
            same(ok.generate(prompts((5,))[0], cfg, spec=spec_of(cfg)), lopa_fast.generate(model, prompts((5,))[0], "lopa", "fast",
                                                                         **knobs(1, False, 4)), STATS[:-1])
        finally:
            ok.close()
    finally:
        engine.close()


def test_abort_ends_every_request_and_frees_every_slot(model):
    """The shared forward failing (BatchEngine calls abort) ends the live and the queued requests with that error
    and hands every slot back; the scheduler then serves new requests from a free pool."""
    cfg = bound(model, **knobs(2, False, 4))
    sched = batch.Scheduler(model, cfg, max_slots=2, spec=spec_of(cfg))
    ids = [sched.submit(p) for p in prompts((5, 9, 7), seed=3)]
    sched.step()
    assert len(sched.live) == 2 and len(sched.queue) == 1
    err = RuntimeError("the shared forward failed")
    assert sorted(sched.abort(err)) == ids
    assert all(sched.failed[i] is err for i in ids) and not sched.live and not sched.queue
    assert not sched.pool.used and sorted(sched.pool.free) == [0, 1]
    p = prompts((6,), seed=4)[0]
    rid = sched.submit(p)
    sched.run()
    same(sched.done[rid], lopa_fast.generate(model, p, "lopa", "fast", **knobs(2, False, 4)), STATS[:-1])


def _pooled_and_loop(model, monkeypatch, full: bool, k: int, late: bool, backend: str):
    """Requests run two rounds on the CPU path (late: a second request is admitted after them, so its prompt-long
    first window meets the first one's short window), then the next round's forward_requests on `backend`: pooled
    and per-request (pool=None). Returns both outputs, the parts and the attention calls of each."""
    from lopa_fast import ops

    cfg = bound(model, **dict(knobs(k, full, 4), max_new_tokens=48))
    sched = batch.Scheduler(model, cfg, spec=spec_of(cfg))
    ps = prompts((5, 14), seed=8)  # neither request ends within three rounds
    for p in ps[: 1 if late else 2]:
        sched.submit(p)
    for _ in range(2):
        sched.step()
    assert len(sched.live) == (1 if late else 2)
    if late:
        sched.submit(ps[1])
        sched._admit()
    plan = [(rid, dec, dec.next_bucket()) for rid, dec in sched.live.items()]
    parts = [dict(dec.forward_args(dec.prepare(*b)), slot=sched.slot_of[rid]) for rid, dec, b in plan]
    calls = []
    op = ops.branch_attention
    monkeypatch.setattr(ops, "branch_attention", lambda *a, **kk: calls.append(kk.get("backend")) or op(*a, **kk))
    pooled = model.forward_requests(parts, plan[0][1].mode, backend, pool=(sched.pool.k, sched.pool.v))
    n_pooled = len(calls)
    loop = model.forward_requests(parts, plan[0][1].mode, backend)
    monkeypatch.setattr(ops, "branch_attention", op)
    assert set(calls) == {backend}
    return pooled, loop, parts, n_pooled, len(calls) - n_pooled


def _assert_paths_agree(model, pooled, loop, parts, n_pooled, n_loop, late, tol):
    L = model.config.num_layers
    assert n_pooled == L and n_loop == L * len(parts) and len(parts) == 2  # one launch per layer vs one per request
    widths = {p["tokens"].shape[1] for p in parts}
    assert (len(widths) > 1) == late, widths  # the padded case and the packed case are both covered
    assert any(p["prefix_len"] > 0 for p in parts)
    for (la, ka, va), (lb, kb, vb) in zip(pooled, loop):
        torch.testing.assert_close(la, lb, atol=tol, rtol=tol)
        assert torch.equal(la.argmax(-1), lb.argmax(-1))
        torch.testing.assert_close(ka, kb, atol=tol, rtol=tol)
        torch.testing.assert_close(va, vb, atol=tol, rtol=tol)


@pytest.mark.parametrize("full,k,late", [(False, 2, True), (True, 1, False)], ids=["padded", "packed"])
def test_pooled_forward_requests_matches_per_request_triton(model1, monkeypatch, full, k, late):
    """The GPU path in the interpreter: one pooled attention launch per layer (vs one per request), the same logits
    and window K/V as the per-request path within fp32 tolerance; windows of different widths (a request admitted
    late, block-causal LoPA) exercise the padded batch, equal widths (full D2F) the packed view."""
    out = _pooled_and_loop(model1, monkeypatch, full, k, late, "triton")
    _assert_paths_agree(model1, *out, late, 1e-4)


def test_pooled_forward_requests_matches_per_request_cuda_emulated(cuda_emu, monkeypatch):
    """The same on the CUDA kernels' host emulation (head dim 64: the kernels' smallest), padded block-causal LoPA."""
    from lopa_fast.ops import _backend, cuda

    monkeypatch.setattr(cuda, "branch_attention", cuda_emu.branch_attention)
    usable = _backend._usable
    monkeypatch.setattr(_backend, "_usable", lambda op, b, dev, args=(): None if b == "cuda" else usable(op, b, dev, args))
    model = random_model(tiny_hf_config("dream", vocab_size=64, hidden_size=128, intermediate_size=64, num_layers=1,
                                        num_heads=2, num_kv_heads=1), seed=2, sharpen=6)
    out = _pooled_and_loop(model, monkeypatch, False, 2, True, "cuda")
    _assert_paths_agree(model, *out, True, 1e-4)


def test_pooled_batch_tokens_equal_per_request_triton(model1, monkeypatch):
    """A whole batched decode on the Triton backend (interpreter, a one-layer model): the pooled path's tokens and
    forwards equal the per-request path's, request by request."""
    monkeypatch.setenv("LOPA_FAST_BACKEND", "triton")
    kw = dict(knobs(1, False, 4), max_new_tokens=8)
    cfg = bound(model1, **kw)
    ps = prompts((4, 11), seed=8)
    real = model1.forward_requests

    def run(pooled: bool):
        seen = []

        def fr(parts, mode, b=None, pool=None):
            seen.append((b, pool is not None))
            return real(parts, mode, b, pool=pool if pooled else None)

        monkeypatch.setattr(model1, "forward_requests", fr)
        sched = batch.Scheduler(model1, cfg, spec=spec_of(cfg))
        ids = [sched.submit(p) for p in ps]
        sched.run()
        assert seen and all(s == ("triton", True) for s in seen)
        return [sched.done[i] for i in ids]

    for a, b in zip(run(True), run(False)):
        same(a, b, STATS[:-1])


@pytest.mark.gpu
def test_pooled_batch_on_the_device():
    """On CUDA (auto backend: triton / cuda): one pooled attention call per layer; batched tokens equal solo runs'
    for d2f and lopa k=4 (fp32), and the pooled forward's logits equal the per-request path's within tolerance."""
    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2, num_heads=8, hidden_size=512),
                         seed=0, sharpen=6).cuda()
    ps = [p.cuda() for p in prompts((5, 40, 17, 90), seed=1)]
    for k, full in ((1, False), (4, True)):
        kw = knobs(k, full, 8)
        solo = [lopa_fast.generate(model, p, "lopa", "fast", **kw) for p in ps]
        outs = lopa_fast.generate(model, ps, "lopa", "fast", **kw)
        for o, s in zip(outs, solo):
            assert o.generated_ids == s.generated_ids and o.stats["forwards"] == s.stats["forwards"]
        cfg = bound(model, **kw)
        sched = batch.Scheduler(model, cfg, spec=spec_of(cfg))
        for p in ps:
            sched.submit(p)
        sched.step()
        plan = [(rid, dec, dec.next_bucket()) for rid, dec in sched.live.items()]
        plan = [x for x in plan if x[2] is not None]
        assert len(plan) >= 2
        parts = [dict(dec.forward_args(dec.prepare(*b)), slot=sched.slot_of[rid]) for rid, dec, b in plan]
        b = plan[0][1].geo.attn_backend
        assert b in ("triton", "cuda")
        pooled = model.forward_requests(parts, plan[0][1].mode, b, pool=(sched.pool.k, sched.pool.v))
        loop = model.forward_requests(parts, plan[0][1].mode, b)
        for (la, ka, _), (lb, kb, _) in zip(pooled, loop):
            torch.testing.assert_close(la, lb, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(ka, kb, atol=1e-4, rtol=1e-4)


def test_pooled_apd_batch_tokens_equal_solo_triton(monkeypatch):
    """APD on the Triton backend (interpreter, one-layer drafter and verifier): every step's drafter forward of two
    or more requests is ONE pooled call over the KV pool (a step with one live request left attends over its own
    slot views, as a solo request does), the verifier's forward one call over the requests' own caches (no pool);
    tokens, forwards and acceptance counts equal the solo runs'."""
    monkeypatch.setenv("LOPA_FAST_BACKEND", "triton")
    d = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2, num_layers=1), seed=2, sharpen=6)
    q = random_model(tiny_hf_config("qwen2", vocab_size=64, num_kv_heads=2, num_layers=1), seed=3, sharpen=6)
    kw = dict(strategy="apd", backend="fast", apd_mixture_weight=0.7, kv_window=2, max_lookahead=4, max_new_tokens=8,
              eos_token_id=61, verifier=q)
    ps = prompts((4, 9), seed=8)
    solo = [lopa_fast.generate(d, p, **kw) for p in ps]
    seen = []
    for m, name in ((d, "drafter"), (q, "verifier")):
        real = m.forward_requests
        monkeypatch.setattr(m, "forward_requests", lambda parts, mode, b=None, pool=None, real=real, name=name: (
            seen.append((name, b, pool is not None, len(parts) > 1)) or real(parts, mode, b, pool=pool)))
    outs = lopa_fast.generate(d, ps, **kw)
    assert {("drafter", "triton", True, True), ("verifier", "triton", False, True)} <= set(seen)
    assert all(pooled == (n == "drafter" and many) for n, _, pooled, many in seen)
    assert {b for _, b, _, _ in seen} == {"triton"}
    for o, s in zip(outs, solo):
        same(o, s, ("forwards", "dllm_forwards", "verifier_forwards", "acceptance_counts"))
