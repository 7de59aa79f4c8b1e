"""Streaming and the per-round hook: `lopa_fast.stream` (text as it becomes final, then generate's text and stats),
generate's `on_round=` on every strategy and both backends, text stops, the CLI's --stream / --show-steps."""
from __future__ import annotations

import subprocess
import sys

import pytest

import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.request.text import answer_text, held_back, split_stops, text_decoder
from lopa_fast.viz import StepView

PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . He gives away 5 pens . How many pens does Tom have now ?"
TIMING = ("seconds", "tokens_per_second", "host_reads", "host_reads_per_round")  # the hook adds one read per round


@pytest.fixture(scope="module")
def embedded():
    return lopa_fast.load_model(model_dir()), lopa_fast.load_tokenizer(model_dir())


def _same_stats(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


@pytest.mark.parametrize("backend", ["reference", "fast"])
@pytest.mark.parametrize("knobs", [dict(strategy="lopa", branching_factor=4, block_size=8, max_new_tokens=32),
                                   dict(strategy="d2f", block_size=4, max_new_tokens=30)])
def test_stream_equals_generate(embedded, backend, knobs):
    model, tok = embedded
    rounds = []
    s = lopa_fast.stream(model, PROMPT + " Answer :", tokenizer=tok, backend=backend,
                         on_round=lambda prefix, info: rounds.append((list(prefix), info["round"])), **knobs)
    pieces = list(s)
    ids = tok(PROMPT + " Answer :")["input_ids"]
    out = lopa_fast.generate(model, ids, backend=backend, **knobs)
    assert s.result.generated_ids == out.generated_ids and _same_stats(s.result.stats, out.stats)
    text = answer_text(out, text_decoder(tok), model.eos_token_id)
    assert "".join(pieces) == s.text == text and text.endswith("#### 26")
    assert len(pieces) >= 3  # the text arrived over several rounds, not at the end
    assert [r for _, r in rounds] == list(range(1, out.stats["forwards"] + 1))
    for (a, _), (b, _) in zip(rounds, rounds[1:]):  # the finalised prefix only grows, and is the output's prefix
        assert b[: len(a)] == a and out.generated_ids[: len(b)] == b[: len(out.generated_ids)]
    assert s.result.stats["host_reads"] == out.stats["host_reads"] + out.stats["forwards"] if backend == "fast" else True


def test_hook_prefixes_match_across_backends(embedded):
    model, tok = embedded
    ids = tok(PROMPT + " Answer :")["input_ids"]
    logs = {}
    for backend in ("reference", "fast"):
        log = []
        lopa_fast.generate(model, ids, "lopa", backend, block_size=8, max_new_tokens=32,
                           on_round=lambda p, i: log.append((p, i["round"], i["canvas"])))
        logs[backend] = log
    assert logs["reference"] == logs["fast"] and len(logs["fast"][0][2]) == 32


def test_stream_blocks_are_whole(embedded):
    """A block's text is shown once the block and every earlier one are complete (block_size 8: every piece
    ends on a block boundary of the token stream, except the last, which the final text completes)."""
    model, tok = embedded
    shown_lengths = []
    s = lopa_fast.stream(model, PROMPT + " Answer :", tokenizer=tok, strategy="lopa", block_size=8, max_new_tokens=32,
                         on_round=lambda p, i: shown_lengths.append(len(p) // 8 * 8))
    pieces = list(s)
    assert all(n % 8 == 0 for n in shown_lengths) and len(pieces) >= 2
    assert "".join(pieces) == s.text


def test_text_stop_cuts_and_ends_early(embedded):
    model, tok = embedded
    kw = dict(strategy="lopa", block_size=8, max_new_tokens=32)
    full = lopa_fast.stream(model, PROMPT + " Answer :", tokenizer=tok, **kw)
    list(full)
    s = lopa_fast.stream(model, PROMPT + " Answer :", tokenizer=tok, stop=[". 7 +"], **kw)
    pieces = list(s)
    assert "".join(pieces) == s.text == full.text.split(" . 7 +")[0] == "4 * 6 = 24"
    st = s.result.stats
    assert st["finish_reason"] == "stop" and st["forwards"] < full.result.stats["forwards"]  # tokenised: early end
    # a stop string that is not a token sequence of its own still cuts the text ("24 ." ends inside the answer)
    seqs, texts = split_stops(tok, ["4 .", [5, 6]])
    assert texts == ["4 ."] and [5, 6] in seqs
    s2 = lopa_fast.stream(model, PROMPT + " Answer :", tokenizer=tok, stop=["= 24 . 7 + 2"], **kw)
    assert "".join(s2) == "4 * 6"


def test_held_back():
    assert held_back("a b ", []) == "a b"
    assert held_back("x\n", ["\n\n"]) == "x"  # the start of a stop string waits
    assert held_back("ab\ufffd", []) == "ab"  # an unfinished multi-byte character waits


def test_stream_bad_input_raises_before_decoding(embedded):
    model, tok = embedded
    for bad in ("", "  \n\t"):
        with pytest.raises(lopa_fast.KnobError, match="empty"):
            lopa_fast.stream(model, bad, tokenizer=tok)
    with pytest.raises(TypeError, match="tokenizer"):
        lopa_fast.stream(model, "Tom has 7 pens .")
    with pytest.raises(ValueError, match="skip_threshold"):
        lopa_fast.stream(model, "Tom has 7 pens .", tokenizer=tok, skip_threshold=2.0)
    with pytest.raises(TypeError, match="unknown keyword"):
        lopa_fast.stream(model, "Tom has 7 pens .", tokenizer=tok, frobnicate=1)
    with pytest.warns(UserWarning, match="'Zorg'"):
        lopa_fast.stream(model, "Zorg has 7 pens . Answer :", tokenizer=tok, max_new_tokens=8)


def test_stream_close_stops_decoding(embedded):
    model, tok = embedded
    seen = []
    s = lopa_fast.stream(model, PROMPT + " Answer :", tokenizer=tok, strategy="d2f", block_size=4, max_new_tokens=32,
                         on_round=lambda p, i: seen.append(i["round"]))
    next(iter(s))
    s.close()
    assert s.result is None and len(seen) < 8  # closed after the first piece: decoding did not run to the end


def test_hook_errors_propagate_and_fast_without_hook_support():
    from lopa_fast.testing import random_model, tiny_hf_config

    model = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)

    def boom(prefix, info):
        raise KeyError("stop here")

    for strategy in ("vanilla", "threshold", "d2f", "lopa"):
        extra = dict(threshold=0.5) if strategy == "threshold" else {}
        with pytest.raises(KeyError, match="stop here"):
            lopa_fast.generate(model, [1, 2, 3], strategy, "reference", max_new_tokens=8, block_size=4, on_round=boom,
                               **extra)
    with pytest.raises(TypeError, match="on_round"):
        lopa_fast.generate(model, [1, 2, 3], "d2f", max_new_tokens=8, block_size=4, on_round=3)


def test_step_view_lines():
    import io

    buf = io.StringIO()
    view = StepView(out=buf, tty=False)
    view([5], {"round": 1, "canvas": [5, 9, 9], "mask_token_id": 9})
    view([5, 6, 7], {"round": 2, "canvas": [5, 6, 7], "mask_token_id": 9})
    assert buf.getvalue().splitlines() == ["round 1 (1/3 filled): 5 _ _", "round 2 (3/3 filled): 5 6 7"]
    tty = io.StringIO()
    view = StepView(out=tty, tty=True, width=80)
    view([], {"round": 1, "canvas": [9, 9], "mask_token_id": 9})
    view([5], {"round": 2, "canvas": [5, 9], "mask_token_id": 9})
    assert "\x1b[1F\x1b[J" in tty.getvalue()  # redrawn in place on a terminal


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "lopa_fast", "generate", *argv], capture_output=True, text=True,
                          timeout=300)


def test_cli_stream_and_show_steps():
    r = _cli("--prompt", PROMPT + " Answer :", "--stream", "--backend", "fast")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "4 * 6 = 24 . 7 + 24 = 31 . 31 - 5 = 26 . #### 26"
    assert "finish_reason stop" in r.stderr
    r = _cli("--prompt", PROMPT + " Answer :", "--show-steps", "--strategy", "d2f", "--block-size", "8",
             "--max-new-tokens", "32")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    steps = [ln for ln in lines if ln.startswith("round ")]  # not a terminal: one plain line per round
    assert len(steps) >= 3 and steps[0].startswith("round 1 (") and "_" in steps[0]
    assert "\x1b[" not in r.stdout and lines[-1].endswith("#### 26")


def test_cli_text_stop_and_exclusive_views(capsys):
    from lopa_fast import cli

    assert cli.main(["generate", "--prompt", PROMPT + " Answer :", "--stream", "--stop-text", ". 7 +"]) == 0
    assert capsys.readouterr().out.strip() == "4 * 6 = 24"
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", PROMPT, "--stream", "--json"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert cli.text_stop(r"a\n\tb\\") == "a\n\tb\\"


