"""The embedded task: deterministic generator, parameter-disjoint splits, tokenizer round trip."""
import pytest

from lopa_fast import tasks
from lopa_fast.tasks import arith
from tests.utils import markdown_row


def test_generator_is_deterministic():
    a = tasks.generate("train", 50, seed=3)
    b = tasks.generate("train", 50, seed=3)
    c = tasks.generate("train", 50, seed=4)
    assert a == b
    assert a != c
    assert tasks.generate("test", 20, seed=0) == tasks.generate("test", 20, seed=0)


def test_splits_disjoint_on_parameters():
    train = set(tasks.all_tuples("train"))
    test = set(tasks.all_tuples("test"))
    dev = set(tasks.all_tuples("dev"))
    assert not train & test and not train & dev and not dev & test
    r = arith.VARIANTS[arith.DEFAULT_VARIANT]
    total = sum(1 for a in range(r["a"][0], r["a"][1] + 1) for d in range(r["d"][0], r["d"][1] + 1) if d < a) * (
        r["b"][1] - r["b"][0] + 1) * (r["c"][1] - r["c"][0] + 1)
    assert len(train) + len(test) + len(dev) == total
    assert 0.07 < len(test) / total < 0.13
    # sampled problems respect their split
    assert all(p.numbers in train for p in tasks.generate("train", 300, seed=1))
    assert all(p.numbers in test for p in tasks.generate("test", 200, seed=1))
    assert all(p.numbers in dev for p in tasks.generate("dev", 100, seed=1))


@pytest.mark.parametrize("template", arith.TEMPLATES)
def test_solution_is_correct_arithmetic(template):
    p = arith.render(template, 45, 4, 8, 15, "Anna", "She", "pens", "boxes")
    assert p.answer == 45 + 32 - 15
    for eq in p.solution.split(" . ")[:3]:
        lhs, rhs = eq.rstrip(" .").split(" = ")
        assert eval(lhs) == int(rhs)  # noqa: S307 - our own "x op y" strings
    assert tasks.extract_answer(p.solution) == p.answer


def test_tokenizer_round_trip_and_lengths():
    tok = tasks.build_tokenizer()
    for variant, gen_len in (("v2", 32), ("v1", 40)):
        for p in tasks.generate("test", 200, seed=2, variant=variant):
            prompt, target = tasks.encode_problem(tok, p, gen_len=gen_len)
            assert prompt[0] == tasks.BOS_ID and tasks.tokenizer.UNK_ID not in prompt + target
            n_sol = target.index(tasks.EOS_ID) + 1
            assert n_sol <= arith.MAX_SOLUTION_TOKENS[variant] and len(target) == gen_len
            text = tok.decode(target, skip_special_tokens=True)
            assert tasks.extract_answer(text) == p.answer
            assert text == tasks.join_digits(p.solution)  # the tokenizer's decoder joins the digits it split
    for p in tasks.generate("train", 300, seed=2):
        assert 0 < p.d < p.a and p.answer > 0  # no negative intermediate result
    assert not set(tasks.all_tuples("test", "v2")) & set(tasks.all_tuples("train", "v1"))


@pytest.mark.parametrize("name", ["d2f-arith", "ar-arith", "d2f-arith-var", "ar-arith-var", "dparallel-arith-var",
                                  "mdm-arith-var", "dparallel-mdm-arith-var"])
def test_shipped_tokenizers_join_digits_wherever_loaded_from(name):
    """How text is spelled belongs to the tokenizer: each shipped model's tokenizer.json, loaded by path, decodes
    "49" as "49" (it used to decode "4 9" unless the caller knew the model was the embedded one)."""
    import lopa_fast
    from lopa_fast.assets import model_dir

    tok = lopa_fast.load_tokenizer(model_dir(name))
    ids = tok("49 + 3 = 52", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and tok.unk_token_id not in ids  # the digits are split ...
    assert tok.decode(ids) == "49 + 3 = 52"  # ... and joined again on the way out


def test_tokenizer_loads_through_lopa_fast(tmp_path):
    import lopa_fast

    tasks.save_tokenizer(tmp_path)
    tok = lopa_fast.load_tokenizer(tmp_path)
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id, tok.bos_token_id) == (0, 0, 1, 2)
    ids = tok("Lily has 23 apples .")["input_ids"]
    assert ids[0] == tasks.BOS_ID and tok.decode(ids, skip_special_tokens=True) == "Lily has 23 apples ."


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="split"):
        tasks.generate("valid", 3)
    with pytest.raises(ValueError, match="n="):
        tasks.generate("train", -1)
    with pytest.raises(ValueError, match="variant"):
        tasks.generate("train", 3, variant="v9")
    with pytest.raises(ValueError, match="exceeds"):
        tasks.generate("test", 10_000)
    with pytest.raises(ValueError, match="template"):
        arith.render("nope", 20, 2, 2, 2, "Tom", "He", "pens", "bags")


# ---- the eval's APD rows (lopa_fast/tasks/evaluate.py) -------------------------------------------------------
def test_eval_apd_rows_are_the_scaled_upstream_presets():
    from lopa_fast.tasks import evaluate as E

    # upstream's (R, W, M) = (0.6, 32, 200) and (0.7, 16, 100) for 256 new tokens, W and M scaled by 32/256
    assert E.APD_ROWS == {
        "apd-r0.6": dict(strategy="apd", apd_mixture_weight=0.6, kv_window=4, max_lookahead=25),
        "apd-r0.7": dict(strategy="apd", apd_mixture_weight=0.7, kv_window=2, max_lookahead=13),
        "apd-r0.9": dict(strategy="apd", apd_mixture_weight=0.9, kv_window=2, max_lookahead=13),
    }
    assert E.parse_rows("apd") == ["apd-r0.6", "apd-r0.7", "apd-r0.9"]
    assert E.parse_rows("d2f,apd-r0.7,apd") == ["d2f", "apd-r0.7", "apd-r0.6", "apd-r0.9"]
    assert E.parse_rows("all")[-3:] == list(E.APD_ROWS)
    # the dLLM-only rows stay the generate presets (an APD row needs the verifier model)
    assert not set(E.APD_ROWS) & set(E.ROWS) and E.make_rows(16, apd=True)["apd-r0.6"] == E.APD_ROWS["apd-r0.6"]
    with pytest.raises(ValueError, match="apd-r0.6, apd-r0.7, apd-r0.9, lopa, apd, all"):
        E.parse_rows("apd-r0.5")
    # steps that accepted their whole window (min(M, tokens left) drafts)
    assert E._full_window_steps([13, 13, 6], 13) == 3 and E._full_window_steps([13, 5, 14], 13) == 2
    assert E._full_window_steps([1, 31], None) == 1 and E._full_window_steps([25, 7], 25) == 2


def test_eval_apd_rows_run_with_the_shipped_verifier(tmp_path):
    from lopa_fast.tasks import evaluate as E

    out = tmp_path / "apd.md"
    res = E.run_eval(n=3, strategies="d2f,apd", backend="auto", out=out, progress=False, log=lambda *_: None)
    by = {r["row"]: r for r in res}
    for row in E.APD_ROWS:
        r = by[row]
        assert r["status"] == "ok" and r["backend"] == "fast", r  # auto picks the fast APD step at T = 0
        assert r["dllm_forwards_per_answer"] == r["forwards_per_answer"] >= 1 and r["verifier_forwards_per_answer"] >= 1
        assert r["mean_accepted"] == pytest.approx(r["tpf"]) and 0 <= r["full_window_share"] <= 1
    text = out.read_text()
    assert markdown_row(text, "strategy")[6:] == ["dLLM forwards / answer", "verifier forwards / answer",
                                                  "accepted / step", "full-window steps"]
    assert markdown_row(text, "d2f")[7:] == ["-", "-", "-"]
    assert "scaled by 32/256" in text and "(0.6, 4, 25), (0.7, 2, 13)" in text and "`ar-arith` verifies" in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the rows are the same numbers on both backends (the fast APD step is token-exact with the reference)
    problems = tasks.generate("test", 3, seed=0)
    ref = E.run_row(*E.load_default()[:2], problems, "apd-r0.7", "reference", False, verifier=E.load_verifier())
    keys = ("accuracy", "tpf", "dllm_forwards_per_answer", "verifier_forwards_per_answer", "mean_accepted",
            "full_window_share")
    assert ref["backend"] == "reference" and all(ref[k] == by["apd-r0.7"][k] for k in keys)
    # a verifier that does not fit the drafter is reported before the row runs
    miss = E.run_row(*E.load_default()[:2], [], "apd-r0.6", verifier=None)
    assert miss["status"] == "unavailable" and "no verifier" in miss["reason"]
