"""The docs say what the code is (issue 44): every module, name, path and command the README and docs/*.md cite
resolves in this checkout.

Checked in README.md and every docs/*.md:
1. dotted names `lopa_fast.a.b[.Name]`: the longest importable module prefix imports and the rest are attributes;
2. repository paths (`lopa_fast/...`, `kernels/...`, `csrc/...`, `bench/...`, `tests/...`, `docs/...`): they exist
   (a `*` or `{a,b}` in one is expanded; at least one match);
3. `python -m lopa_fast <command> --flag ...` on one line: the command exists and each flag is one of its options;
4. the layout listings (README's "Layout" table, docs/architecture.md's section 1 block): every `name.py` a row
   names exists under the row's folder.
A miss names the doc, the line and what did not resolve. No model runs: a few seconds.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# names that are not Python objects by design (each with why)
NOT_OBJECTS = {
    "lopa_fast.server.access",  # a logger's name (the access log: docs/serve.md), not a module
}

DOTTED = re.compile(r"(?<![\w/.])lopa_fast(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.\-])((?:lopa_fast|kernels|csrc|bench|tests|docs)/[\w./\-*{},]*)")
COMMAND = re.compile(r"python -m lopa_fast ([a-z][\w\-]*)((?:[^`|#\n])*)")
FLAG = re.compile(r"(?<![\w\-])(--[a-z][\w\-]*)")
MODULE_FILE = re.compile(r"(?<![\w/.\-])([A-Za-z_]\w*\.(?:py|cpp|h|cu|cuh))\b")


def lines():
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            yield doc, number, line


def resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def expand(pattern: str) -> list[str]:
    """`a{b,c}d` -> [abd, acd] (the docs' brace shorthand), then globbed."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m:
        return list(itertools.chain.from_iterable(
            expand(pattern[:m.start()] + alt + pattern[m.end():]) for alt in m.group(1).split(",")))
    return [pattern]


def path_exists(text: str) -> bool:
    text = text.rstrip(".,:;)")
    found = []
    for p in expand(text):
        found += list(ROOT.glob(p)) if "*" in p else [ROOT / p] if (ROOT / p).exists() else []
    return bool(found)


def test_the_check_sees_what_it_claims():
    """The scan cannot go blind: each kind of citation is found in the docs, and a wrong one fails."""
    seen = {"dotted": 0, "path": 0, "command": 0}
    for _, _, line in lines():
        seen["dotted"] += len(DOTTED.findall(line))
        seen["path"] += len(PATH.findall(line))
        seen["command"] += len(COMMAND.findall(line))
    assert min(seen.values()) >= 10, seen
    assert resolves("lopa_fast.strategies.registry.Strategy") and not resolves("lopa_fast.decode.fast_not_covered")
    assert path_exists("kernels/triton/select_round.py") and path_exists("bench/results/eval_*.md")
    assert not path_exists("lopa_fast/output.py")


def test_every_dotted_name_resolves():
    bad = [f"{d.name}:{n}: {name}" for d, n, line in lines() for m in DOTTED.finditer(line)
           if (name := m.group(0).rstrip(".")) not in NOT_OBJECTS and not resolves(name)]
    assert not bad, "\n".join(bad)


def test_every_path_exists():
    bad = [f"{d.name}:{n}: {m.group(1)}" for d, n, line in lines() for m in PATH.finditer(line)
           if "<" not in m.group(1) and not path_exists(m.group(1))]
    assert not bad, "\n".join(bad)


def _commands() -> dict[str, set[str]]:
    from lopa_fast.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


def test_every_command_and_flag_exists():
    commands = _commands()
    bad = []
    for d, n, line in lines():
        for m in COMMAND.finditer(line):
            cmd = m.group(1)
            if cmd not in commands:
                bad.append(f"{d.name}:{n}: python -m lopa_fast {cmd}")
                continue
            if cmd == "lm-eval":  # its flags are lm-eval-harness's own (passed through)
                continue
            bad += [f"{d.name}:{n}: {cmd} {f}" for f in FLAG.findall(m.group(2)) if f not in commands[cmd]]
    assert not bad, "\n".join(bad)


def _layout_rows():
    """(doc, line, folder, text) of each layout row: README's table rows, architecture.md's section 1 block."""
    readme = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    for row in readme.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")] if row.startswith("| `") else []
        if len(cells) == 2:
            folders = re.findall(r"`([\w./]+/)`", cells[0])
            if folders:
                yield "README.md", row[:40], folders, cells[1]
    # architecture.md: an entry starts at column 0 with its path (a folder ends in /), continuation lines are indented
    arch = (ROOT / "docs/architecture.md").read_text().split("## 1. Layout", 1)[1].split("```", 2)[1]
    folder = None
    for row in arch.splitlines():
        if row and not row.startswith(" "):
            path = row.split()[0].rstrip(",")
            folder = path if path.endswith("/") else str(pathlib.PurePosixPath(path).parent) + "/"
            if not path.endswith("/") and path != "setup.py":
                assert (ROOT / path).exists(), f"architecture.md layout: {path}"
            row = row[len(path):]
        if folder:
            yield "architecture.md", row[:40], [folder], row


@pytest.mark.parametrize("doc", ["README.md", "architecture.md"])
def test_every_file_a_layout_names_exists(doc):
    rows = [r for r in _layout_rows() if r[0] == doc]
    assert len(rows) >= 8, rows  # the layout was found
    bad = []
    for _, row, folders, text in rows:
        for name in MODULE_FILE.findall(text):
            if not any(list((ROOT / f).rglob(name)) for f in folders) and not (ROOT / name).exists():
                bad.append(f"{doc}: {row!r}: {'/'.join(folders)} {name}")
    assert not bad, "\n".join(bad)
