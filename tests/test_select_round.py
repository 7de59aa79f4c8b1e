"""select_round on every backend: a loop-by-loop oracle written from the spec checks the reference (torch); the
Triton kernel, the CUDA kernel (host emulation, GPU) must match the reference exactly on
discrete outputs (accept, lookahead, winner), ties included."""
from __future__ import annotations

import pytest
import torch

from lopa_fast import ops
from lopa_fast.reference import ops as ref
from tests.utils import (  # noqa: F401 - cuda_emu, cuda_kernels: fixtures
    DEVICE,
    cuda_emu,
    cuda_kernels,
    poisoned_empty,
    random_round,
)

CMP = {"gt": lambda v, t: v > t, "ge": lambda v, t: v >= t, "le": lambda v, t: v <= t}


def oracle(val, conf, masked, blk, complete, tau, comparator, n_look, topp, alpha, cc, active):
    """Per-branch Python loops straight from docs/semantics.md sections 2-3 (no tensor tricks)."""
    B, n = conf.shape
    accept = [[False] * n for _ in range(B)]
    looks, scores = [], []
    for b in range(B):
        c = conf[b].tolist()
        for i in range(n):
            if masked[b, i] and blk[b, i] >= 0 and CMP[comparator](val[b, i].item(), tau):
                accept[b][i] = True
        for j in range(complete.shape[1]):
            M = [i for i in range(n) if masked[b, i] and blk[b, i] == j]
            if complete[b, j] and M and not any(accept[b][i] for i in M):
                best = M[0]
                for i in M:  # strict '>' keeps the earliest arg-max
                    if c[i] > c[best]:
                        best = i
                accept[b][best] = True
        P = [i for i in range(n) if masked[b, i] and blk[b, i] >= 0 and not accept[b][i]]
        ranked = sorted(P, key=lambda i: c[i], reverse=True)[:n_look]  # Python's sort is stable
        looks.append(ranked + [-1] * (n_look - len(ranked)))
        rem = sorted(c[i] for i in range(n) if masked[b, i])
        if not rem:
            future = 1.0
        else:
            k = max(1, int(len(rem) * topp))
            future = sum(rem[:k]) / k
        ccb = 1.0 if cc is None else cc[b].item()
        scores.append(alpha * ccb + (1 - alpha) * future)
    order = [b for b in range(B) if active is None or active[b]]
    winner = -1
    for b in order:  # strict '>' keeps the earliest branch on ties
        if winner < 0 or scores[b] > scores[winner]:
            winner = b
    return torch.tensor(accept), torch.tensor(looks, dtype=torch.long).reshape(B, n_look), torch.tensor(scores), winner


def make_inputs(B, n, nb, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    val = torch.rand(B, n, generator=g)
    conf = torch.rand(B, n, generator=g)
    if ties:  # a coarse grid: many exact ties in conf, in val and between branch scores
        val, conf = (val * 4).round() / 4, (conf * 4).round() / 4
    masked = torch.rand(B, n, generator=g) < 0.7
    # active blocks of size 4 starting after a random to_cache span; -1 before it and on padding
    start = torch.randint(0, n // 2, (B,), generator=g)
    pos = torch.arange(n)
    blk = torch.where(pos[None] >= start[:, None], (pos[None] - start[:, None]) // 4, -1)
    blk = torch.where(blk >= nb, -1, blk)
    wl = torch.randint(n // 2, n + 1, (B,), generator=g)  # ragged windows: padding at the tail
    pad = pos[None] >= wl[:, None]
    blk = blk.masked_fill(pad, -1)
    masked = masked & ~pad & (blk >= 0)
    conf = conf.masked_fill(~masked, float("nan"))  # never read outside the candidates
    complete = torch.rand(B, nb, generator=g) < 0.6
    cc = torch.rand(B, generator=g)
    active = torch.rand(B, generator=g) < 0.8
    return [t.to(DEVICE) for t in (val, conf, masked, blk, complete)], cc.to(DEVICE), active.to(DEVICE)


CASES = [
    # comparator, tau, n_look, topp, alpha, use creation_conf/active
    ("gt", 0.5, 3, 1.0, 0.0, False),  # D2F / LoPA defaults
    ("ge", 0.5, 0, 1.0, 0.0, False),  # Fast-dLLM threshold
    ("le", 0.5, 5, 0.3, 0.25, True),  # dParallel entropy threshold, bottom-p score, alpha mixing
    ("gt", 0.75, 8, 0.7, 1.0, True),
]


@pytest.mark.parametrize("ties", [False, True], ids=["tie_free", "ties"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-look{c[2]}-topp{c[3]}-a{c[4]}")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_select_round_matches_oracle(backend, case, ties):
    comparator, tau, n_look, topp, alpha, extras = case
    for seed, (B, n, nb) in enumerate([(5, 24, 4), (1, 9, 2), (3, 40, 6)]):
        (val, conf, masked, blk, complete), cc, active = make_inputs(B, n, nb, seed, ties)
        kw = dict(creation_conf=cc if extras else None, branch_active=active if extras else None)
        with poisoned_empty():
            out = ops.select_round(val, conf, masked, blk, complete, tau, comparator, n_look, topp, alpha, **kw,
                                   backend=backend)
        acc, look, score, winner = oracle(val.cpu(), conf.cpu(), masked.cpu(), blk.cpu(), complete.cpu(), tau,
                                          comparator, n_look, topp, alpha, kw["creation_conf"],
                                          kw["branch_active"])
        assert out.accept.dtype == torch.bool and torch.equal(out.accept.cpu(), acc), (seed, out.accept, acc)
        assert torch.equal(out.lookahead.cpu(), look), (seed, out.lookahead, look)
        assert out.score.dtype == torch.float32
        torch.testing.assert_close(out.score.cpu(), score.float(), atol=1e-6, rtol=1e-6)
        if not ties:  # tie-free: the winner is well defined under fp32 rounding of the mean
            assert out.winner.item() == winner, (seed, out.score, score)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["tie_free", "ties"])
def test_select_round_triton_equals_reference(ties, dtype):
    """Same fp32 maths in the same order of ties: every output identical, winner included (fp16 inputs are
    upcast exactly by both)."""
    for seed in range(2):
        (val, conf, masked, blk, complete), cc, active = make_inputs(6, 33, 5, 10 + seed, ties)
        val, conf, cc = val.to(dtype), conf.to(dtype), cc.to(dtype)
        args = (val, conf, masked, blk, complete, 0.5, "gt", 4, 0.5, 0.5, cc, active)
        a = ops.select_round(*args, backend="triton")
        b = ops.select_round(*args, backend="torch")
        assert torch.equal(a.accept, b.accept) and torch.equal(a.lookahead, b.lookahead)
        assert a.winner.item() == b.winner.item()
        torch.testing.assert_close(a.score, b.score, atol=1e-6, rtol=1e-6)


def test_select_round_branch_groups_keep_earliest_winner():
    """Windows wider than one tile step: the kernel walks branches in groups and must keep the earliest
    of equal best scores across groups (scores here are exact in fp32: multiples of 1/4 over 4 masks)."""
    from lopa_fast.kernels.triton.select_round import select_round as tri

    B, n = 7, 20
    conf = torch.full((B, n), 0.5)
    masked = torch.zeros(B, n, dtype=torch.bool)
    masked[:, :4] = True
    conf[:, :4] = torch.tensor([0.25, 0.5, 0.75, 1.0])  # every branch scores 0.625 ...
    conf[3, 0] = 0.0  # ... except branch 3 (lower) and branches 4 and 6 (higher, equal)
    conf[4, 0] = conf[6, 0] = 0.5
    blk = torch.zeros(B, n, dtype=torch.long)
    args = [t.to(DEVICE) for t in (conf.clone(), conf, masked, blk, torch.ones(B, 1, dtype=torch.bool))]
    want = ref.select_round(*args, 0.9, "gt", 2)
    assert want.winner.item() == 4
    for lanes in (32, 64, 4096):  # 1, 2 and all 7 branches per step
        acc, look, score, winner = tri(*args, 0.9, "gt", 2, max_lanes=lanes)
        assert winner.item() == 4 and torch.equal(acc, want.accept) and torch.equal(look, want.lookahead)
        assert torch.equal(score, want.score.float())


def test_select_round_by_hand():
    # one branch, 6 positions, blocks [0,0,0,1,1,1], block 1 complete; nothing passes tau = 0.9
    conf = torch.tensor([[0.2, 0.5, 0.5, 0.3, 0.7, 0.7]])
    val = conf.clone()
    masked = torch.ones(1, 6, dtype=torch.bool)
    blk = torch.tensor([[0, 0, 0, 1, 1, 1]])
    complete = torch.tensor([[False, True]])
    for backend in ("torch", "triton"):
        s = ops.select_round(val.to(DEVICE), conf.to(DEVICE), masked.to(DEVICE), blk.to(DEVICE),
                             complete.to(DEVICE), 0.9, "gt", 3, backend=backend)
        # fallback only in the complete block 1, earliest of the tied 0.7s; lookahead: 0.7, then tied 0.5s
        assert s.accept.cpu().tolist() == [[False, False, False, False, True, False]]
        assert s.lookahead.cpu().tolist() == [[5, 1, 2]]
        assert abs(s.score.item() - sum([0.2, 0.5, 0.5, 0.3, 0.7, 0.7]) / 6) < 1e-6
        assert s.winner.item() == 0


def test_select_round_no_active_branch_gives_minus_one():
    (val, conf, masked, blk, complete), cc, _ = make_inputs(3, 12, 3, 0)
    none = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    for backend in ("torch", "triton"):
        s = ops.select_round(val, conf, masked, blk, complete, 0.5, branch_active=none, backend=backend)
        assert s.winner.item() == -1 and s.lookahead.shape == (3, 0)


@pytest.mark.parametrize(
    "change, err, word",
    [
        (dict(conf=torch.rand(2, 8, 1)), ValueError, "conf"),
        (dict(masked=torch.ones(2, 7, dtype=torch.bool)), ValueError, "masked"),
        (dict(block_ids=torch.zeros(2, 8)), TypeError, "block_ids"),
        (dict(block_complete=torch.ones(3, 2, dtype=torch.bool)), ValueError, "block_complete"),
        (dict(comparator="lt"), ValueError, "comparator"),
        (dict(tau=float("nan")), ValueError, "tau"),
        (dict(n_look=9), ValueError, "n_look"),
        (dict(topp=0.0), ValueError, "topp"),
        (dict(alpha=1.5), ValueError, "alpha"),
        (dict(creation_conf=torch.rand(3)), ValueError, "creation_conf"),
        (dict(branch_active=torch.ones(2)), TypeError, "branch_active"),
        (dict(backend="mps"), ValueError, "backend"),
    ],
)
def test_select_round_bad_input(change, err, word):
    a = dict(accept_value=torch.rand(2, 8), conf=torch.rand(2, 8), masked=torch.ones(2, 8, dtype=torch.bool),
             block_ids=torch.zeros(2, 8, dtype=torch.long), block_complete=torch.ones(2, 2, dtype=torch.bool),
             tau=0.5)
    a.update(change)
    with pytest.raises(err, match=word):
        ops.select_round(**a)


# ----------------------------------------------------------------------------------------------------------------
# CUDA kernel (kernels/cuda/select_round.cu): host emulation on CPU, then a GPU (`gpu`).


def check_round(cuda_emu, *args):
    got, want = cuda_emu.select_round(*args), ref.select_round(*args)
    assert torch.equal(got.accept, want.accept)
    assert torch.equal(got.lookahead, want.lookahead)
    torch.testing.assert_close(got.score, want.score, atol=1e-6, rtol=1e-6)  # summation order: <= 1 ulp
    assert got.winner.item() == want.winner.item()
    return got


# B > 8 makes warps loop over branches; n > 32 gives lanes several positions; nb up to 4 fallback blocks
@pytest.mark.parametrize("B,n,nb,seed", [(3, 16, 2, 0), (9, 70, 4, 1), (1, 7, 1, 2), (4, 64, 2, 3)])
@pytest.mark.parametrize("cmp,tau,n_look,topp,alpha", [("gt", 0.9, 3, 0.5, 0.3), ("ge", 0.95, 0, 1.0, 0.0),
                                                       ("le", 0.05, 5, 0.25, 0.7)])
def test_cuda_emu_select_round_matches_reference(cuda_emu, B, n, nb, seed, cmp, tau, n_look, topp, alpha):
    value, conf, masked, bid, complete, cc, active = random_round(B, n, nb, seed)
    check_round(cuda_emu, value, conf, masked, bid, complete, tau, cmp, n_look, topp, alpha, cc, active)


def test_cuda_emu_select_round_ties_padding_and_unread_nan(cuda_emu):
    """Equal branches -> the earliest wins; more lookahead slots than candidates -> -1 padding; NaN at
    unmasked positions is never read; bf16 conf is upcast like the reference."""
    value, conf, masked, bid, complete, _, _ = random_round(1, 12, 2, 4)
    rep = lambda t: t.expand(3, *t.shape[1:]).clone()  # noqa: E731
    value, conf, masked, bid, complete = map(rep, (value, conf, masked, bid, complete))
    conf[~masked] = float("nan")
    got = check_round(cuda_emu, value, conf.to(torch.bfloat16), masked, bid, complete, 0.5, "gt", 12, 1.0, 0.0, None,
                      None)
    assert got.winner.item() == 0 and (got.lookahead[:, -1] == -1).all()
    none_active = torch.zeros(3, dtype=torch.bool)
    got = check_round(cuda_emu, value, conf, masked, bid, complete, 0.5, "gt", 2, 1.0, 0.0, None, none_active)
    assert got.winner.item() == -1


@pytest.mark.parametrize("B,n,nb", [(3, 32, 1), (9, 64, 2), (16, 128, 4), (1, 1000, 3)])
@pytest.mark.parametrize("cmp,tau,n_look,topp,alpha", [("gt", 0.9, 2, 0.5, 0.3), ("le", 0.05, 15, 1.0, 0.0)])
@pytest.mark.gpu
def test_select_round_cuda_matches_reference(cuda_kernels, B, n, nb, cmp, tau, n_look, topp, alpha):
    args = [t.cuda() for t in random_round(B, n, nb, seed=B)]
    value, conf, masked, bid, complete, cc, active = args
    call = (value, conf, masked, bid, complete, tau, cmp, n_look, topp, alpha, cc, active)
    with poisoned_empty():
        got = ops.select_round(*call, backend="cuda")
    want = ref.select_round(*call)
    assert torch.equal(got.accept, want.accept) and torch.equal(got.lookahead, want.lookahead)
    torch.testing.assert_close(got.score, want.score, atol=1e-6, rtol=1e-6)
    assert got.winner.item() == want.winner.item()


def test_explicit_cuda_refuses_windows_over_the_kernel_limit(monkeypatch):
    """backend="cuda" with n > 1024 positions raises naming why (it used to run the reference silently)."""
    from lopa_fast.ops import cuda
    from lopa_fast.ops.cuda import probe

    monkeypatch.setattr(probe, "probe", lambda: None)  # as on a GPU machine with CuPy
    value, conf, masked, bid, complete, _, _ = random_round(1, 1025, 1, 0)
    with pytest.raises(ValueError, match="window n=1025 is longer than the CUDA kernel's 1024 positions"):
        ops.select_round(value, conf, masked, bid, complete, 0.5, backend="cuda")
    with pytest.raises(ValueError, match="cuda select_round: window n=1025"):
        cuda.select_round(value, conf, masked, bid, complete, 0.5)


# ------------------------------------------------- torch.library registration (Triton, interpreter on CPU)
def test_triton_select_round_custom_op_opcheck_and_fullgraph_compile():
    """lopa_fast::triton_select_round passes torch.library.opcheck (optional tensors given and None) and
    torch.compile(fullgraph=True) traces the public op (namedtuple rebuilt outside the op) with no graph break."""
    value, conf, masked, bid, complete, cc, active = (t.to(DEVICE) for t in random_round(3, 10, 2, seed=5))
    op = torch.ops.lopa_fast.triton_select_round.default
    for args in [(value, conf, masked, bid, complete, 0.5, "gt", 2, 0.8, 0.3, cc, active),
                 (value, conf, masked, bid, complete, 0.4, "ge", 0, 1.0, 0.0, None, None)]:
        torch.library.opcheck(op, args)

    def f(value, conf):
        r = ops.select_round(value, conf, masked, bid, complete, 0.5, "gt", 2, 0.8, 0.3, cc, active,
                             backend="triton", check=False)
        return r.accept, r.lookahead, r.score, r.winner

    want = f(value, conf)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(value, conf)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
