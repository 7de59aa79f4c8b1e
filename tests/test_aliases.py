"""HF / Dream / LLaDA knob names: translated where they mean the same, refused naming lopa_fast's knob where not
(lopa_fast.request.aliases)."""
import pytest

import lopa_fast
from lopa_fast.errors import KnobError
from lopa_fast.testing import random_model, tiny_hf_config

IDS = [5, 9, 2, 7]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream"), seed=3, sharpen=6)


def _same(a, b):
    assert a.generated_ids == b.generated_ids and a.stats["forwards"] == b.stats["forwards"]


def test_same_meaning_same_output(model):
    kw = dict(strategy="d2f", block_size=4)
    want = lopa_fast.generate(model, IDS, max_new_tokens=8, **kw)
    _same(lopa_fast.generate(model, IDS, max_length=len(IDS) + 8, **kw), want)  # HF: prompt + new tokens
    _same(lopa_fast.generate(model, IDS, gen_length=8, **kw), want)  # LLaDA's name
    _same(lopa_fast.generate(model, IDS, max_new_tokens=8, do_sample=False, **kw), want)  # greedy = T 0
    eos = model.eos_token_id
    _same(lopa_fast.generate(model, IDS, max_new_tokens=8, eos_token_id=[eos], **kw), want)


def test_list_eos_extra_ids_end_decoding(model):
    kw = dict(strategy="d2f", block_size=4, max_new_tokens=8)
    base = lopa_fast.generate(model, IDS, **kw)
    tok = base.generated_ids[2]
    out = lopa_fast.generate(model, IDS, eos_token_id=[model.eos_token_id, tok], **kw)
    assert out.generated_ids == base.generated_ids[: base.generated_ids.index(tok)]
    assert out.stats["finish_reason"] == "stop"


@pytest.mark.parametrize("kw, needle", [
    (dict(max_length=4), "max_length=4 leaves no new token after the prompt's 4"),
    (dict(max_length=12, max_new_tokens=8), "max_length=12 and max_new_tokens=8 both given"),
    (dict(gen_length=8, max_new_tokens=8), "gen_length=8 and max_new_tokens=8 both given"),
    (dict(do_sample=False, temperature=0.7), "do_sample=False with temperature=0.7"),
    (dict(do_sample=True), "do_sample=True needs temperature > 0"),
    (dict(do_sample="yes"), "do_sample='yes'; expected True or False"),
    (dict(num_beams=4), "num_beams=4 is not a lopa_fast knob: .*branching_factor="),
    (dict(repetition_penalty=1.1), "repetition_penalty=1.1 is not a lopa_fast knob"),
    (dict(eos_token_id=[]), r"eos_token_id=\[\]; expected an int id or a non-empty list"),
])
def test_conflicts_and_unsupported_names_are_refused_naming_the_knob(model, kw, needle):
    with pytest.raises(KnobError, match=needle) as e:
        lopa_fast.generate(model, IDS, strategy="d2f", block_size=4, **kw)
    assert e.value.knob == next(iter(kw))


def test_max_length_needs_one_prompt(model):
    with pytest.raises(KnobError, match="max_length= .* needs one prompt"):
        lopa_fast.generate(model, [IDS, [1, 2]], strategy="d2f", block_size=4, max_length=12)


def test_stream_takes_the_same_names():
    from lopa_fast.assets import model_dir

    m = lopa_fast.load_model(model_dir(), dtype="float32")
    tok = lopa_fast.load_tokenizer(model_dir())
    prompt = "Lily has 3 apples ."
    ids = tok(prompt)["input_ids"]
    a = lopa_fast.stream(m, prompt, tokenizer=tok, max_length=len(ids) + 16, do_sample=False)
    b = lopa_fast.stream(m, prompt, tokenizer=tok, max_new_tokens=16)
    assert "".join(a) == "".join(b) and a.result.generated_ids == b.result.generated_ids
