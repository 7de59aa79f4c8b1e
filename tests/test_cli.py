"""`python -m lopa_fast demo / eval / generate` end to end on the embedded model."""
import re
import subprocess
import sys

import pytest

from lopa_fast import cli
from lopa_fast.tasks import evaluate
from tests.utils import markdown_row



def test_demo_runs(capsys):
    """The README's main job shows what LoPA is for: on its default task (arith-var, model d2f-arith-var) LoPA k=4
    answers as D2F does in fewer forwards, with lookahead wins, and says so in its last lines."""
    assert cli.main(["demo", "--n", "1"]) == 0
    wrapped = capsys.readouterr().out
    assert max(map(len, wrapped.splitlines())) <= 110  # lopa_fast.tasks.evaluate.DEMO_WIDTH
    out = re.sub(r"\n(?: {2}| {5})(?=\S)", " ", wrapped)  # the wrapped lines joined (continuations: indent 2 or 5)
    for needle in ("Q:", "d2f", "lopa-k4", "TPF", "forwards", "round:", "tokens:", "exact match", "task arith-var",
                   "d2f-arith-var"):
        assert needle in out, needle
    assert "unavailable" not in out
    forwards = {row: int(m) for row, m in re.findall(r"^   (d2f|lopa-k4) .*\n +TPF .*?forwards (\d+)", out, re.M)}
    wins = re.search(r"forwards \d+, wall \d+ ms, lookahead wins (\d+)", out)
    assert forwards["lopa-k4"] < forwards["d2f"] and int(wins.group(1)) > 0, out
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("LoPA k=4: "))
    assert re.fullmatch(rf"LoPA k=4: {forwards['lopa-k4']} forwards in \d+\.\d\d s for 1 answers \(1/1 right\) "
                        rf"against D2F's {forwards['d2f']} forwards in \d+\.\d\d s \(1/1 right\): "
                        rf"{forwards['d2f'] / forwards['lopa-k4']:.2f}x fewer forwards, \d+\.\d\dx D2F's speed in "
                        r"wall time", lines[i]), lines[i]
    assert lines[i + 1] == evaluate.WHY_WALL_TIME  # why the two ratios differ on a CPU


def test_eval_n5_writes_table(tmp_path):
    md = tmp_path / "eval.md"
    assert cli.main(["eval", "--n", "5", "--task", "arith", "--out", str(md), "--no-progress"]) == 0
    text = md.read_text()
    for row in evaluate.ROWS:
        cells = markdown_row(text, row)
        assert cells[1].endswith("%"), cells  # ran (not "unavailable")
        assert float(cells[2]) >= 1.0 and float(cells[4]) > 0  # TPF >= 1, forwards per answer
    assert "python -m lopa_fast eval --n 5 --task arith" in text and evaluate.WHY_WALL_TIME in text
    png = md.with_suffix(".png").read_bytes()  # TPF / accuracy against k
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_eval_default_task_is_arith_var():
    """eval's default is the task where parallel decoding is hard (LoPA's rows differ there; on arith they tie)."""
    args = cli.build_parser().parse_args(["eval"])
    assert args.task == "arith-var" == evaluate.DEMO_TASK


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
    assert markdown_row((tmp_path / "e.md").read_text(), "d2f")[1:] == ["unavailable", "-", "-", "-", "-"]


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


def test_help_and_a_bad_flag_import_no_torch():
    """--help and a user error answer before the heavy imports (torch, FastAPI, transformers: ~4 s): the parser is
    built from light modules (lopa_fast.config, the tasks' tables, lopa_fast.server.served)."""
    code = ("import sys, runpy\nsys.argv = ['lopa_fast'] + sys.argv[1:]\ntry:\n"
            "    runpy.run_module('lopa_fast', run_name='__main__')\nexcept SystemExit as e:\n"
            "    heavy = sorted(m for m in ('torch', 'fastapi', 'transformers', 'numpy') if m in sys.modules)\n"
            "    print('heavy:', heavy, 'exit:', e.code)\n")
    for argv in (["--help"], ["serve", "--help"], ["generate", "--no-such-flag"], ["generate", "--threads", "0"]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert r.stdout.splitlines()[-1] in ("heavy: [] exit: 0", "heavy: [] exit: 2"), (argv, r.stdout, r.stderr)


def test_a_second_process_builds_nothing(tmp_path):
    """Two CLI decodes in a row on one fresh set of cache directories: the second writes nothing to them (nothing is
    rebuilt per process), and neither does --help or a refused flag. Judged by file times, not by the clock."""
    import os
    import time

    caches = {"LOPA_FAST_CACHE_DIR": tmp_path / "lopa", "TRITON_CACHE_DIR": tmp_path / "triton",
              "TORCHINDUCTOR_CACHE_DIR": tmp_path / "inductor", "XDG_CACHE_HOME": tmp_path / "xdg"}
    env = {**os.environ, **{k: str(v) for k, v in caches.items()}}

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "lopa_fast", *argv], capture_output=True, text=True, env=env,
                              timeout=600)

    def files():
        return {p: p.stat().st_mtime_ns for d in caches.values() if d.exists() for p in d.rglob("*") if p.is_file()}

    first = run("generate", "--prompt", PROMPT)
    assert first.returncode == 0, first.stderr[-2000:]
    before = files()
    time.sleep(0.05)  # distinct modification times for anything written from here on
    for argv in (("generate", "--prompt", PROMPT), ("--help",), ("generate", "--no-such-flag")):
        r = run(*argv)
        assert r.returncode in (0, 2), r.stderr[-2000:]
        assert files() == before, f"{argv} wrote to the caches: {sorted(set(files().items()) - set(before.items()))}"


def test_eval_plot_is_matplotlib_png(tmp_path):
    from tests.utils import png_size

    path = tmp_path / "c.png"
    rows = [{"row": r, "status": "ok", "tpf": t, "accuracy": 0.9} for r, t in (("d2f", 6.0), ("lopa-k2", 6.5))]
    assert evaluate.plot(rows, path) is None
    assert png_size(path) == (550, 418)  # figsize (5, 3.8) at dpi 110
    assert evaluate.plot([{"row": "vanilla", "status": "ok"}], tmp_path / "n.png") is not None


def test_eval_block_size_bad_value_errors_before_any_work(monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("the model was loaded before the block size was checked")

    monkeypatch.setattr(evaluate, "load_default", no_work)
    for bad in ("12", "0", "64"):
        with pytest.raises(ValueError, match=rf"block_size={bad}; allowed: a divisor of max_new_tokens 32: "
                                             r"1, 2, 4, 8, 16, 32"):
            cli.main(["eval", "--task", "arith", "--n", "1", "--block-size", bad, "--no-progress"])
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
    monkeypatch.chdir(tmp_path)  # default output directory is relative: ./lopa_fast_eval/
    argv = ["eval", "--task", "arith", "--n", "2", "--block-size", "16", "--strategies", "d2f,lopa-k2", "--no-progress"]
    assert cli.main(argv) == 0
    assert seen == [("d2f", 16, None)] * 2 + [("lopa", 16, None)] * 2
    md = tmp_path / "lopa_fast_eval/eval_auto_n2_block16.md"  # block in the name only when not 8; backend: the default
    text = md.read_text()
    assert "block size 16" in text.splitlines()[0]
    assert "Knobs (temperature 0, max_new_tokens 32, block size 16)" in text
    assert "python -m lopa_fast eval --task arith --n 2 --block-size 16 --strategies d2f,lopa-k2" in text
    for row in ("d2f", "lopa-k2"):
        cells = markdown_row(text, row)
        assert cells[1].endswith("%") and float(cells[2]) >= 1.0, cells
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


def test_generate_help_is_built_from_the_knobs(capsys):
    """`generate --help` (issue 26): every knob flag shows the field's own description (GenerateConfig metadata), its
    choices (the tuples of config.py and lopa_fast/strategies, not copies) and the value it runs with: the embedded
    model's preset where it applies (block size 8, 32 new tokens), GenerateConfig's default otherwise."""
    import dataclasses
    import typing

    from lopa_fast import config, strategies
    from lopa_fast.config import GenerateConfig, knob_choices
    from lopa_fast.request.knobs import SAMPLING_STRATEGIES
    from lopa_fast.strategies.threshold.knobs import CACHE_MODES
    from lopa_fast.strategies.vanilla.knobs import DREAM_ALGS, REMASKING

    fields = dataclasses.fields(GenerateConfig)
    for f in fields:
        assert f.metadata.get("help") and "\n" not in f.metadata["help"], f"GenerateConfig.{f.name}: no one-line help"
        assert f.default is not None or f.metadata.get("unset"), \
            f"GenerateConfig.{f.name}: default None needs knob(..., unset='what None runs as') for --help"
    g = cli.build_parser()._subparsers._group_actions[0].choices["generate"]
    actions = {a.dest: a for a in g._actions}
    for f in fields:
        a = actions[f.name]
        assert a.help.startswith(f.metadata["help"]) and "(default: " in a.help, (f.name, a.help)
        if f.name not in ("strategy", "backend", "compile"):  # knob flags; those three are shared flags
            assert a.choices == knob_choices(f), f.name
    assert actions["alg"].choices == DREAM_ALGS and actions["remasking"].choices == REMASKING
    assert actions["cache"].choices == tuple(c for c in CACHE_MODES if c is not None)
    assert actions["sampling_strategy"].choices == SAMPLING_STRATEGIES
    assert actions["sampler"].choices == config.SAMPLERS
    assert tuple(actions["strategy"].choices) == strategies.names()
    text = " ".join(g.format_help().split())
    assert "(default model's)" not in text and text.count("(default: the model's)") == 2  # mask / eos ids only
    assert ("--block-size INT tokens per block (d2f / lopa; threshold's block_length when that is unset) (default: 8 "
            "on the embedded model, its preset lopa-k4; GenerateConfig: 32)") in text
    assert "--max-new-tokens INT new tokens to return" in text and "(default: 32 on the embedded model" in text
    assert "--alg {origin,maskgit_plus,topk_margin,entropy} Dream vanilla: " in text and "(default: origin)" in text
    assert "--branching-factor INT LoPA's k: lookahead branches per round" in text
    # the value shown is the one that runs: the preset on the embedded model, GenerateConfig's with --model
    args = g.parse_args(["--prompt", "x"])
    knobs = cli.generate_knobs(args, args.knob_names)
    assert (knobs["block_size"], knobs["max_new_tokens"]) == (8, 32)
    assert "(default: 4)" in actions["branching_factor"].help
    args = g.parse_args(["--prompt", "x", "--model", "DIR"])
    assert "block_size" not in cli.generate_knobs(args, args.knob_names)  # GenerateConfig's 32
    # flag types come from the resolved type hints, not from annotation strings
    hints = typing.get_type_hints(GenerateConfig)
    assert cli.knob_type(hints["top_k"]) == (int, False) and cli.knob_type(hints["logits_eos_inf"]) == (bool, True)
    assert cli.knob_type(hints["stop"]) == (cli.token_sequences, False)
    with pytest.raises(TypeError, match="no command-line flag type"):
        cli.knob_type(list[str])
    with pytest.raises(SystemExit) as e:  # a choice outside the tuple: argparse's one line, exit 2
        cli.main(["generate", "--prompt", "x", "--alg", "bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'bogus'" in err and len(err.strip().splitlines()) == 1


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


def test_user_error_is_one_line_on_a_busy_machine():
    """torch's import taking >= 2 s (logs.LONG_S; a loaded machine) puts no line before a user error found after it:
    the after-the-fact "imported torch in X s" is -v's only (seen: 3 lines in a fresh-clone CI run under load)."""
    slow_torch = ("import importlib.abc, sys, time\n"
                  "class Slow(importlib.abc.MetaPathFinder):\n"
                  "    def find_spec(self, name, path=None, target=None):\n"
                  "        if name == 'torch':\n"
                  "            sys.meta_path.remove(self)\n"
                  "            time.sleep(2.2)\n"
                  "        return None\n"
                  "sys.meta_path.insert(0, Slow())\n"
                  "import runpy; sys.argv = ['lopa_fast'] + sys.argv[1:]\n"
                  "runpy.run_module('lopa_fast', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", slow_torch, "generate", "--model", "/no/such/dir", "--prompt", "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "python -m lopa_fast: error: --model /no/such/dir: not a directory (an HF-format model directory with "
        "config.json)"], r.stderr


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


def test_a_too_long_request_fails_before_the_weights_load(monkeypatch, capsys):
    """The length checks run on config.json before the weights load (a 7B checkpoint's takes ~10 s, and its progress
    lines would precede the one-line error): a too-long request never calls load_model; a fitting one loads once."""
    import lopa_fast

    loads = []
    real = lopa_fast.load_model
    monkeypatch.setattr(lopa_fast, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    for argv, needle in (
        (["--max-new-tokens", "200", "--strategy", "d2f"], "= 202 exceeds the model's max_position_embeddings=128"),
        (["--max-length", "300"], "= 300 exceeds the model's max_position_embeddings=128"),
    ):
        assert cli.main(["generate", "--prompt", "Tom", *argv], exit_on_error=True) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert loads == []
    assert cli.main(["generate", "--prompt", PROMPT + " Answer :", "--max-new-tokens", "4"]) == 0
    assert len(loads) == 1


def test_unknown_words_are_reported(capsys):
    assert cli.main(["generate", "--prompt", "Zorg has 7 pens . Answer :", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 word(s) unknown to the tokenizer" in err and "'Zorg'" in err


def test_generate_png_writes_the_fill_order_heatmap(tmp_path, capsys):
    import json

    from tests.utils import png_size

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
                     "--stop", ",".join(map(str, stop))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["finish_reason"] == "stop"
    cut = out["stats"]["stop_sequence_at"]
    assert out["generated_ids"] == full["generated_ids"][:cut] and cut <= 4
    assert cli.token_sequences("13,198;7") == [[13, 198], [7]]


# ---- issue 26: log lines for long steps, -v / -q, user errors before any work, eval's output, serve's flags ----
def _records(caplog, name):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == name]


def test_library_adds_only_a_null_handler():
    import logging

    import lopa_fast  # noqa: F401

    handlers = logging.getLogger("lopa_fast").handlers
    assert handlers and all(type(h) is logging.NullHandler for h in handlers)


def test_a_step_that_runs_long_says_so_while_it_runs(monkeypatch, caplog):
    """A step not expected to be long (model load, torch's import, lm-eval's import) announces itself at INFO once
    it has run LONG_S seconds, before it ends, and its after-line is at INFO too; a short one stays at DEBUG."""
    import logging
    import time

    from lopa_fast import logs

    monkeypatch.setattr(logs, "LONG_S", 0.05)
    log = logging.getLogger("lopa_fast.test_step")
    with caplog.at_level(logging.INFO, logger="lopa_fast"):
        with logs.step(log, "doing a slow thing", "did the slow thing", long=False):
            time.sleep(0.5)
            during = [r.getMessage() for r in caplog.records]
        with logs.step(log, "doing a quick thing", "did the quick thing", long=False):
            pass
    assert during == ["doing a slow thing..."]
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert msgs[0] == (logging.INFO, "doing a slow thing...") and msgs[1][1].startswith("did the slow thing in")
    assert len(msgs) == 2, msgs  # the quick step: nothing at INFO


def test_compile_says_what_it_is_doing(monkeypatch, caplog):
    import logging
    import re

    import torch

    from lopa_fast.decode import compiled

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the log lines, not Inductor's seconds
    cr = compiled.CompiledRounds()
    with caplog.at_level(logging.INFO, logger="lopa_fast"):
        for _ in range(2):  # compiled once, then replayed silently
            assert cr.call(("k",), (8, 2), "part", lambda: (lambda x: x + 1), torch.ones(2)).tolist() == [2.0, 2.0]
    (l1, m1), (l2, m2) = _records(caplog, "lopa_fast.decode.compiled")
    assert l1 == l2 == logging.INFO
    assert m1 == "compiling the round part part (torch.compile, the first request of this shape)..."
    assert re.fullmatch(r"compiled the round part part in \d+\.\d s", m2)


def test_model_load_is_logged_with_a_bar_over_its_shards(tmp_path, monkeypatch, caplog, capsys):
    """A large load (LONG_LOAD_BYTES and up) says what it loads and how long it took, with a bar over the shards
    where INFO is shown; a small one says it at DEBUG, and a library user who enabled nothing sees no bar."""
    import json
    import logging
    import re

    import torch

    import lopa_fast
    from lopa_fast.assets import model_dir
    from lopa_fast.models import loading

    src = model_dir()
    model = lopa_fast.load_model(src, dtype=torch.float32)
    loading.save_checkpoint(model, tmp_path / "m", json.loads((src / "config.json").read_text()), shard_size=8)
    with caplog.at_level(logging.INFO, logger="lopa_fast"):
        lopa_fast.load_model(tmp_path / "m", dtype=torch.float32)  # small: DEBUG lines, not shown at INFO
        assert not any(m.startswith("loading ") for _, m in _records(caplog, "lopa_fast.models.loading"))
        monkeypatch.setattr(loading, "LONG_LOAD_BYTES", 0)  # as a multi-GB checkpoint
        capsys.readouterr()
        lopa_fast.load_model(tmp_path / "m", dtype=torch.float32)
    msgs = [m for _, m in _records(caplog, "lopa_fast.models.loading")]
    assert msgs[-2] == f"loading {tmp_path / 'm'} (0.00 GiB in float32 to cpu)..."
    assert re.fullmatch(r"loaded m in \d+\.\d s", msgs[-1])
    assert "shards" in capsys.readouterr().err  # tqdm's bar over the shard files
    with caplog.at_level(logging.WARNING, logger="lopa_fast"):  # a library user who configured no logging
        lopa_fast.load_model(tmp_path / "m", dtype=torch.float32)
    assert "shards" not in capsys.readouterr().err


def test_cli_log_lines_default_quiet_verbose(monkeypatch, capsys):
    """Default: lopa_fast's INFO lines on stderr; -q: none; -v: DEBUG too; the logger is left as it was."""
    import logging

    from lopa_fast.models import loading

    logger = logging.getLogger("lopa_fast")
    before = (logger.level, list(logger.handlers))

    def err(*flags):
        assert cli.main(["generate", *flags, "--prompt", PROMPT + " Answer :", "--max-new-tokens", "8"]) == 0
        return capsys.readouterr().err

    loading_line = "lopa_fast.models.loading: loading "
    assert loading_line not in err() and loading_line in err("-v")  # a small load is a DEBUG line
    monkeypatch.setattr(loading, "LONG_LOAD_BYTES", 0)  # as a multi-GB checkpoint: INFO
    assert loading_line in err() and "lopa_fast." not in err("-q")
    assert (logger.level, list(logger.handlers)) == before
    for cmd in ("demo", "eval", "generate", "serve"):
        text = cli.build_parser()._subparsers._group_actions[0].choices[cmd].format_help()
        assert "-v, --verbose" in text and "-q, --quiet" in text, cmd
    with pytest.raises(SystemExit):
        cli.main(["generate", "-v", "-q", "--prompt", "x"])


def test_cli_log_lines_reach_a_real_stderr():
    """-v in a real process: the load's lines before a decode; a too-long request's one-line error comes before any
    load (the lengths are checked on config.json), so no load line precedes it."""
    r = _cli("-v", "--prompt", "Tom", "--max-new-tokens", "200", "--strategy", "d2f")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == "lopa_fast.cli: importing torch..." and lines[1].startswith("lopa_fast.cli: imported torch in")
    assert not any("loading" in line for line in lines), lines
    assert lines[-1].startswith("python -m lopa_fast: error: prompt length 2 + max_new_tokens 200")
    r = _cli("-v", "--prompt", "Tom", "--max-new-tokens", "4", "--strategy", "d2f")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 0, r.stderr
    load = next(i for i, line in enumerate(lines) if line.startswith("lopa_fast.models.loading: loading "))
    assert "loaded d2f-arith in" in lines[load + 1]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a torch without CUDA")
def test_device_cuda_without_cuda_is_one_line_exit_2():
    r = _cli("--prompt", "x", "--device", "cuda")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    version = __import__("torch").__version__
    assert r.stderr.strip() == (f"python -m lopa_fast: error: --device cuda: this torch {version} has no CUDA "
                                "(built without CUDA); available: cpu")


def test_bad_backend_environment_names_the_variable(monkeypatch):
    import torch

    from lopa_fast import ops

    r = subprocess.run([sys.executable, "-m", "lopa_fast", "generate", "--prompt", "x"], capture_output=True,
                       text=True, timeout=300, env={**__import__("os").environ, "LOPA_FAST_BACKEND": "garbage"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "environment variable LOPA_FAST_BACKEND='garbage'; allowed: auto, cuda, triton, cpp, torch" in r.stderr
    monkeypatch.setenv("LOPA_FAST_BACKEND", "garbage")  # the library path names it too
    with pytest.raises(ValueError, match="LOPA_FAST_BACKEND='garbage'"):
        ops.confidence(torch.randn(2, 5))


def test_user_errors_before_any_work(tmp_path, monkeypatch, capsys):
    """Each is one line, exit 2, found before a model is loaded."""
    import lopa_fast

    def no_work(*a, **k):
        raise AssertionError("a model was loaded before the user error was found")

    monkeypatch.setattr(lopa_fast, "load_model", no_work)
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    cases = [
        (["generate", "--prompt", "x", "--device", "cuda:99"], "--device cuda:99: "),
        (["serve", "--device", "cuda:99"], "--device cuda:99: "),
        (["generate", "--prompt", "x", "--device", "gpu"], "--device gpu: not a device name (like cpu, cuda, cuda:1)"),
        (["generate", "--prompt-file", "/dev/zero"], "--prompt-file /dev/zero: more than 4 MiB, the cap on a prompt"),
        (["eval", "--n", "1", "--out", str(a_file / "sub")], f"--out {a_file / 'sub'}: cannot write under"),
        (["generate", "--prompt", "x", "--png", str(a_file / "x.png")], "cannot write under"),
    ]
    for argv, needle in cases:
        assert cli.main(argv, exit_on_error=True) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, (argv, err)
        if "--device" in needle:
            assert "available: cpu" in err
    for argv, needle in ((["generate", "--preset", "nope", "--prompt", "x"], "invalid choice: 'nope'"),
                         (["generate", "--dtype", "fp8", "--prompt", "x"], "invalid choice: 'fp8'")):
        with pytest.raises(SystemExit) as e:  # argparse's own: one line too (_Parser.error)
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_eval_output_path_is_the_users_choice():
    from pathlib import Path

    assert evaluate.out_path(None, "auto", 230) == Path("lopa_fast_eval/eval_auto_n230.md")
    committed = Path("bench/results/eval_reference_n230_block32.md")
    assert evaluate.out_path("bench/results", "reference", 230, 32) == committed  # named explicitly: as committed
    assert evaluate.out_path("d", "fast", 5, task="arith-var") == Path("d/eval_fast_n5_arith_var.md")
    assert evaluate.out_path("t.md", "auto", 5, 16, "arith-var") == Path("t.md")
    text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["eval"].format_help().split())
    assert "default ./lopa_fast_eval/ under the current directory" in text and "--out bench/results" in text


def test_eval_never_overwrites_bench_results_unless_named(tmp_path, monkeypatch):
    """`eval` run from a checkout leaves its committed bench/results tables alone; `--out bench/results` rewrites."""
    committed = tmp_path / "bench/results/eval_auto_n1.md"
    committed.parent.mkdir(parents=True)
    committed.write_text("committed")
    monkeypatch.chdir(tmp_path)
    argv = ["eval", "--task", "arith", "--n", "1", "--strategies", "d2f", "--no-progress"]
    assert cli.main(argv) == 0
    assert committed.read_text() == "committed"
    assert (tmp_path / "lopa_fast_eval/eval_auto_n1.md").read_text().startswith("# Eval")
    assert cli.main([*argv, "--out", "bench/results"]) == 0
    assert committed.read_text().startswith("# Eval")


def test_quiet_eval_draws_no_progress_bar(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(evaluate, "run_eval", lambda **kw: seen.append(kw["progress"]))
    monkeypatch.chdir(tmp_path)
    for flags in ([], ["-q"], ["--no-progress"]):
        assert cli.main(["eval", *flags, "--n", "1"]) == 0
    assert seen == [True, False, False]


def test_serve_help_offers_only_served_flags():
    import re

    from lopa_fast.server.protocol import NOT_SERVED

    subs = cli.build_parser()._subparsers._group_actions[0].choices
    serve_help, generate_help = subs["serve"].format_help(), subs["generate"].format_help()
    for name in NOT_SERVED:
        flag = re.compile(rf"(?<![\w-])--{name.replace('_', '-')}(?![\w-])")
        assert flag.search(generate_help) and not flag.search(serve_help), name
    pytest.importorskip("fastapi")
    with pytest.raises(cli.CLIError, match=r"--return-trace is not a server default \(the server returns no traces\)"):
        cli.main(["serve", "--return-trace"])  # still parsed: refused with its reason, not "unrecognized"
