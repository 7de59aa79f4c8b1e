"""The exact posterior of arith-var renderings (train.posterior), the soft-target loss and the policy view."""
import math

import pytest
import torch

from lopa_fast import tasks
from lopa_fast.tasks import arith_var
from lopa_fast.train import d2f
from lopa_fast.train import posterior as post
from lopa_fast.train.data import make_batch
from lopa_fast.train.greedy import fill_orders

G = arith_var.GEN_LEN
TOK = tasks.TOKENIZERS["arith-var"].build_tokenizer()
V = TOK.get_vocab_size()


def _problem(**numbers):
    p = arith_var.generate("dev", 1, seed=2)[0]
    return arith_var.render(p.template, *(numbers.get(k, getattr(p, k)) for k in "abcd"), p.name, p.pron, p.item,
                            p.container, p.choice)


@pytest.mark.parametrize("numbers", [{}, {"b": 3, "c": 3}])  # b == c: two choices render one text
def test_rendering_table_is_the_generator_distribution(numbers):
    p = _problem(**numbers)
    table, w = post.rendering_table(p)
    assert table.shape == (arith_var.n_choices(), G) and math.isclose(float(w.sum()), 1.0)
    got: dict[str, float] = {}
    for row, wi in zip(table.tolist(), w.tolist()):
        text = TOK.decode(row, skip_special_tokens=True)
        got[text] = got.get(text, 0.0) + wi
    want = {tasks.join_digits(" ".join(arith_var.tokens(t))): x for t, x in arith_var.rendering_distribution(p).items()}
    assert got.keys() == want.keys() and all(math.isclose(got[k], want[k]) for k in want)
    # the training layout: a row is what make_batch puts in the region for that rendering
    batch = make_batch([p], TOK, G)
    P = int(batch.prompt_lens[0])
    assert (table == batch.ids[0, P:P + G]).all(1).any()


def test_posterior_marginals():
    p = _problem()
    table, w = post.table_for(p)
    none = torch.zeros(G, dtype=torch.bool)
    q, mass = post.posterior(table, w, table[0], none, V)  # nothing visible: the prior marginals
    assert math.isclose(mass, 1.0) and torch.allclose(q.sum(1), torch.ones(G, dtype=torch.float64))
    bits = -(q * q.clamp_min(1e-300).log2()).sum(1)
    assert torch.allclose(bits, torch.tensor(arith_var.position_entropy(p)[:G], dtype=torch.float64), atol=1e-9)
    q, mass = post.posterior(table, w, table[7], ~none, V)  # everything visible: that rendering, one-hot
    assert math.isclose(mass, float(w[(table == table[7]).all(1)].sum()))
    assert (q.argmax(1) == table[7]).all() and torch.allclose(q.max(1).values, torch.ones(G, dtype=torch.float64))
    wrong = table[0].clone()
    wrong[0] = tasks.vocab()["1"]  # no rendering starts with a digit
    assert post.posterior(table, w, wrong, none | (torch.arange(G) == 0), V) == (None, 0.0)


def test_soft_cross_entropy_is_the_expected_hard_cross_entropy():
    """Hand-computed: for one masked position with visible tokens fixed, sum_r w_r CE(pred, r_j) over the agreeing
    renderings (normalised) equals the soft loss -sum_v q(v) log p(v) with q the posterior marginal."""
    p = _problem()
    table, w = post.table_for(p)
    vis = torch.zeros(G, dtype=torch.bool)
    vis[:3] = True  # the opening's first three tokens: several renderings agree
    state = table[100]
    q, mass = post.posterior(table, w, state, vis, V)
    agree = (table[:, :3] == state[:3]).all(1)
    logp = torch.randn(V, generator=torch.Generator().manual_seed(0), dtype=torch.float64).log_softmax(-1)
    j = 20
    hard = float((w[agree] * -logp[table[agree, j]]).sum() / w[agree].sum())
    soft = float(-(q[j] * logp).sum())
    assert math.isclose(hard, soft, rel_tol=1e-12) and 1 < int(agree.sum()) < len(w)


def test_soft_targets_of_a_clean_batch_are_valid_and_contain_the_clean_token():
    probs = arith_var.generate("train", 6, seed=3)
    batch = make_batch(probs, TOK, G)
    for mode in ("full_uniform", "full_pipe"):
        noisy, masked, lens, _ = d2f.corrupt(batch, mode, 8, G, torch.Generator().manual_seed(4))
        target, valid = post.soft_targets(probs, noisy, masked, batch.prompt_lens, lens, G, V)
        b, pos = masked.nonzero(as_tuple=True)
        assert valid.all() and target.shape == (len(b), V)
        assert torch.allclose(target.sum(1), torch.ones(len(b)), atol=1e-5)
        assert (target[torch.arange(len(b)), batch.ids[b, pos]] > 0).all()


def test_policy_view_keeps_a_prefix_of_the_order_visible():
    probs = arith_var.generate("train", 4, seed=1)
    batch = make_batch(probs, TOK, G)
    g = torch.Generator().manual_seed(0)
    order = torch.stack([torch.randperm(G, generator=g) for _ in range(4)])
    noisy, masked, lens, _ = d2f.corrupt(batch, "full_policy", 8, G, torch.Generator().manual_seed(5), order)
    for i in range(4):
        P = int(batch.prompt_lens[i])
        vis = ~masked[i, P:P + G]
        k = int(vis.sum())
        assert k < G and set(order[i, :k].tolist()) == set(vis.nonzero()[:, 0].tolist())
    with pytest.raises(ValueError, match="full_policy needs order"):
        d2f.corrupt(batch, "full_policy", 8, G, g)


def test_fill_orders_are_permutations():
    cfg = d2f.hf_config(V, 32, 1, 2, 1, 64, max_positions=160)
    model = d2f.init_model(cfg, 0).eval()
    batch = make_batch(arith_var.generate("dev", 3, seed=0), TOK, G)
    assert (fill_orders(model, batch, G, alg="left_to_right") == torch.arange(G)).all()
    order = fill_orders(model, batch, G)
    assert (order.sort(1).values == torch.arange(G)).all()


def test_policy_schedule_with_soft_targets_trains_and_resumes(tmp_path):
    """A tiny run on the policy schedule with soft targets: a run stopped and resumed at a multiple of
    policy_every, or inside a pool's epoch, equals the uninterrupted run bit for bit; soft targets need arith-var."""
    from safetensors.torch import load_file

    kw = dict(log=lambda *_: None, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, batch=4, gen_len=96,
              max_positions=160, task="arith-var", warmup=2, eval_every=0, eval_n=2, threads=1, steps=8,
              ckpt_every=4, schedule="policy", soft_targets=1, policy_pool=3, policy_every=4)
    d2f.train(tmp_path / "a", **kw)
    d2f.train(tmp_path / "b", stop_at=4, **kw)
    d2f.train(tmp_path / "b", resume=True, **kw)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # stopped inside an epoch of the pool (step 6 of policy_every 4): the pool's orders come from the checkpoint
    d2f.train(tmp_path / "d", stop_at=6, **kw)
    d2f.train(tmp_path / "d", resume=True, **kw)
    wd = load_file(tmp_path / "d" / "model.safetensors")
    assert all(torch.equal(wa[k], wd[k]) for k in wa)
    assert (tmp_path / "a" / "training_log.txt").read_text().count("policy pool of 3 problems") == 2
    with pytest.raises(ValueError, match="soft_targets=1 needs task arith-var"):
        d2f.train(tmp_path / "c", **{**kw, "task": "arith", "gen_len": 32, "max_positions": 128})
    with pytest.raises(ValueError, match="soft_targets=2"):
        d2f.train(tmp_path / "c", **{**kw, "soft_targets": 2})


def test_posterior_probe_counts_off_distribution_decodes():
    """An untrained model writes junk: every decode leaves the renderings, at its first fill already where the
    posterior is spread or determined; the counts are consistent."""
    from lopa_fast.train.diagnose import posterior_probe

    cfg = d2f.hf_config(V, 32, 1, 2, 1, 64, max_positions=160)
    model = d2f.init_model(cfg, 0).eval()
    r = posterior_probe(model, arith_var.generate("dev", 2, seed=0), TOK)
    assert r["n"] == 2 and r["correct"] == 0 and r["off"] == 2 and 0 <= r["off_determined"] <= 2
    assert r["first_step"] is not None and r["first_step"] < 96
