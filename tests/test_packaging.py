"""The wheel is complete: build it, install it (not editable) into a fresh venv, import the kernels from it,
find every CUDA source and asset in it, and run the demo from it.

No network: the wheel is built with the running environment's setuptools (`--no-build-isolation`) and
installed with `--no-index --no-deps`. The fresh venv borrows torch / numpy / tokenizers from the running
environment through a `.pth` line listing its site-packages (added after the install, so pip never sees the
editable lopa_fast there); plain path lines do not run that directory's own `.pth` hooks, so the editable
finder stays out, and every check asserts `lopa_fast` is imported from the new venv.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", "*.so",
                               ".benchmarks", ".pytest_cache", "upstream")


def _run(cmd, cwd, env, timeout=120):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(python of a fresh venv with the wheel installed, its site-packages, a clean env, a neutral cwd)."""
    tmp = tmp_path_factory.mktemp("packaging")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    env["PIP_NO_INDEX"] = "1"  # belt and braces: pip must never reach an index
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # build from a copy, so a concurrent build/ or egg-info in the checkout can neither leak in nor be left behind
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_SKIP)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist"), str(src)], cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("lopa_fast-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
          "--no-compile", str(wheel)], cwd=tmp, env=env)
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=tmp, env=env).strip())
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "_ci_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    installed = Path(_run([str(py), "-c", "import lopa_fast, os; print(os.path.dirname(lopa_fast.__file__))"],
                          cwd=tmp, env=env).strip())
    assert installed == purelib / "lopa_fast", f"lopa_fast imported from {installed}, not from the fresh venv"
    return py, installed, env, tmp


def test_wheel_ships_kernel_sources_and_assets(wheel_env):
    _, installed, _, _ = wheel_env
    kernels = REPO / "kernels"  # the repository root folder, installed as lopa_fast/kernels
    want = {f"kernels/cuda/{p.name}" for p in (kernels / "cuda").iterdir() if p.suffix in (".cu", ".cuh", ".md")}
    want |= {f"kernels/triton/{p.name}" for p in (kernels / "triton").glob("*.py")}
    want.add("kernels/__init__.py")  # the package module (lopa_fast/kernels/__init__.py)
    assets = REPO / "lopa_fast" / "assets"
    want |= {str(p.relative_to(REPO / "lopa_fast")) for p in assets.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert any(w.startswith("kernels/cuda/") for w in want) and any(w.startswith("kernels/triton/") for w in want)
    missing = sorted(w for w in want if not (installed / w).is_file())
    assert not missing, f"not in the installed wheel: {missing}"


def test_wheel_imports_kernels(wheel_env):
    py, installed, env, cwd = wheel_env
    code = (
        "import importlib, pkgutil, lopa_fast, lopa_fast.kernels.triton as kt\n"
        "names = [m.name for m in pkgutil.iter_modules(kt.__path__)]\n"
        "assert {'branch_attention', 'confidence'} <= set(names), names\n"
        "mods = [importlib.import_module('lopa_fast.kernels.triton.' + n) for n in names]\n"
        "print(lopa_fast.__file__); print(*[m.__file__ for m in mods], sep='\\n')\n"
    )
    out = _run([str(py), "-c", code], cwd=cwd, env=env).split()
    assert all(p.startswith(str(installed)) for p in out), out


def test_wheel_runs_the_demo(wheel_env):
    py, _, env, cwd = wheel_env
    out = _run([str(py), "-m", "lopa_fast", "demo"], cwd=cwd, env=env, timeout=300)
    assert "TPF" in out and "100% exact match" in out, out[-2000:]
