"""`python -m lopa_fast demo / eval / generate` end to end on the embedded model."""
import subprocess
import sys

import pytest

from lopa_fast import cli
from lopa_fast.tasks import evaluate



def test_demo_runs(capsys):
    assert cli.main(["demo", "--n", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("Q:", "d2f", "lopa-k4", "TPF", "forwards", "round:", "tokens:", "exact match"):
        assert needle in out, needle
    assert "unavailable" not in out


def test_eval_n5_writes_table(tmp_path):
    md = tmp_path / "eval.md"
    assert cli.main(["eval", "--n", "5", "--out", str(md), "--no-progress"]) == 0
    text = md.read_text()
    for row in evaluate.ROWS:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {row} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1].endswith("%"), line  # ran (not "unavailable")
        assert float(cells[2]) >= 1.0 and float(cells[4]) > 0  # TPF >= 1, forwards per answer
    assert "python -m lopa_fast eval --n 5" in text
    png = md.with_suffix(".png").read_bytes()  # TPF / accuracy against k
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_generate_subcommand(capsys):
    prompt = "Tom has 23 pens . He buys 4 bags with 6 pens in each . He gives away 17 pens . " \
             "How many pens does Tom have now ? Answer :"
    assert cli.main(["generate", "--prompt", prompt, "--strategy", "d2f"]) == 0
    assert "####" in capsys.readouterr().out


def test_unavailable_strategy_is_reported_not_faked(monkeypatch, tmp_path):
    import lopa_fast

    def missing(*a, **k):
        raise NotImplementedError("strategy not written yet")

    monkeypatch.setattr(lopa_fast, "generate", missing)
    res = evaluate.run_eval(n=1, strategies="d2f", out=tmp_path / "e.md", progress=False, log=lambda *_: None)
    assert res[0]["status"] == "unavailable"
    assert "| d2f | unavailable |" in (tmp_path / "e.md").read_text()


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategies"):
        evaluate.parse_rows("vanilla,nope")
    assert evaluate.parse_rows("lopa,d2f") == ["lopa-k2", "lopa-k4", "lopa-k8", "d2f"]
    with pytest.raises(ValueError, match="n="):
        evaluate.run_eval(n=0)
    with pytest.raises(ValueError, match="backend"):
        evaluate.run_demo(backend="gpu")
    with pytest.raises(SystemExit):
        cli.main(["eval", "--backend", "gpu"])


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "lopa_fast", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout and "eval" in r.stdout


def test_eval_plot_is_matplotlib_png(tmp_path):
    from lopa_fast.viz import png_size

    path = tmp_path / "c.png"
    rows = [{"row": r, "status": "ok", "tpf": t, "accuracy": 0.9} for r, t in (("d2f", 6.0), ("lopa-k2", 6.5))]
    assert evaluate.plot(rows, path) is None
    assert png_size(path) == (550, 352)  # figsize (5, 3.2) at dpi 110
    assert evaluate.plot([{"row": "vanilla", "status": "ok"}], tmp_path / "n.png") is not None


def test_eval_block_size_bad_value_errors_before_any_work(monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("the model was loaded before the block size was checked")

    monkeypatch.setattr(evaluate, "load_default", no_work)
    for bad in ("12", "0", "64"):
        with pytest.raises(ValueError, match=rf"block_size={bad}; allowed: a divisor of max_new_tokens 32: "
                                             r"1, 2, 4, 8, 16, 32"):
            cli.main(["eval", "--n", "1", "--block-size", bad, "--no-progress"])
    with pytest.raises(ValueError, match="block_size=3"):
        evaluate.run_eval(n=1, block_size=3)
    with pytest.raises(ValueError, match="block_size=True"):
        evaluate.make_rows(True)


def test_eval_block_size_16_end_to_end(monkeypatch, tmp_path):
    import lopa_fast

    seen = []
    real = lopa_fast.generate

    def spy(model, ids, **kw):
        seen.append((kw["strategy"], kw.get("block_size"), kw.get("block_length")))
        return real(model, ids, **kw)

    monkeypatch.setattr(lopa_fast, "generate", spy)
    monkeypatch.chdir(tmp_path)  # default output path is relative: bench/results/...
    argv = ["eval", "--n", "2", "--block-size", "16", "--strategies", "d2f,lopa-k2", "--no-progress"]
    assert cli.main(argv) == 0
    assert seen == [("d2f", 16, None)] * 2 + [("lopa", 16, None)] * 2
    md = tmp_path / "bench/results/eval_auto_n2_block16.md"  # block in the name only when not 8; backend: the default
    text = md.read_text()
    assert "block size 16" in text.splitlines()[0]
    assert "Knobs (temperature 0, max_new_tokens 32, block size 16)" in text
    assert "python -m lopa_fast eval --n 2 --block-size 16 --strategies d2f,lopa-k2" in text
    for row in ("d2f", "lopa-k2"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {row} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1].endswith("%") and float(cells[2]) >= 1.0, line
        assert f"- `{row}`: " in text and "'block_size': 16" in text
    assert "'block_size': 8" not in text
    assert md.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_rows_apply_block_size_to_every_block_knob():
    rows = evaluate.make_rows(32)
    assert rows["vanilla"]["block_size"] == 32 and rows["threshold"]["block_length"] == 32
    assert all(r["block_size"] == 32 for r in rows.values())
    assert evaluate.make_rows() == evaluate.ROWS and evaluate.ROWS["d2f"]["block_size"] == 8


# ---- generate for any model: --json, --chat, --preset, stdin, knob flags, user errors (exit 2, one line) ------
PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . He gives away 5 pens . How many pens does Tom have now ?"


def _cli(*argv, stdin=None):
    return subprocess.run([sys.executable, "-m", "lopa_fast", "generate", *argv], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_generate_json_preset_and_knob_flags():
    import json

    r = _cli("--prompt", PROMPT + " Answer :", "--preset", "lopa-k2", "--max-new-tokens", "13", "--json",
             "--no-use-full-attention", "--backend", "fast")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)  # one JSON object on stdout
    assert set(obj) == {"text", "generated_ids", "stats"}
    st = obj["stats"]
    assert len(obj["generated_ids"]) == st["generated_tokens"] == st["max_new_tokens"] == 13
    assert st["decoded_new_tokens"] == 16 and st["finish_reason"] == "length" and st["backend"] == "fast"
    assert st["strategy"] == "lopa" and obj["text"].startswith("4 * 6 = 24")
    assert "Traceback" not in r.stderr


def test_generate_chat_template_and_stdin():
    r = _cli("--chat", "--strategy", "d2f", "--block-size", "8", "--max-new-tokens", "32", stdin=PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("#### 26")  # the template appends the task's "Answer :" cue
    assert "d2f (fast)" in r.stderr and "finish_reason stop" in r.stderr  # backend auto (the default) runs fast


def test_chat_template_ships_with_the_embedded_tokenizer():
    import lopa_fast
    from lopa_fast.assets import model_dir
    from lopa_fast.tasks.tokenizer import CHAT_TEMPLATE

    tok = lopa_fast.load_tokenizer(model_dir())
    assert tok.chat_template == CHAT_TEMPLATE
    ids = cli.encode_prompt(tok, "Tom has 7 pens .", chat=True)
    assert tok.decode(ids) == "<|beginoftext|> Tom has 7 pens . Answer :"
    assert cli.unknown_words(tok, "Zorg has 7 pens . Blip") == ["Zorg", "Blip"]


def test_generate_knob_flags_are_typed_from_the_config():
    import dataclasses

    from lopa_fast.config import GenerateConfig

    g = cli.build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = {s for a in g._actions for s in a.option_strings}
    for f in dataclasses.fields(GenerateConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    a = g.parse_args(["--max-new-tokens", "7", "--top-p", "0.5", "--no-use-full-attention", "--cache", "dual"])
    assert (a.max_new_tokens, a.top_p, a.use_full_attention, a.cache) == (7, 0.5, False, "dual")
    assert not hasattr(a, "block_size")  # unset knobs keep the config's (or the preset's) default


ERRORS = [
    (["--prompt", "x", "--strategy", "lopa-k4"], "invalid choice: 'lopa-k4'"),  # rows are --preset now
    (["--prompt", "x", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--prompt", "x", "--block-size", "many"], "invalid int value: 'many'"),
    (["--prompt", "   \n"], "the prompt is empty"),
    (["--model", "/no/such/dir", "--prompt", "x"], "--model /no/such/dir: not a directory"),
    (["--prompt", "x", "--skip-threshold", "2"], "skip_threshold=2.0"),  # knob validation (ValueError)
]


@pytest.mark.parametrize("argv,needle", ERRORS, ids=[e[1][:20] for e in ERRORS])
def test_user_errors_exit_2_with_one_line(argv, needle):
    r = _cli(*argv)
    assert r.returncode == 2 and r.stdout == ""
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_more_user_errors_in_process(tmp_path, capsys):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"Tom has \xff pens")
    empty_model = tmp_path / "m"
    empty_model.mkdir()
    cases = [
        (["--prompt-file", str(bad)], "not UTF-8 text (byte 0xff at offset 8)"),
        (["--prompt-file", str(tmp_path / "none.txt")], "cannot read it"),
        (["--model", str(empty_model), "--prompt", "x"], "config.json is missing"),  # CheckpointError
        (["--prompt", "Tom", "--max-new-tokens", "200", "--strategy", "d2f"],
         "prompt length 2 + max_new_tokens 200 = 202 exceeds the model's max_position_embeddings=128"),
        (["--prompt", "Tom", "--strategy", "d2f", "--threshold", "0.9"], "does not apply to strategy='d2f'"),
        (["--prompt", "Tom", "--chat", "--model", str(tmp_path / "ar")], "no chat template"),
    ]
    import shutil

    from lopa_fast.assets import ASSETS_DIR

    shutil.copytree(ASSETS_DIR / "ar-arith", tmp_path / "ar")
    for argv, needle in cases:
        assert cli.main(["generate", *argv], exit_on_error=True) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, (argv, err)
    with pytest.raises(cli.CLIError, match="empty"):  # with an argv list, main raises the typed error
        cli.main(["generate", "--prompt", ""])


def test_unknown_words_are_reported(capsys):
    assert cli.main(["generate", "--prompt", "Zorg has 7 pens . Answer :", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 word(s) unknown to the tokenizer" in err and "'Zorg'" in err


def test_generate_png_writes_the_fill_order_heatmap(tmp_path, capsys):
    import json

    from lopa_fast.viz import png_size

    png = tmp_path / "out" / "fill.png"
    r = _cli("--prompt", PROMPT + " Answer :", "--max-new-tokens", "13", "--json", "--png", str(png),
             "--backend", "fast")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert set(obj) == {"text", "generated_ids", "stats"}  # the trace feeds the picture, not the JSON
    assert png_size(png) == (800, 220) and png.stat().st_size > 2000
    assert f"wrote {png}" in r.stderr and "Traceback" not in r.stderr
    assert cli.main(["generate", "--prompt", "Tom", "--png", str(tmp_path)], exit_on_error=True) == 2
    assert "--png" in capsys.readouterr().err  # a directory: one line, before any decoding


def test_generate_stop_flag(capsys):
    import json

    prompt = ("Tom has 7 pens . He buys 4 bags with 6 pens in each . He gives away 5 pens . "
              "How many pens does Tom have now ? Answer :")
    assert cli.main(["generate", "--preset", "lopa-k4", "--prompt", prompt, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    stop = full["generated_ids"][4:6]
    assert cli.main(["generate", "--preset", "lopa-k4", "--prompt", prompt, "--json",
                     "--stop", ",".join(map(str, stop))]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["finish_reason"] == "stop"
    cut = out["stats"]["stop_sequence_at"]
    assert out["generated_ids"] == full["generated_ids"][:cut] and cut <= 4
    assert cli.token_sequences("13,198;7") == [[13, 198], [7]]
