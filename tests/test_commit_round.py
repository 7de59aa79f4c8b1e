"""commit_round (a D2F / LoPA round's commit in place): the Triton kernel (interpreter on CPU) writes exactly the
reference's cache rows (every row but the trash row, which the kernel leaves alone) and last_logit, for any winner,
span, prefix length and last_row (the no-update cases included); bad inputs raise; the custom op (mutating) passes
opcheck and compiles without a graph break; a compiled round on the Triton backend commits through it."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.reference import ops as ref


def _inputs(dtype, L=3, Lc=20, Hkv=2, D=8, NB=3, Nb=6, V=50, R=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(cache_k=r(L, Lc, Hkv, D), cache_v=r(L, Lc, Hkv, D), k_win=r(L, NB, Nb, Hkv, D),
                v_win=r(L, NB, Nb, Hkv, D), last_logit=r(V), logits=r(R, V))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernel_writes_what_the_reference_writes(dtype):
    g = torch.Generator().manual_seed(1)
    for trial in range(12):
        t = _inputs(dtype, seed=trial)
        scal = lambda hi: torch.tensor(int(torch.randint(0, hi, (1,), generator=g)))  # noqa: E731
        cl, W, u, lr = scal(14), scal(3), scal(7), scal(8)
        if trial == 0:
            u = torch.tensor(0)  # nothing committed: no row, last_logit stays
        if trial == 1:
            lr = torch.tensor(0)  # the span's last raw row is the stale one: last_logit stays
        for shift in (True, False):
            a = {k: v.clone() for k, v in t.items()}
            b = {k: v.clone() for k, v in t.items()}
            last = (lambda d: (d["last_logit"], d["logits"], lr)) if shift else (lambda d: (None, None, None))
            ops.commit_round(a["cache_k"], a["cache_v"], cl, a["k_win"], a["v_win"], W, u, *last(a), backend="triton")
            ref.commit_round(b["cache_k"], b["cache_v"], cl, b["k_win"], b["v_win"], W, u, *last(b))
            for k in ("cache_k", "cache_v"):
                assert torch.equal(a[k][:, :-1], b[k][:, :-1]), (trial, k)
                assert torch.equal(a[k][:, -1], t[k][:, -1])  # the trash row: untouched by the kernel
            assert torch.equal(a["last_logit"], b["last_logit"]), trial
            if trial in (0, 1) and shift:
                assert torch.equal(a["last_logit"], t["last_logit"])


def test_bad_inputs_raise():
    t = _inputs(torch.float32)
    z = torch.tensor(0)
    args = lambda **o: {**dict(cache_k=t["cache_k"], cache_v=t["cache_v"], cache_len=z, k_win=t["k_win"],  # noqa: E731
                                v_win=t["v_win"], winner=z, u=z), **o}
    with pytest.raises(ValueError, match="one \\[layers, Lc, Hkv, D\\] shape"):
        ops.commit_round(**args(cache_v=t["cache_v"][:, :3]))
    with pytest.raises(ValueError, match="matching the cache"):
        ops.commit_round(**args(k_win=t["k_win"][:2], v_win=t["v_win"][:2]))
    with pytest.raises(TypeError, match="one dtype"):
        ops.commit_round(**args(k_win=t["k_win"].half(), v_win=t["v_win"].half()))
    with pytest.raises(ValueError, match="u must be a 0-d int tensor"):
        ops.commit_round(**args(u=torch.tensor([1])))
    with pytest.raises(ValueError, match="needs logits \\[R, V\\]"):
        ops.commit_round(**args(last_logit=t["last_logit"], logits=t["logits"][:, :9], last_row=z))
    with pytest.raises(ValueError, match="last_row must be"):
        ops.commit_round(**args(last_logit=t["last_logit"], logits=t["logits"], last_row=None))


def test_custom_op_opcheck_and_compile():
    t = _inputs(torch.float32)
    cl, W, u, lr = torch.tensor(3), torch.tensor(1), torch.tensor(4), torch.tensor(2)
    op = torch.ops.lopa_fast.triton_commit_round.default
    torch.library.opcheck(op, (t["cache_k"].clone(), t["cache_v"].clone(), cl, t["k_win"], t["v_win"], W, u,
                               t["last_logit"].clone(), t["logits"], lr))
    torch.library.opcheck(op, (t["cache_k"].clone(), t["cache_v"].clone(), cl, t["k_win"], t["v_win"], W, u, None,
                               None, None))

    def commit(ck, cv, last):
        ops.commit_round(ck, cv, cl, t["k_win"], t["v_win"], W, u, last, t["logits"], lr, check=False,
                         backend="triton")
        return ck.sum() + last.sum()

    a = [t[k].clone() for k in ("cache_k", "cache_v", "last_logit")]
    b = [t[k].clone() for k in ("cache_k", "cache_v", "last_logit")]
    torch.compile(commit, backend="aot_eager", fullgraph=True)(*a)
    commit(*b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_compiled_round_commits_through_it(monkeypatch):
    """A compiled (emulated-capture) LoPA round with the fused head: one commit_round and one first_bad a round (no
    masked index_copy_, no last_logit select ops), tokens equal the eager run's."""
    import warnings

    import lopa_fast
    from lopa_fast.decode.compiled import CompiledRounds
    from lopa_fast.testing import random_model, tiny_hf_config
    from tests.utils import emulated_capture

    model = random_model(tiny_hf_config("dream", vocab_size=64, num_layers=1), seed=2, sharpen=6)
    kw = dict(block_size=4, max_new_tokens=12, eos_token_id=5, branching_factor=2, use_full_attention=True)
    p = torch.arange(3, 10)
    monkeypatch.setenv("LOPA_FAST_FUSED_HEAD", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = lopa_fast.generate(model, p, "lopa", "fast", **kw)
        calls = []
        for name in ("commit_round", "first_bad"):
            real = getattr(ops, name)
            monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
        monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
        CompiledRounds.for_model(model).emulate_graphs = True
        got = lopa_fast.generate(model, p, "lopa", "fast", compile=True, **kw)
    assert got.generated_ids == want.generated_ids
    # every compiled round commits through the op; the eager prefill round (host ints) keeps its two slice copies
    assert calls.count("commit_round") >= 2 and calls.count("first_bad") == calls.count("commit_round") + 1
