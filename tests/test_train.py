"""The D2F recipe: masking views are well-formed and a few training steps lower the loss."""
import pytest
import torch

import lopa_fast
from lopa_fast import tasks
from lopa_fast.train import d2f
from lopa_fast.train.data import block_ids_for, make_batch

TINY = dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, batch=16, gen_len=40, block_size=8)


def _batch(n=16, seed=0):
    return make_batch(tasks.generate("train", n, seed=seed), tasks.build_tokenizer(), 40)


def test_block_ids_follow_the_prompt():
    b = _batch(4)
    bids = block_ids_for(b.prompt_lens, b.ids.shape[1], 8)
    for i in range(4):
        P = int(b.prompt_lens[i])
        assert (bids[i, :P] == 0).all()
        assert bids[i, P : P + 40].tolist() == [1 + j // 8 for j in range(40)]


@pytest.mark.parametrize("mode", d2f.MODES)
def test_corrupt_masks_only_generated_positions(mode):
    b = _batch(32)
    g = torch.Generator().manual_seed(1)
    order = torch.stack([torch.randperm(40, generator=g) for _ in range(32)]) if mode == "full_policy" else None
    noisy, masked, lens, bids = d2f.corrupt(b, mode, 8, 40, g, order)
    j = torch.arange(b.ids.shape[1])[None]
    assert masked.any(1).all()  # every row has a loss position
    assert not (masked & (j < b.prompt_lens[:, None])).any()  # the prompt is never masked
    assert not (masked & (j >= lens[:, None])).any()
    assert ((noisy == tasks.MASK_ID) == masked).all()
    assert (noisy[~masked] == b.ids[~masked]).all()
    assert ((lens - b.prompt_lens) % 8 == 0).all() and (lens <= b.lens).all()
    if mode == "full_pipe":
        assert (lens < b.lens).any()


def test_equation_view_masks_results_with_their_operands_clean():
    """full_equation cuts right after an "=": a result digit masked with everything before it clean, in most rows
    (each position after the cut is masked with t ~ U(0.5, 1)); full_prefix's uniform cut does that far less often."""
    b = _batch(64, seed=5)
    eq = tasks.vocab()["="]

    def result_in_view(mode):
        _, masked, _, _ = d2f.corrupt(b, mode, 8, 40, torch.Generator().manual_seed(3))
        rows = 0
        for i in range(64):
            first = int(masked[i].nonzero()[0])  # everything before it is clean
            rows += int(b.ids[i, first - 1]) == eq
        return rows / 64

    eq_view, prefix_view = result_in_view("full_equation"), result_in_view("full_prefix")
    assert eq_view >= 0.6 and eq_view > 2 * prefix_view, (eq_view, prefix_view)


def test_block_views_mask_later_blocks_more():
    """Per-block increasing ratios: averaged over many rows, block k+1 is masked more than block k."""
    b = _batch(256, seed=3)
    g = torch.Generator().manual_seed(2)
    _, masked, lens, bids = d2f.corrupt(b, "block_causal", 8, 40, g)
    rates = [masked[bids == k].float().mean().item() for k in range(1, 6)]
    assert all(x < y for x, y in zip(rates, rates[1:])), rates


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        d2f.corrupt(_batch(2), "causal", 8, 40, torch.Generator())
    with pytest.raises(ValueError, match="unknown options"):
        d2f.train(tmp_path, nope=1)
    with pytest.raises(ValueError, match="gen_len"):
        d2f.train(tmp_path, gen_len=41)


def test_tiny_training_run_lowers_the_loss(tmp_path):
    cfg = d2f.hf_config(len(tasks.vocab()), TINY["hidden"], TINY["layers"], TINY["heads"], TINY["kv_heads"],
                        TINY["intermediate"])
    b = _batch(32, seed=123)

    def eval_loss(model):
        with torch.no_grad():
            order = torch.arange(40).expand(32, 40)  # full_policy with the left-to-right order
            return sum(float(d2f.loss_on(model, b, m, 8, 40, torch.Generator().manual_seed(7), order))
                       for m in d2f.MODES)

    before = eval_loss(d2f.init_model(cfg, 0).eval())
    summary = d2f.train(tmp_path, log=lambda *_: None, steps=40, lr=3e-3, warmup=5, eval_every=0, eval_n=4,
                        threads=1, **TINY)
    model = lopa_fast.load_model(tmp_path, dtype=torch.float32)  # the saved directory loads as is
    after = eval_loss(model)
    assert after < 0.8 * before, (before, after)
    assert summary["steps"] == 40 and (tmp_path / "training_log.txt").is_file()
    assert lopa_fast.load_tokenizer(tmp_path).mask_token_id == tasks.MASK_ID
    assert model.mask_token_id == tasks.MASK_ID and model.eos_token_id == tasks.EOS_ID


def test_tiny_ar_drafter_run_lowers_the_loss(tmp_path):
    from lopa_fast.train import ar

    b = _batch(32, seed=321)
    cfg = ar.hf_config(len(tasks.vocab()), 32, 1, 2, 1, 64)
    with torch.no_grad():
        before = float(ar.loss_on(d2f.init_model(cfg, 0).eval(), b))
    ar.train(tmp_path, log=lambda *_: None, steps=30, lr=3e-3, warmup=5, eval_every=0, eval_n=2, threads=1,
             hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, batch=16)
    model = lopa_fast.load_model(tmp_path, dtype=torch.float32)
    assert model.config.kind == "qwen2" and model.attention == "causal"
    with torch.no_grad():
        after = float(ar.loss_on(model, b))
    assert after < 0.8 * before, (before, after)


def test_continue_from_a_previous_run(tmp_path):
    kw = dict(log=lambda *_: None, steps=3, warmup=1, eval_every=0, eval_n=2, threads=1, **{**TINY, "batch": 4})
    d2f.train(tmp_path / "a", **kw)
    d2f.train(tmp_path / "b", init_from=str(tmp_path / "a"), seed=1, **kw)
    log = (tmp_path / "b" / "training_log.txt").read_text()
    assert '"init_from": "' in log and "# done" in log
    with pytest.raises(ValueError, match="different architecture"):
        d2f.train(tmp_path / "c", init_from=str(tmp_path / "a"), **{**kw, "hidden": 64})


TINY_VAR = dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, batch=4, gen_len=96, max_positions=160,
                task="arith-var", warmup=2, eval_every=0, eval_n=2, threads=1)


def test_a_resumed_run_is_the_uninterrupted_run(tmp_path):
    """stop after 3 of 6 steps, resume: the weights equal those of 6 uninterrupted steps bit for bit."""
    from safetensors.torch import load_file

    quiet = dict(log=lambda *_: None, steps=6, ckpt_every=2, **TINY_VAR)
    d2f.train(tmp_path / "a", **quiet)
    d2f.train(tmp_path / "b", stop_at=3, **quiet)
    assert (tmp_path / "b" / "resume.pt").is_file()
    d2f.train(tmp_path / "b", resume=True, **quiet)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    log = (tmp_path / "b" / "training_log.txt").read_text()
    assert "# resumed at step 3" in log and log.count("# done") == 2
    with pytest.raises(ValueError, match="differ"):  # a resume must keep the options
        d2f.train(tmp_path / "b", resume=True, **{**quiet, "lr": 1e-2})
    with pytest.raises(FileNotFoundError, match="no training state"):
        d2f.train(tmp_path / "c", resume=True, **quiet)


def test_arith_var_training_grows_the_arith_model(tmp_path):
    """task arith-var: its tokenizer (127 ids) is saved with the model; init_from an arith model copies its 65 rows."""
    quiet = dict(log=lambda *_: None, steps=1, **{k: v for k, v in TINY.items() if k != "gen_len"}, gen_len=32)
    d2f.train(tmp_path / "arith", eval_every=0, eval_n=2, threads=1, **{**quiet, "batch": 2})
    d2f.train(tmp_path / "var", init_from=str(tmp_path / "arith"), seed=1, log=lambda *_: None, steps=1,
              **{**TINY_VAR, "gen_len": 96})
    old = lopa_fast.load_model(tmp_path / "arith", dtype=torch.float32).state_dict()
    new = lopa_fast.load_model(tmp_path / "var", dtype=torch.float32)
    n_var = len(tasks.TOKENIZERS["arith-var"].vocab())
    assert n_var == 127 and new.config.vocab_size == n_var and new.config.max_position_embeddings == 160
    assert len(lopa_fast.load_tokenizer(tmp_path / "var")) == n_var
    with pytest.raises(ValueError, match="max_positions"):
        d2f.train(tmp_path / "x", **{**TINY_VAR, "max_positions": 120})  # prompt + 96 > 120
    with pytest.raises(ValueError, match="variant"):
        d2f.train(tmp_path / "x", **{**TINY_VAR, "variant": "v1"})
    with pytest.raises(ValueError, match="task"):
        d2f.train(tmp_path / "x", **{**TINY_VAR, "task": "gsm8k"})
    assert old["model.embed_tokens.weight"].shape[0] == 65


def test_load_grown_copies_the_old_rows():
    cfg = d2f.hf_config(65, 32, 1, 2, 1, 64)
    small = d2f.init_model(cfg, 0)
    big = d2f.init_model({**cfg, "vocab_size": 129, "max_position_embeddings": 256}, 1)
    fresh = big.state_dict()["lm_head.weight"][65:].clone()
    assert d2f.load_grown(big, small) == ["model.embed_tokens.weight", "lm_head.weight"]
    for name, w in small.state_dict().items():
        assert torch.equal(big.state_dict()[name][: w.shape[0]], w), name
    assert torch.equal(big.state_dict()["lm_head.weight"][65:], fresh)  # new rows keep their init


def test_ar_recipe_arith_var_grows_and_resumes(tmp_path):
    """The AR verifier recipe on arith-var: init_from an arith AR model grows its vocabulary; a stopped and
    resumed run equals the uninterrupted one."""
    from safetensors.torch import load_file

    from lopa_fast.train import ar

    small = dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, threads=1, eval_n=1)
    ar.train(tmp_path / "arith", log=lambda *_: None, steps=1, batch=2, eval_every=0, **small)
    kw = dict(log=lambda *_: None, task="arith-var", gen_len=96, max_positions=160, steps=4, batch=2, warmup=1,
              eval_every=0, ckpt_every=2, init_from=str(tmp_path / "arith"), **small)
    ar.train(tmp_path / "a", **kw)
    ar.train(tmp_path / "b", stop_at=2, **kw)
    ar.train(tmp_path / "b", resume=True, **kw)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    model = lopa_fast.load_model(tmp_path / "a", dtype=torch.float32)
    assert model.config.kind == "qwen2" and model.config.vocab_size == len(tasks.TOKENIZERS["arith-var"].vocab())


def test_load_grown_deepens_with_identity_layers():
    """A deeper model grown from a shallower one computes exactly what the shallower one did (the extra layers'
    output projections start at zero)."""
    cfg = d2f.hf_config(65, 32, 1, 2, 1, 64)
    small = d2f.init_model(cfg, 0).eval()
    deep = d2f.init_model({**cfg, "num_hidden_layers": 3}, 1)
    grown = d2f.load_grown(deep, small)
    assert "model.layers.2.mlp.down_proj.weight" in grown and "model.layers.1.self_attn.o_proj.weight" in grown
    b = _batch(2)
    with torch.no_grad():
        assert torch.equal(small(b.ids, mask="full", win_lens=b.lens), deep.eval()(b.ids, mask="full", win_lens=b.lens))
