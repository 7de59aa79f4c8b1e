"""Lengths users ask for: any max_new_tokens is decoded in whole blocks and cut (finish_reason), the default
comes from generation_config.json and is clipped to the position limit; strict_length keeps the old error."""
import json
import shutil

import pytest
import torch

import lopa_fast
from lopa_fast import tasks
from lopa_fast.assets import model_dir
from lopa_fast.tasks.evaluate import ROWS, load_default, prompt_ids


@pytest.fixture(scope="module")
def embedded():
    model, tok, _ = load_default()
    return model, tok


@pytest.fixture(scope="module")
def prompt(embedded):
    return prompt_ids(embedded[1], tasks.generate("test", 1, seed=0)[0])


def _knobs(row):
    return {k: v for k, v in ROWS[row].items()}


@pytest.mark.parametrize("row", ["d2f", "lopa-k4"])
def test_cut_matches_whole_blocks_on_both_backends(embedded, prompt, row):
    model, _ = embedded
    full = lopa_fast.generate(model, prompt, backend="reference", max_new_tokens=32, **_knobs(row))
    for n in (13, 5):  # 13 -> 2 blocks of 8 decoded; 5 -> 1 block
        outs = {b: lopa_fast.generate(model, prompt, backend=b, max_new_tokens=n, **_knobs(row))
                for b in ("reference", "fast")}
        ref, fast = outs["reference"], outs["fast"]
        assert ref.generated_ids == fast.generated_ids == full.generated_ids[:n]
        assert fast.stats["backend"] == "fast"
        for o in (ref, fast):
            st = o.stats
            assert st["max_new_tokens"] == n and st["decoded_new_tokens"] == -(-n // 8) * 8
            assert st["generated_tokens"] == len(o.generated_ids) == n and st["max_new_tokens_source"] == "argument"
            assert st["finish_reason"] == "length"  # the answer's EOS lies past 13 tokens
            assert st["tpf"] == pytest.approx(n / st["forwards"])
    assert full.stats["finish_reason"] == "stop" and len(full.generated_ids) <= 32


def test_finish_reason_on_every_strategy(embedded, prompt):
    model, _ = embedded
    for row in ("vanilla", "threshold", "d2f"):
        out = lopa_fast.generate(model, prompt, max_new_tokens=32, **_knobs(row))
        assert out.stats["finish_reason"] == "stop", row
        assert 0 in out.generated_ids  # EOS id of the embedded tokenizer
    short = lopa_fast.generate(model, prompt, max_new_tokens=12, **dict(_knobs("threshold"), block_length=8))
    assert short.stats["decoded_new_tokens"] == 16 and len(short.generated_ids) == 12
    assert short.stats["finish_reason"] == "length"


def test_strict_length_keeps_the_error(embedded, prompt):
    model, _ = embedded
    with pytest.raises(ValueError, match="multiple of block_size=8"):
        lopa_fast.generate(model, prompt, max_new_tokens=13, strict_length=True, **_knobs("d2f"))
    with pytest.raises(ValueError, match="block_length=8 must divide"):
        lopa_fast.generate(model, prompt, max_new_tokens=12, strict_length=True, **_knobs("threshold"))
    with pytest.raises(TypeError, match="strict_length"):
        lopa_fast.generate(model, prompt, max_new_tokens=8, strict_length=1, **_knobs("d2f"))


def test_default_is_clipped_to_the_position_limit(tmp_path, prompt):
    d = tmp_path / "m"  # a copy: no longer the embedded model, whose own max_new_tokens is its task's 32
    shutil.copytree(model_dir(), d)  # (lopa_fast.request.model_defaults)
    model = lopa_fast.load_model(d, dtype=torch.float32)  # max_position_embeddings 128, no generation_config.json:
    # default 512
    out = lopa_fast.generate(model, prompt, **_knobs("d2f"))
    room = 128 - len(prompt)
    st = out.stats
    assert st["max_new_tokens"] == room // 8 * 8 and st["max_new_tokens_source"] == "default"
    assert "clipped" in st["max_new_tokens_clipped"] and "max_position_embeddings=128" in st["max_new_tokens_clipped"]
    with pytest.raises(lopa_fast.KnobError, match="leaves 3 of the model's max_position_embeddings=128") as e:
        lopa_fast.generate(model, [2] * 125, **_knobs("d2f"))
    assert e.value.knob == "max_new_tokens"
    # an explicit length that fits while its whole blocks do not: a clear error, no silent change
    with pytest.raises(lopa_fast.KnobError, match="whole blocks of 8"):
        lopa_fast.generate(model, [2] * 100, max_new_tokens=27, **_knobs("d2f"))


def test_default_from_generation_config(tmp_path, prompt):
    d = tmp_path / "m"
    shutil.copytree(model_dir(), d)
    (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": 20}))
    model = lopa_fast.load_model(d, dtype=torch.float32)
    out = lopa_fast.generate(model, prompt, **_knobs("lopa-k2"))
    assert out.stats["max_new_tokens"] == 20 and out.stats["decoded_new_tokens"] == 24
    assert out.stats["max_new_tokens_source"] == "generation_config.json" and len(out.generated_ids) <= 20
    assert "max_new_tokens_clipped" not in out.stats
    (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": "lots"}))
    with pytest.raises(lopa_fast.ConfigError, match="max_new_tokens='lots'"):
        lopa_fast.generate(model, prompt, **_knobs("d2f"))


def test_round_cap_finish_reason_and_trace_cut_with_the_tokens(embedded, prompt):
    import warnings

    model, _ = embedded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the round-cap warning
        capped = lopa_fast.generate(model, prompt, max_new_tokens=13, max_rounds=1, **_knobs("lopa-k4"))
    assert capped.stats["hit_round_cap"] and capped.stats["finish_reason"] == "round_cap"
    for backend in ("reference", "fast"):
        full = lopa_fast.generate(model, prompt, backend=backend, max_new_tokens=16, return_trace=True,
                                  **_knobs("lopa-k4"))
        cut = lopa_fast.generate(model, prompt, backend=backend, max_new_tokens=13, return_trace=True,
                                 **_knobs("lopa-k4"))
        assert cut.generated_ids == full.generated_ids[:13]
        assert len(cut.trace) == len(full.trace) == cut.stats["forwards"]  # one entry per round stays
        assert any(p >= 13 for r in full.trace for p, _ in r["accepted"])  # the whole blocks decoded past 13
        assert [[a for a in r["accepted"] if a[0] < 13] for r in full.trace] == [r["accepted"] for r in cut.trace]
        filled = {p: t for r in cut.trace for p, t in r["accepted"]}
        assert sorted(filled) == list(range(13)) and [filled[p] for p in range(13)] == cut.generated_ids
