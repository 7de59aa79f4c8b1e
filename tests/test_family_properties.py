"""A model family is a property of the loaded model, not a name tested in decoders (issue 34).

Everything a decoder, strategy, reference decoder or config check needs to know of a family is a property of
`lopa_fast.models.config.ModelConfig` (`Family`: attention, logits_shift, is_diffusion, causal_verifier,
stats_in_float64, refresh_commits_first, vanilla_commit). Only lopa_fast/models/ (parsing, loading, the networks),
and lopa_fast/train/ (the embedded models' recipes) may read `config.kind` or compare a family's name; a family's
tiny test config is models/tiny.py, so adding a family touches lopa_fast/models/ alone.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lopa_fast
from lopa_fast.models.config import FAMILIES, QWEN2_FAMILY_TYPES, LLADA_TYPES, Family, ModelConfig
from lopa_fast.testing import tiny_hf_config

PKG = Path(lopa_fast.__file__).resolve().parent
ALLOWED = ("models/", "train/")
NAMES = {n.lower() for n in (*FAMILIES, *QWEN2_FAMILY_TYPES, *LLADA_TYPES)}  # "dream", "qwen2", "llada", ...
CLASSES = {"LLaDAModel", "Qwen2Model"}


def _family_name(node) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_family_name(e) for e in node.elts)
    return False


def family_tests(root: Path) -> list[str]:
    """`file:line what` for each place under `root` (a lopa_fast package directory) outside ALLOWED that reads a
    model config's `kind`, compares with a family's name or model_type, or names a family's model class."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            what = None
            if isinstance(node, ast.Attribute) and node.attr == "kind":
                what = "reads .kind"
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_family_name(s) for s in sides):
                    what = "compares with a family name"
                elif any(isinstance(s, ast.Attribute) and s.attr == "model_type" for s in sides):
                    what = "compares model_type"
            elif isinstance(node, ast.Name) and node.id in CLASSES:
                what = f"names {node.id}"
            elif isinstance(node, ast.Attribute) and node.attr in CLASSES:
                what = f"names {node.attr}"
            if what:
                found.append(f"{rel}:{node.lineno} {what}")
    return sorted(found)


def test_no_decoder_tests_a_model_family_by_name():
    found = family_tests(PKG)
    assert not found, ("a model family is a property of the model (lopa_fast.models.config.Family), not a name "
                       "tested outside lopa_fast/models/:\n  " + "\n  ".join(found))


def test_the_scan_sees_a_family_test(tmp_path):
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / "x.py").write_text(
        "def f(model, kind):\n"
        "    a = model.config.kind == 'llada'\n"
        "    b = kind in ('dream', 'qwen2')\n"
        "    c = model.config.model_type == 'x'\n"
        "    return a, b, c, kind == 'prefix'\n"
    )
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "y.py").write_text("z = cfg.kind == 'llada'\n")
    assert sorted(family_tests(tmp_path)) == ["decode/x.py:2 compares with a family name", "decode/x.py:2 reads .kind",
                                              "decode/x.py:3 compares with a family name",
                                              "decode/x.py:4 compares model_type"]


@pytest.mark.parametrize("kind", ["dream", "qwen2", "llada"])
def test_every_family_sets_every_property(kind):
    from lopa_fast.models.config import parse_config

    mc = parse_config(tiny_hf_config(kind))
    assert isinstance(mc, ModelConfig) and mc.kind == kind
    fam = FAMILIES[kind]
    assert isinstance(fam, Family)
    for name in Family.__dataclass_fields__:
        assert getattr(mc, name) == getattr(fam, name)
    assert mc.attention in ("full", "causal")
    assert mc.vanilla_commit in ("block_topk", "timestep", None)
    assert mc.is_diffusion == (mc.vanilla_commit is not None) == (mc.attention == "full")
    assert not (mc.is_diffusion and mc.causal_verifier)
