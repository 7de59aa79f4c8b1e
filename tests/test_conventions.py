"""Issue 35: the knobs users bring from Hugging Face `generate` and vLLM's server, the same on every surface (generate,
stream, the CLI, the server): accepted where they mean the same, accepted with a meaning, refused in one line naming
the lopa_fast way. ROWS is docs/decoding.md's table ("Knobs from other libraries"), row for row; each row runs on
every surface it names (the server through protocol.parse: the request's checks and its knobs, no decoding).

Plus the surfaces' other conventions: generate takes a str prompt and text stops like stream, a TextStreamer-style
streamer, and a qwen2 checkpoint is told the real reason first."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

import lopa_fast
from lopa_fast import cli
from lopa_fast.assets import model_dir
from lopa_fast.errors import KnobError
from lopa_fast.server.protocol import RequestError, parse

DOCS = Path(__file__).resolve().parents[1] / "docs" / "decoding.md"
PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . How many pens ? Answer :"
BASE = dict(strategy="d2f", block_size=8, max_new_tokens=8)
SURFACES = ("generate", "stream", "cli", "server")


@pytest.fixture(scope="module")
def embedded():
    m = lopa_fast.load_model(model_dir(), dtype=torch.float32)
    return m, lopa_fast.load_tokenizer(model_dir())


def _ids(tok):
    return tok(PROMPT)["input_ids"]


# name -> {surface: (knobs or CLI flags, expectation)}; expectation: ("same", knobs of the same meaning),
# ("refused", field, needle) or ("warns", needle)
ONES = "ones"  # an all-ones attention mask of the prompt's length (built per surface)
ZERO = "zero"  # the same with a 0 at position 0 (padding)
ON3 = ("generate", "stream", "server")
ROWS = {
    "attention_mask (all ones)": {s: ({"attention_mask": ONES}, ("same", {}))
                                  for s in ON3},
    # generate decodes a padded batch as its unpadded rows (tests/test_newcomer.py); stream and the server refuse it
    "attention_mask (a 0)": {s: ({"attention_mask": ZERO}, ("refused", "attention_mask", r"zero\(s\) \(padding"))
                             for s in ("stream", "server")},
    "pad_token_id": {s: ({"pad_token_id": 0}, ("same", {})) for s in ON3},
    "use_cache": {s: ({"use_cache": True}, ("same", {})) for s in ON3},
    "top_k=0 / top_k=-1": {**{s: ({"top_k": -1, "temperature": 0.7, "seed": 3},
                                  ("same", {"temperature": 0.7, "seed": 3})) for s in ON3},
                           "cli": (["--top-k", "0", "--temperature", "0.7", "--seed", "3"],
                                   ("same", ["--temperature", "0.7", "--seed", "3"]))},
    "top_p at temperature 0": {**{s: ({"top_p": 0.9}, ("warns", "top_p=0.9 has no effect at temperature=0"))
                                  for s in ON3},
                               "cli": (["--top-p", "0.9"], ("warns", "top_p=0.9 has no effect at temperature=0"))},
    "do_sample": {**{s: ({"do_sample": False}, ("same", {})) for s in ON3},
                  "cli": (["--no-do-sample"], ("same", []))},
    "max_length": {**{s: ({"max_length": "P+8", "max_new_tokens": None}, ("same", {}))
                      for s in ("generate", "stream")},
                   "cli": (["--max-length", "P+8"], ("same", [])),
                   "server": ({"max_length": 30}, ("refused", "max_length", "pass max_tokens"))},
    "eos_token_id (a list)": {s: ({"eos_token_id": "[eos, 9]"}, ("same", {"eos_token_id": "eos", "stop": [[9]]}))
                              for s in ON3},
    "n": {**{s: ({"n": 2}, ("refused", "n", "n=2")) for s in ON3},
          "cli": (["--n", "2"], ("refused", "n", "--n 2: one output per prompt"))},
    "typical_p": {**{s: ({"typical_p": 0.9},
                         ("refused", "typical_p", "typical_p=0.9 is not a lopa_fast knob: .*top_p=")) for s in ON3},
                  "cli": (["--typical-p", "0.9"], ("refused", "typical_p", "--typical-p 0.9: not a lopa_fast knob"))},
    "no_repeat_ngram_size": {**{s: ({"no_repeat_ngram_size": 3},
                                    ("refused", "no_repeat_ngram_size", "not a lopa_fast knob")) for s in ON3},
                             "cli": (["--no-repeat-ngram-size", "3"], ("refused", "", "not a lopa_fast knob"))},
    "logprobs": {**{s: ({"logprobs": 2},
                        ("refused", "logprobs", "logprobs=2 is not a lopa_fast knob: .*return_trace")) for s in ("generate", "stream")},
                 "server": ({"logprobs": 2}, ("refused", "logprobs", "log-probabilities are not implemented")),
                 "cli": (["--logprobs", "2"], ("refused", "", "--logprobs 2: not a lopa_fast knob"))},
    "stop_strings": {s: ({"stop_strings": [" ####"]}, ("same", {"stop": [" ####"]})) for s in ("generate", "stream")},
    "num_return_sequences": {"generate": ({"num_return_sequences": 2},
                                          ("refused", "num_return_sequences", "needs temperature > 0")),
                             **{s: ({"num_return_sequences": 2}, ("refused", "num_return_sequences",
                                                                  "not a lopa_fast knob: .*num_return_sequences=n"))
                                for s in ("stream", "server")},
                             "cli": (["--num-return-sequences", "2"], ("refused", "", "not a lopa_fast knob"))},
    "min_new_tokens": {**{s: ({"min_new_tokens": 4}, ("refused", "min_new_tokens", "not implemented .*stop="))
                          for s in ON3},
                       "cli": (["--min-new-tokens", "4"], ("refused", "", "--min-new-tokens 4: not a lopa_fast knob"))},
    "num_beams": {**{s: ({"num_beams": 4},
                         ("refused", "num_beams", "num_beams=4 is not a lopa_fast knob: .*branching_factor=")) for s in ON3},
                  "cli": (["--num-beams", "4"], ("refused", "", "--num-beams 4: not a lopa_fast knob"))},
}
CASES = [(row, s) for row, by in ROWS.items() for s in SURFACES if s in by]


def _concrete(value, ids, model):
    if value == ONES:
        return torch.ones(1, len(ids), dtype=torch.long)
    if value == ZERO:
        m = torch.ones(1, len(ids), dtype=torch.long)
        m[0, 0] = 0
        return m
    if value == "P+8":
        return len(ids) + 8
    if value == "[eos, 9]":
        return [model.eos_token_id, 9]
    if value == "eos":
        return model.eos_token_id
    return value


def _run(surface, embedded, knobs, capsys):
    """(generated ids, warnings) of one call on `surface`; raises KnobError / RequestError / cli.CLIError."""
    model, tok = embedded
    ids = _ids(tok)
    if surface == "cli":
        flags = [str(len(ids) + 8) if f == "P+8" else f for f in knobs]
        capsys.readouterr()
        assert cli.main(["generate", "--prompt", PROMPT, "--strategy", "d2f", "--block-size", "8", "-q", "--json",
                         *([] if "--max-length" in flags else ["--max-new-tokens", "8"]), *flags]) == 0
        io = capsys.readouterr()
        return json.loads(io.out)["generated_ids"], [ln for ln in io.err.splitlines() if "warning" in ln]
    kw = {**BASE, **{k: _concrete(v, ids, model) for k, v in knobs.items()}}
    kw = {k: v for k, v in kw.items() if v is not None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if surface == "generate":
            got = lopa_fast.generate(model, ids, **kw).generated_ids
        elif surface == "stream":
            s = lopa_fast.stream(model, ids, tokenizer=tok, **kw)
            "".join(s)
            got = s.result.generated_ids
        else:
            body = {"prompt": ids, **{("max_tokens" if k == "max_new_tokens" else k): v for k, v in kw.items()}}
            if isinstance(body.get("attention_mask"), torch.Tensor):
                body["attention_mask"] = body["attention_mask"].tolist()
            req = parse(body, "completions", model, tok, {})
            return (req.knobs, req.stop), list(req.warnings)
    return got, [str(w.message) for w in caught]


@pytest.mark.parametrize("row,surface", CASES, ids=[f"{r}-{s}" for r, s in CASES])
def test_knob_conventions_on_every_surface(embedded, capsys, row, surface):
    knobs, want = ROWS[row][surface]
    if want[0] == "refused":
        errors = (cli.CLIError,) if surface == "cli" else (RequestError,) if surface == "server" else (KnobError,)
        with pytest.raises(errors) as e:
            _run(surface, embedded, knobs, capsys)
        msg = str(e.value)
        assert re.search(want[2], msg), msg
        assert "\n" not in msg
        field = getattr(e.value, "param", None) if surface == "server" else getattr(e.value, "knob", None)
        if surface != "cli":
            assert field == want[1], (field, msg)
        return
    got, notes = _run(surface, embedded, knobs, capsys)
    if want[0] == "warns":
        assert any(want[1] in n for n in notes), notes
        return
    base, _ = _run(surface, embedded, want[1], capsys)  # the request spelled lopa_fast's way
    if surface == "server":  # the same config and stops
        from lopa_fast.config import GenerateConfig

        assert (GenerateConfig(**got[0]), got[1]) == (GenerateConfig(**base[0]), base[1]), (got, base)
        return
    assert got == base


def test_the_docs_table_is_the_tested_table():
    """docs/decoding.md's table of other libraries' knobs has exactly these rows (each tested above)."""
    text = DOCS.read_text()
    section = text.split("## Knobs from other libraries", 1)[1].split("\n## ", 1)[0]
    rows = [ln.split("|")[1].strip().strip("`") for ln in section.splitlines()
            if ln.startswith("| ") and not ln.startswith("| name") and not ln.startswith("|--")]
    assert [r.replace("`", "") for r in rows] == list(ROWS), rows


# ---- generate takes what stream takes ------------------------------------------------------------------------------
def test_generate_takes_a_str_prompt_and_text_stops_like_stream(embedded):
    model, tok = embedded
    s = lopa_fast.stream(model, PROMPT, tokenizer=tok, stop=["="], **BASE)
    text = "".join(s)
    out = lopa_fast.generate(model, PROMPT, stop=["="], **BASE)  # the tokenizer: the model's directory's
    assert out.text == text and out.generated_ids == s.result.generated_ids
    assert out.stats["finish_reason"] == s.result.stats["finish_reason"]
    assert lopa_fast.generate(model, PROMPT, tokenizer=tok, **BASE).generated_ids == \
        lopa_fast.generate(model, _ids(tok), **BASE).generated_ids
    from lopa_fast.testing import random_model, tiny_hf_config

    bare = random_model(tiny_hf_config("dream"), seed=0)
    with pytest.raises(TypeError, match="pass tokenizer="):
        lopa_fast.generate(bare, "Tom has", max_new_tokens=4, block_size=4)


class _Streamer:
    """transformers' TextStreamer protocol: put(ids), end()."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_the_prompt_then_the_tokens_as_they_become_final(embedded):
    from transformers import TextStreamer

    model, tok = embedded
    ids = _ids(tok)
    for kw in (dict(BASE, max_new_tokens=24), dict(BASE, max_new_tokens=24, stop=[[20, 9]])):
        st = _Streamer()
        out = lopa_fast.generate(model, ids, streamer=st, **kw)
        assert st.ended and st.puts[0] == [ids] and len(st.puts) > 2  # the prompt, then several pieces
        assert [t for p in st.puts[1:] for t in p] == out.generated_ids
        s = lopa_fast.stream(model, ids, tokenizer=tok, streamer=(st2 := _Streamer()), **kw)
        "".join(s)
        assert [t for p in st2.puts[1:] for t in p] == s.result.generated_ids == out.generated_ids
    lopa_fast.generate(model, ids, streamer=TextStreamer(tok, skip_prompt=True), **BASE)  # the real one runs
    with pytest.raises(TypeError, match="put.ids. and end"):
        lopa_fast.generate(model, ids, streamer=object(), **BASE)


def test_a_causal_qwen2_checkpoint_is_told_the_real_reason_first():
    ar = lopa_fast.load_model(model_dir("ar-arith"), dtype=torch.float32)
    assert ar.mask_token_id is None
    with pytest.raises(ValueError, match=r"causal AR Qwen2\) cannot run diffusion decoding"):
        lopa_fast.generate(ar, [2, 5, 6], max_new_tokens=8)


def test_the_code_checker_is_clean():
    """`ruff check` (pyproject.toml's rules: pycodestyle errors and pyflakes: unused or shadowed names, undefined
    names, ambiguous variables, lambdas assigned) finds nothing in lopa_fast/ and kernels/. The layout itself is
    hand-made (no formatter, no per-line formatter skips): pyproject.toml says why."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    run = subprocess.run([ruff, "check", "lopa_fast", "kernels", "--output-format", "concise"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    skips = [str(p.relative_to(root)) for d in ("lopa_fast", "kernels", "tests", "bench") for p in (root / d).rglob("*.py")
             if "fmt: " + "skip" in p.read_text()]
    assert not skips, skips
