"""Issue 42, a newcomer's first hour: each numbered finding, as a new user meets it on the embedded model (each test
failed on main 33fa3f2). The README recipes themselves run in tests/test_readme.py."""
from __future__ import annotations

import json

import pytest
import torch

import lopa_fast
from lopa_fast import cli, tasks
from lopa_fast.assets import model_dir

TOM = ("Tom has 7 pens . He buys 4 bags with 6 pens in each . He gives away 5 pens . How many pens does Tom have now "
       "? Answer :")  # 7 + 4 * 6 - 5 = 26


@pytest.fixture(scope="module")
def embedded():
    return lopa_fast.load_model(model_dir()), lopa_fast.load_tokenizer(model_dir())


def _cli_json(capsys, *argv) -> dict:
    assert cli.main(["generate", "-q", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


# ---- 1. the chat template's "Answer :" is said once ----------------------------------------------------------------
def test_chat_prompt_ending_with_the_templates_answer_cue_is_not_doubled(embedded, capsys):
    from lopa_fast.request.text import encode_prompt

    _, tok = embedded
    with_cue, without = encode_prompt(tok, TOM, chat=True), encode_prompt(tok, TOM[: -len(" Answer :")], chat=True)
    assert with_cue == without
    assert tok.decode(with_cue, skip_special_tokens=True).count("Answer") == 1
    out = _cli_json(capsys, "--chat", "--prompt", TOM)
    assert "#### ####" not in out["text"] and tasks.extract_answer(out["text"]) == 26, out["text"]


def test_lm_eval_chat_template_says_the_cue_once(embedded):
    from lopa_fast.lm_eval.model import LopaFastLM

    lm = LopaFastLM()
    text = lm.apply_chat_template([{"role": "user", "content": TOM}])
    assert text.count("Answer :") == 1, text


# ---- 2. --strategy X keeps the embedded model's own knobs ------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["threshold", "d2f", "lopa"])
def test_strategy_flag_on_the_embedded_model_keeps_its_knobs(capsys, strategy):
    out = _cli_json(capsys, "--strategy", strategy, "--prompt", TOM)
    st = out["stats"]
    assert tasks.extract_answer(out["text"]) == 26, out["text"]
    assert st["max_new_tokens"] == 32 and st["forwards"] > 1, st  # the eval row's length, block 8 (not 1 forward)


def test_python_api_on_the_embedded_model_uses_its_knobs(embedded):
    model, tok = embedded
    ids = tok(TOM)["input_ids"]
    for strategy in ("threshold", "d2f", "lopa"):
        out = lopa_fast.generate(model, ids, strategy=strategy)
        assert tasks.extract_answer(tok.decode(out.generated_ids, skip_special_tokens=True)) == 26, strategy
        assert out.stats["max_new_tokens"] == 32 and out.stats["forwards"] > 1, (strategy, out.stats)
    # a knob the user gives wins, and the defaults tied to it follow it (block_length follows block_size)
    out = lopa_fast.generate(model, ids, strategy="threshold", block_size=4, max_new_tokens=16)
    assert out.stats["max_new_tokens"] == 16 and out.stats["forwards"] >= 4


def test_model_knobs_of_a_model_that_is_not_embedded_are_none(tmp_path):
    from lopa_fast.request.model_defaults import model_knobs

    assert model_knobs(tmp_path, "lopa") == {} and model_knobs(None, "lopa") == {}
    assert model_knobs(model_dir("dparallel-arith-var"), "threshold")["entropy_threshold"] == 0.45
    assert model_knobs(model_dir("d2f-arith-var"), "lopa")["max_new_tokens"] == 96


# ---- 3. threshold without a rule runs Fast-dLLM's default 0.9 --------------------------------------------------------
def test_threshold_without_a_rule_runs_fast_dllms_default(embedded):
    model, tok = embedded
    ids = tok(TOM)["input_ids"]
    knobs = dict(strategy="threshold", max_new_tokens=32, block_size=8, block_length=8)
    for backend in ("reference", "fast"):
        default = lopa_fast.generate(model, ids, backend=backend, **knobs)
        explicit = lopa_fast.generate(model, ids, backend=backend, threshold=0.9, **knobs)
        assert default.generated_ids == explicit.generated_ids and default.stats["forwards"] == explicit.stats[
            "forwards"]
    from lopa_fast.config import GenerateConfig

    assert GenerateConfig(strategy="threshold").bind(model).threshold == 0.9
    assert GenerateConfig(strategy="threshold", factor=1.0).bind(model).threshold is None


def test_server_threshold_request_without_a_rule_runs_the_default(embedded):
    from lopa_fast.server.protocol import parse

    model, tok = embedded
    req = parse({"prompt": TOM, "strategy": "threshold"}, "completions", model, tok, cli.preset_knobs("lopa-k4"))
    cfg = lopa_fast.GenerateConfig(**req.knobs).bind(model)
    assert cfg.threshold == 0.9 and cfg.block_length == 8 and cfg.max_new_tokens == 32
    req = parse({"prompt": TOM, "strategy": "vanilla"}, "completions", model, tok, cli.preset_knobs("lopa-k4"))
    assert req.knobs["alg"] == "entropy" and req.knobs["steps"] == 32  # the model's vanilla row


# ---- 8. the smalls ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,guess", [("max_tokens", "max_new_tokens"), ("max_new_token", "max_new_tokens"),
                                        ("branching_factr", "branching_factor")])
def test_unknown_kwarg_suggests_the_lopa_fast_name(embedded, name, guess):
    model, tok = embedded
    for fn in (lopa_fast.generate, lopa_fast.stream):
        with pytest.raises(TypeError, match=rf"{name} \(did you mean {guess}\?\)"):
            fn(model, [2, 5, 6], tokenizer=tok, **{name: 8})


def test_load_model_cuda_on_a_cpu_torch_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the error is for a CPU-only build")
    with pytest.raises(ValueError, match=r"device='cuda'.*CUDA"):
        lopa_fast.load_model(model_dir(), device="cuda")


def test_load_model_hub_id_says_hub_ids_are_not_fetched():
    with pytest.raises(lopa_fast.CheckpointError, match=r"hub id, and lopa_fast does not fetch hub ids"):
        lopa_fast.load_model("Dream-org/Dream-v0-Instruct-7B")
    with pytest.raises(cli.CLIError, match="does not fetch hub ids"):
        cli.main(["generate", "--model", "Dream-org/Dream-v0-Instruct-7B", "--prompt", "x"])
    with pytest.raises(lopa_fast.CheckpointError, match=r"not a directory \(expected an HF-format model directory\)$"):
        lopa_fast.load_model("/no/such/dir")


def test_verbose_timing_line_counts_the_torch_import(capsys):
    import re
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lopa_fast", "generate", "-v", "--max-new-tokens", "8", "--prompt", TOM],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = re.search(r"imported torch in ([0-9.]+) s", r.stderr)
    assert m is not None and float(m.group(1)) > 0.0, r.stderr


def test_demo_lines_are_wrapped(capsys):
    assert cli.main(["demo", "--n", "1"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120, max(out.splitlines(), key=len)


# ---- 5. every lm-eval user error is one line; no --model means lopa_fast -------------------------------------------
@pytest.mark.parametrize("model_args,needle", [
    ("strategy=lopa,block_sise=8", "block_sise (did you mean block_size?)"),
    ("block_size=0", "block_size=0; allowed: an int >= 1"),
])
def test_lm_eval_user_errors_are_one_line(tmp_path, model_args, needle):
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "lopa_fast", "lm-eval", "--model", "lopa_fast", "--model_args",
                        model_args, "--tasks", "arith_tiny"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    errors = [x for x in r.stderr.splitlines() if "error" in x]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], r.stderr[-2000:]


def test_lm_eval_without_model_runs_lopa_fast(monkeypatch):
    pytest.importorskip("lm_eval")
    from lopa_fast.lm_eval import run

    seen = {}
    monkeypatch.setattr(run, "_run", lambda args: seen.setdefault("model", args.model) and 0)
    run.main(["--tasks", "arith_tiny"])
    assert seen["model"] == "lopa_fast"
    seen.clear()
    run.main(["--model", "hf", "--tasks", "arith_tiny"])
    assert seen["model"] == "hf"


# ---- 7. presets for apd and dparallel; a preset runs at the model's task length --------------------------------------
def _knobs(*argv) -> dict:
    from lopa_fast.cli.flags import generate_knobs

    args = cli.build_parser().parse_args(["generate", "--prompt", "x", *argv])
    return generate_knobs(args, args.knob_names)


def test_presets_cover_apd_and_dparallel_at_the_models_task_length():
    from lopa_fast.cli.flags import model_path, preset_assets

    student = str(model_dir("dparallel-arith-var"))
    assert _knobs("--preset", "lopa-k4", "--model", student)["max_new_tokens"] == 96  # was 32: cut the answers
    assert _knobs("--preset", "lopa-k4")["max_new_tokens"] == 32  # the embedded d2f-arith's task
    k = _knobs("--preset", "dparallel-h0.45")
    assert k["entropy_threshold"] == 0.45 and k["max_new_tokens"] == 96
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--preset", "dparallel-h0.45"])
    assert model_path(args) == student
    k = _knobs("--preset", "apd-r0.7")
    assert k["strategy"] == "apd" and k["apd_mixture_weight"] == 0.7 and k["kv_window"] == 2
    assert preset_assets("apd-r0.7", None) == (None, "ar-arith")
    assert preset_assets("apd-r0.7", str(model_dir("d2f-arith-var"))) == (None, "ar-arith-var")


@pytest.mark.parametrize("preset", ["apd-r0.7", "dparallel-lopa-k4"])
def test_new_presets_run_from_the_command_line(capsys, preset):
    from lopa_fast.tasks import arith_var

    p = tasks.generate_task("arith-var", "test", 1, seed=0)[0] if preset.startswith("dparallel") else None
    prompt = p.prompt if p is not None else TOM
    out = _cli_json(capsys, "--preset", preset, "--prompt", prompt)
    want = p.answer if p is not None else 26
    assert tasks.extract_answer(out["text"]) == want, out["text"]
    assert out["stats"]["max_new_tokens"] == (arith_var.GEN_LEN if p is not None else 32)


# ---- the conventions users bring (docs/decoding.md "Knobs from other libraries"; the table: test_conventions.py) ----
def test_padded_batch_with_attention_mask_is_decoded_row_by_row(embedded):
    model, tok = embedded
    a, b = tok(TOM)["input_ids"], tok("Mia has 6 shells . She loses 1 shells . How many shells ? Answer :")["input_ids"]
    P = max(len(a), len(b))
    ids = torch.tensor([[0] * (P - len(a)) + a, [0] * (P - len(b)) + b])  # left padding (pad id 0), as HF's
    mask = torch.tensor([[0] * (P - len(a)) + [1] * len(a), [0] * (P - len(b)) + [1] * len(b)])
    knobs = dict(strategy="d2f", block_size=8, max_new_tokens=16)
    outs = lopa_fast.generate(model, ids, attention_mask=mask, **knobs)
    assert [o.generated_ids for o in outs] == [lopa_fast.generate(model, p, **knobs).generated_ids for p in (a, b)]
    one = lopa_fast.generate(model, ids[:1], attention_mask=mask[:1], **knobs)  # one padded row: one output
    assert one.generated_ids == outs[0].generated_ids
    bad = mask.clone()
    bad[0, -3] = 0  # a hole inside the prompt
    with pytest.raises(lopa_fast.KnobError, match="padding inside the prompt") as e:
        lopa_fast.generate(model, ids, attention_mask=bad, **knobs)
    assert e.value.knob == "attention_mask"


def test_num_return_sequences_samples_at_positive_temperature(embedded):
    model, tok = embedded
    ids = tok(TOM)["input_ids"]
    knobs = dict(strategy="d2f", block_size=8, max_new_tokens=16, temperature=3.0)  # 1.5: the model is too sure
    outs = lopa_fast.generate(model, ids, num_return_sequences=3, seed=7, **knobs)
    assert len(outs) == 3
    for i, o in enumerate(outs):  # each reproducible alone with seed + i
        assert o.generated_ids == lopa_fast.generate(model, ids, seed=7 + i, **knobs).generated_ids
    assert len({tuple(o.generated_ids) for o in outs}) > 1  # samples, not copies
    with pytest.raises(lopa_fast.KnobError, match="needs temperature > 0"):
        lopa_fast.generate(model, ids, num_return_sequences=2, strategy="d2f")


def test_stop_strings_is_a_text_stop(embedded):
    model, tok = embedded
    ids = tok(TOM)["input_ids"]
    out = lopa_fast.generate(model, ids, stop_strings=" ####", strategy="d2f", block_size=8, max_new_tokens=32)
    assert out.stats["finish_reason"] == "stop" and "####" not in out.text


def test_load_model_takes_torch_dtype():
    m = lopa_fast.load_model(model_dir(), torch_dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="both given"):
        lopa_fast.load_model(model_dir(), dtype="float32", torch_dtype=torch.bfloat16)
