"""The shipped arith-var models (issue 12) load in HF layout with the arith-var tokenizer and answer held-out
problems (parameters never seen in training): the APD verifier ar-arith-var, the diffusion teacher d2f-arith-var
(docs/tasks.md, "Training a model for arith-var", says what it does and does not reach), its dParallel student
dparallel-arith-var, and the base teacher in LLaDA's regime mdm-arith-var (issue 27)."""
import json

import pytest
import torch

import lopa_fast
from lopa_fast import tasks
from lopa_fast.assets import model_dir
from lopa_fast.tasks import arith_var

TOK = tasks.TOKENIZERS["arith-var"]
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "train_args.json",
         "training_log.txt")


@pytest.mark.parametrize("name,kind", [("ar-arith-var", "qwen2"), ("d2f-arith-var", "Dream"),
                                       ("dparallel-arith-var", "Dream"), ("mdm-arith-var", "Dream"),
                                       ("dparallel-mdm-arith-var", "Dream")])
def test_layout_and_vocabulary(name, kind):
    path = model_dir(name)
    for f in FILES:
        assert (path / f).is_file(), (name, f)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["vocab_size"] == len(TOK.vocab())
    assert cfg["max_position_embeddings"] >= 32 + arith_var.GEN_LEN
    assert lopa_fast.load_tokenizer(path).get_vocab() == TOK.vocab()


def test_verifier_greedy_ar_answers_held_out_problems():
    """Plain greedy AR decoding (no cache) of 8 held-out problems; the model's dev exact match is 98.3% (60)."""
    from lopa_fast.train.ar import greedy_accuracy

    model = lopa_fast.load_model(model_dir("ar-arith-var"), dtype=torch.float32)
    assert model.config.kind == "qwen2" and model.attention == "causal" and model.eos_token_id == tasks.EOS_ID
    acc = greedy_accuracy(model, arith_var.generate("test", 8, seed=3), TOK.build_tokenizer(), arith_var.GEN_LEN)
    assert acc >= 7 / 8


@pytest.mark.parametrize("name", ["d2f-arith-var", "mdm-arith-var"])
def test_teacher_answers_held_out_problems_left_to_right(name):
    """One token per forward, leftmost mask first (train.diagnose's left_to_right order; d2f-arith-var 99.0% on 96
    dev problems; mdm-arith-var, the base teacher in LLaDA's regime, 100% on 100 held-out problems)."""
    from lopa_fast.train import diagnose

    model = lopa_fast.load_model(model_dir(name), dtype=torch.float32)
    assert model.config.kind == "dream" and model.mask_token_id == tasks.MASK_ID
    acc = diagnose.fill_order_accuracy(model, arith_var.generate("test", 8, seed=3), TOK.build_tokenizer(),
                                       orders=("left_to_right",))
    assert acc["left_to_right"] >= 7 / 8, acc


@pytest.mark.parametrize("name", ["dparallel-arith-var", "dparallel-mdm-arith-var"])
def test_student_answers_held_out_problems_under_the_entropy_threshold(name):
    """The dParallel students through lopa_fast.generate with the eval's dparallel-h0.45 row (several tokens per
    forward: fewer than the 96 of one token per forward)."""
    from lopa_fast.tasks import evaluate

    model = lopa_fast.load_model(model_dir(name), dtype=torch.float32)
    tok = lopa_fast.load_tokenizer(model_dir(name))
    knobs = evaluate.task_rows("arith-var")["dparallel-h0.45"]
    correct = forwards = 0
    for p in arith_var.generate("test", 8, seed=0):  # the eval's first 8 (held-out: 97% and 94% of its 100)
        ids = torch.tensor(evaluate.prompt_ids(tok, p), dtype=torch.long)
        out = lopa_fast.generate(model, ids, max_new_tokens=arith_var.GEN_LEN, temperature=0.0, **knobs)
        correct += tasks.extract_answer(tok.decode(out.generated_ids, skip_special_tokens=True)) == p.answer
        forwards += out.stats["forwards"]
    assert correct >= 6 and forwards < 8 * arith_var.GEN_LEN / 2, (correct, forwards)
