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
    noisy, masked, lens, bids = d2f.corrupt(b, mode, 8, 40, g)
    j = torch.arange(b.ids.shape[1])[None]
    assert masked.any(1).all()  # every row has a loss position
    assert not (masked & (j < b.prompt_lens[:, None])).any()  # the prompt is never masked
    assert not (masked & (j >= lens[:, None])).any()
    assert ((noisy == tasks.MASK_ID) == masked).all()
    assert (noisy[~masked] == b.ids[~masked]).all()
    assert ((lens - b.prompt_lens) % 8 == 0).all() and (lens <= b.lens).all()
    if mode == "full_pipe":
        assert (lens < b.lens).any()


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
            return sum(float(d2f.loss_on(model, b, m, 8, 40, torch.Generator().manual_seed(7))) for m in d2f.MODES)

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
