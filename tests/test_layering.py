"""The house is one-way (issue 44): lopa_fast.decode (the one loop, the compile layer, the KV pool) knows no strategy.

The plan resolves a request's strategy spec once and hands it down (Scheduler / run_solo / BatchEngine take `spec=`;
the registry binds it into run_solo), so nothing under lopa_fast/decode/ imports lopa_fast.strategies (top-level,
function-local, importlib or __import__ with a literal name) or compares a strategy's name; model facts (e.g. LLaDA's
end-of-turn id) live in the model family table. A toy strategy registered from outside the package runs through
the same loop with only its folder's code and one register call.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import lopa_fast
from lopa_fast import strategies

PACKAGE = pathlib.Path(lopa_fast.__file__).parent
DECODE = PACKAGE / "decode"


def _docstrings(tree) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def imported_names(tree) -> set[str]:
    """Every module a tree imports anywhere: import / from-import statements at any depth (function-local too),
    importlib.import_module("...") / __import__("...") with a literal name, and "module:attribute" strings."""
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            found.add(n.module)
            found |= {f"{n.module}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant):
            fn = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if fn in ("import_module", "__import__") and isinstance(n.args[0].value, str):
                found.add(n.args[0].value)
    docs = _docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and n.value.startswith("lopa_fast."):
            found.add(n.value.partition(":")[0])
    return found


def test_decode_imports_no_strategy():
    files = sorted(DECODE.glob("*.py"))
    assert len(files) >= 8, files  # the walk saw the package (batch, compiled, compiled_batch, driver, kv_pool, ...)
    bad = {}
    for path in files:
        names = imported_names(ast.parse(path.read_text()))
        hits = sorted(m for m in names if m == "lopa_fast.strategies" or m.startswith("lopa_fast.strategies.")
                      or m.startswith("lopa_fast.reference"))
        if hits:
            bad[path.name] = hits
    assert not bad, f"lopa_fast/decode imports strategy code (the plan hands it the spec): {bad}"


def test_the_walk_sees_function_local_and_importlib_imports():
    """The check itself cannot go blind: each form it claims to see is seen."""
    src = ("def f():\n    from lopa_fast.strategies import get\n    import importlib\n"
           "    importlib.import_module('lopa_fast.strategies.lopa')\n    x = 'lopa_fast.strategies.apd:spec'\n")
    names = imported_names(ast.parse(src))
    assert {"lopa_fast.strategies", "lopa_fast.strategies.lopa", "lopa_fast.strategies.apd"} <= names


def test_decode_compares_no_strategy_name():
    """No literal strategy name in decode/'s code (docstrings aside): what differs is a field of the spec."""
    names = set(strategies.names())
    for path in sorted(DECODE.glob("*.py")):
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        lits = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and id(n) not in docs}
        assert not (lits & names), (path.name, lits & names)


TOY = """
from dataclasses import dataclass

from lopa_fast.request.knobs import check_bool, knob
from lopa_fast.strategies import SOLO, Strategy, get, register


@dataclass(frozen=True)
class ToyKnobs:  # the knobs the toy adds to GenerateConfig
    toy_echo: bool | None = knob(None, "toy: a knob of the toy's own (checked, then ignored)", unset="off")


def validate(cfg):
    if cfg.toy_echo is not None:
        check_bool("toy_echo", cfg.toy_echo)
    get("vanilla").validate(cfg)


vanilla = get("vanilla")
SPEC = register(Strategy(name="toy", summary="vanilla under another name", knobs=vanilla.knobs + ("toy_echo",),
                         knob_class=ToyKnobs, reference=vanilla.reference, fast=SOLO, driver=vanilla.driver,
                         validate=validate, resolve=vanilla.resolve, length_unit=vanilla.length_unit,
                         cache_rows=vanilla.cache_rows, batches=vanilla.batches))
"""

RUN_TOY = """
import dataclasses, json, torch
import toy_strategy  # the one registration line (before lopa_fast.config builds GenerateConfig)
import lopa_fast
from lopa_fast.config import GenerateConfig
from lopa_fast.testing import random_model, tiny_hf_config

model = random_model(tiny_hf_config("llada"), seed=0)
prompt = torch.tensor([1, 2, 3, 4])
kw = dict(max_new_tokens=8, steps=4, block_length=4)
out = {b: lopa_fast.generate(model, prompt, strategy="toy", backend=b, toy_echo=True, **kw).generated_ids
       for b in ("fast", "reference")}
out["vanilla"] = lopa_fast.generate(model, prompt, strategy="vanilla", backend="fast", **kw).generated_ids
out["fields"] = [f.name for f in dataclasses.fields(GenerateConfig)]
for bad in (dict(strategy="vanilla", toy_echo=True), dict(strategy="toy", toy_echo=3)):
    try:
        lopa_fast.generate(model, prompt, **bad, **kw)
        out[str(bad)] = "accepted"
    except (ValueError, TypeError) as e:
        out[str(bad)] = str(e)
print(json.dumps(out))
"""


def test_a_toy_strategy_is_its_folder_and_one_register_line(tmp_path):
    """A strategy written outside the package - its knob dataclass, its checks, a reference decoder and a batch
    driver (vanilla's) - registered with ONE call: its knob joins GenerateConfig, it decodes through the plan and
    the one loop on both backends, another strategy refuses its knob, its checks name the knob; nothing of
    lopa_fast edited."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "toy_strategy.py").write_text(TOY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(PACKAGE.parent)]))
    run = subprocess.run([sys.executable, "-c", RUN_TOY], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["fast"] == out["reference"] == out["vanilla"] and len(out["fast"]) == 8
    assert "toy_echo" in out["fields"]
    assert "does not apply to strategy='vanilla'" in out[str(dict(strategy="vanilla", toy_echo=True))]
    assert "toy_echo" in out[str(dict(strategy="toy", toy_echo=3))]


def test_knobs_added_after_the_config_was_built_are_refused():
    from dataclasses import dataclass

    from lopa_fast.config import GenerateConfig  # noqa: F401  (built)
    from lopa_fast.request.knobs import knob

    @dataclass(frozen=True)
    class LateKnobs:
        late_knob: int | None = knob(None, "late", unset="off")

    vanilla = strategies.get("vanilla")
    with pytest.raises(TypeError, match="late_knob"):
        strategies.register(strategies.Strategy(name="late", summary="late", reference=vanilla.reference,
                                                knob_class=LateKnobs))
    assert "late" not in strategies.names()


def test_the_front_door_is_narrow():
    """At most 12 modules at lopa_fast/'s top level (issue 44: it had 35); the request's front door is
    lopa_fast/request/ and what a request returns is lopa_fast/output/."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert "api.py" in top and "config.py" in top, top  # the walk saw the package
    assert len(top) <= 12, top
    for pkg, must in (("request", {"plan.py", "prompts.py", "knobs.py"}), ("output", {"__init__.py", "stream.py"})):
        assert must <= {p.name for p in (PACKAGE / pkg).glob("*.py")}, pkg
