"""dParallel's certainty forcing (lopa_fast.train.certainty_forcing): the loss on a hand-computed case, the
complementary masks, the teacher-trajectory filter, and a short distillation run lowering the masked entropy."""
import math

import pytest
import torch

from lopa_fast import tasks
from lopa_fast.train import certainty_forcing as cf
from lopa_fast.train import d2f
from lopa_fast.train import greedy
from lopa_fast.train.data import make_batch

GEN = tasks.arith_var.GEN_LEN
TOK = tasks.TOKENIZERS["arith-var"].build_tokenizer()


def _reference_trajectories(n=24, seed=5) -> cf.Trajectories:
    """Stand-in teacher output: the task's own solutions (the tiny test models cannot solve the task)."""
    b = make_batch(tasks.generate_task("arith-var", "train", n, seed=seed), TOK, GEN)
    prompts = [b.ids[i, : int(b.prompt_lens[i])].tolist() for i in range(n)]
    resp = torch.stack([b.ids[i, int(b.prompt_lens[i]) : int(b.lens[i])] for i in range(n)])
    return cf.Trajectories(prompts, resp, b.answers, n)


def _tiny(seed=0):
    cfg = d2f.hf_config(TOK.get_vocab_size(), 32, 1, 2, 1, 64, 160)
    return d2f.init_model(cfg, seed)


def test_view_terms_hand_computed():
    # one example, n = 3 positions, V = 3: logits at j - 1 predict position j; positions 1 and 2 masked
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    targets = torch.tensor([[0, 0, 1]])  # position 1 <- logits[0] (argmax 0, right); 2 <- logits[1] (argmax 1, right)
    masked = torch.tensor([[False, True, True]])
    ce, h = cf.view_terms(logits, targets, masked, temperature=0.5)

    def lse(xs):
        return math.log(sum(math.exp(x) for x in xs))

    ce1 = lse([2, 0, 0]) - 2  # -log softmax([2, 0, 0])[0]
    ce2 = lse([0, 1, 0]) - 1

    def ent(xs):  # entropy of softmax(xs / 0.5)
        z = [x / 0.5 for x in xs]
        p = [math.exp(v - lse(z)) for v in z]
        return -sum(q * math.log(q) for q in p)

    assert ce.item() == pytest.approx((ce1 + ce2) / 2, rel=1e-6)
    assert h.item() == pytest.approx((ent([2, 0, 0]) + ent([0, 1, 0])) / 2, rel=1e-6)
    # a wrong prediction counts in CE but not in H; no correct position -> H = 0
    ce, h = cf.view_terms(logits, torch.tensor([[0, 2, 1]]), masked, 0.5)
    assert ce.item() == pytest.approx((lse([2, 0, 0]) - 0 + ce2) / 2, rel=1e-6)
    assert h.item() == pytest.approx(ent([0, 1, 0]), rel=1e-6)
    _, h = cf.view_terms(logits, torch.tensor([[0, 2, 2]]), masked, 0.5)
    assert h.item() == 0.0


def test_total_loss_is_ce_plus_lambda_h_over_both_views():
    traj = _reference_trajectories(4)
    ids, plens, lens = cf.batch_of(traj, [0, 1, 2, 3])
    model = _tiny().eval()
    with torch.no_grad():
        l0, parts = cf.certainty_forcing_loss(model, ids, plens, lens, torch.Generator().manual_seed(3), lam=0.0)
        l2, parts2 = cf.certainty_forcing_loss(model, ids, plens, lens, torch.Generator().manual_seed(3), lam=2.0)
    assert parts == parts2
    assert float(l0) == pytest.approx(parts["ce"] + parts["ce'"], rel=1e-5)
    assert float(l2) == pytest.approx(parts["ce"] + parts["ce'"] + 2 * (parts["h"] + parts["h'"]), rel=1e-5)


def test_complementary_masks_cover_the_segment_exactly():
    plens, lens = torch.tensor([3, 5, 4]), torch.tensor([3 + 20, 5 + 20, 4 + 20])
    n = 30
    m, c = cf.complementary_masks(plens, lens, n, torch.Generator().manual_seed(0))
    j = torch.arange(n)[None]
    segment = (j >= plens[:, None]) & (j < lens[:, None])
    assert torch.equal(m | c, segment) and not (m & c).any()
    big = cf.complementary_masks(torch.zeros(1, dtype=torch.long), torch.tensor([20000]), 20000,
                                 torch.Generator().manual_seed(1))[0]
    assert abs(big.float().mean().item() - 0.5005) < 0.02  # p = (1 - 1e-3) 0.5 + 1e-3


def test_semiar_masks_clean_blocks_then_one_active_block_then_masks():
    """Spec 4.3's LLaDA variant, checked per row against its definition: a prefix of whole clean blocks, one active
    block split between the two views, everything after it masked in both; every j in [0, R // B] is drawn."""
    B, R, n = 8, 24, 40
    plens = torch.tensor([3, 5, 4] * 40)
    lens = plens + R
    m, c = cf.semiar_masks(plens, lens, n, torch.Generator().manual_seed(0), block=B)
    seen = set()
    for r in range(len(plens)):
        P, L = int(plens[r]), int(lens[r])
        both, either = (m[r] & c[r]).nonzero().flatten().tolist(), (m[r] | c[r]).nonzero().flatten().tolist()
        assert not (m[r, :P] | c[r, :P]).any() and not (m[r, L:] | c[r, L:]).any()
        first = either[0] if either else L  # the active block's start: a block boundary after the prompt
        j = (first - P) // B
        assert (first - P) % B == 0 or not either
        hi = min(P + (j + 1) * B, L)
        assert both == list(range(hi, L))  # the suffix is masked in both views
        assert either == list(range(P + j * B, L))  # the active block is split: each position in exactly one view
        seen.add(j)  # j = R // B (B divides R): no active position, the row only reads (upstream's draw)
    assert seen == set(range(R // B + 1))


@pytest.mark.parametrize("order", ["entropy", "left_to_right"])
def test_trajectories_keep_only_correct_answers(monkeypatch, order):
    problems = tasks.generate_task("arith-var", "train", 6, seed=1)

    def fake_fill(model, batch, gen_len, alg="max_prob"):  # the reference answers, rows 1 and 4 wrong
        assert alg == order  # the teacher's fill order (train.greedy's alg) reaches the decode
        rows = torch.arange(len(batch.ids))[:, None]
        out = batch.ids[rows, batch.prompt_lens[:, None] + torch.arange(gen_len)[None]].clone()
        out[[1, 4]] = TOK.token_to_id("7")
        return out

    monkeypatch.setattr(greedy, "greedy_fill", fake_fill)
    traj = cf.collect_trajectories(_tiny(), problems, TOK, GEN, batch_size=8, order=order)
    assert traj.kept == 4 and traj.total == 6
    assert traj.answers == [problems[i].answer for i in (0, 2, 3, 5)]
    monkeypatch.setattr(greedy, "greedy_fill", lambda m, b, g, alg: torch.full((len(b.ids), g), 3))
    with pytest.raises(ValueError, match="none of the teacher"):
        cf.collect_trajectories(_tiny(), problems, TOK, GEN)


def test_bad_trajectory_order_or_views_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="traj_order='diagonal'; allowed: max_prob, entropy, left_to_right"):
        cf.train(tmp_path / "x", log=lambda *_: None, traj_order="diagonal")
    with pytest.raises(ValueError, match="views='blocks'; allowed: dream, semiar"):
        cf.train(tmp_path / "y", log=lambda *_: None, views="blocks")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_short_distillation_lowers_masked_entropy(tmp_path):
    """24 steps on a tiny model lower the mean masked entropy, and the entropy term lowers it further than the
    cross-entropy alone (lam = 0; same seed, data and masks: measured 4.85 -> 4.06 nats vs 4.28)."""
    traj = _reference_trajectories(24)
    opts = dict(teacher="unused", steps=24, batch=8, lr=5e-3, warmup=2, eval_every=0, eval_n=1, threads=1,
                ckpt_every=0)
    forced = cf.train(tmp_path / "s", log=lambda *_: None, teacher_model=_tiny(0), trajectories=traj, **opts)
    plain = cf.train(tmp_path / "ce", log=lambda *_: None, teacher_model=_tiny(0), trajectories=traj, lam=0.0, **opts)
    assert forced["masked_entropy_after"] < forced["masked_entropy_before"] - 0.5, forced
    assert forced["masked_entropy_after"] < plain["masked_entropy_after"] - 0.1, (forced, plain)
    assert (tmp_path / "s" / "model.safetensors").is_file() and (tmp_path / "s" / cf.TRAJ_FILE).is_file()
    assert "masked_entropy" in (tmp_path / "s" / "training_log.txt").read_text()


def test_a_resumed_distillation_is_the_uninterrupted_one(tmp_path):
    from safetensors.torch import load_file

    traj = _reference_trajectories(8)
    opts = dict(teacher="unused", steps=4, batch=2, lr=1e-3, warmup=1, eval_every=0, eval_n=1, threads=1,
                ckpt_every=2)
    quiet = lambda *_: None  # noqa: E731
    cf.train(tmp_path / "a", log=quiet, teacher_model=_tiny(0), trajectories=traj, **opts)
    cf.train(tmp_path / "b", log=quiet, teacher_model=_tiny(0), trajectories=traj, stop_at=2, **opts)
    assert torch.load(tmp_path / "b" / "resume.pt", weights_only=False)["step"] == 2
    with pytest.raises(ValueError, match="differ"):
        cf.train(tmp_path / "b", log=quiet, resume=True, teacher_model=_tiny(0), **{**opts, "lr": 1.0})
    cf.train(tmp_path / "b", log=quiet, resume=True, teacher_model=_tiny(0), **opts)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown options"):
        cf.train(tmp_path, nope=1)
    with pytest.raises(ValueError, match="mask_t"):
        cf.train(tmp_path, mask_t=1.0)
    with pytest.raises(ValueError, match="eval_block"):
        cf.train(tmp_path, eval_block=5)
    with pytest.raises(FileNotFoundError, match="no training state"):
        cf.train(tmp_path / "none", resume=True)


def test_training_continues_after_the_decode_monitor():
    """The mid-run monitor decodes through lopa_fast.generate, whose fast backend fuses the weights under inference
    mode; it must leave the training model trainable (a real run died at its first mid-run eval before the fix)."""
    traj = _reference_trajectories(2)
    ids, plens, lens = cf.batch_of(traj, [0, 1])
    model = _tiny().train()
    cf.decode_eval(model, TOK, tasks.generate_task("arith-var", "dev", 1, seed=0), GEN, 0.45, 8)
    loss, _ = cf.certainty_forcing_loss(model, ids, plens, lens, torch.Generator().manual_seed(1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
