"""lopa_fast._C, the C++ CPU ops built at install (setup.py, csrc/): present in the environment the tests run in (CI
installs the package with the README's command, which builds it), loaded from the package, chosen by auto on CPU,
and never built by a process (the build is setup.py's alone)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import lopa_fast
from lopa_fast.ops import _backend

ROOT = Path(__file__).resolve().parents[1]

# a subprocess's code prefix: every process it starts is recorded in `seen` (a compiler run would show up there)
SPY = ("import subprocess\n"
       "seen = []\n"
       "real = subprocess.Popen.__init__\n"
       "def spy(self, args, *a, **k):\n"
       "    seen.append(args)\n"
       "    return real(self, args, *a, **k)\n"
       "subprocess.Popen.__init__ = spy\n")


def test_the_extension_is_built_and_loaded_from_the_package():
    """A missing extension here means the install step failed to build it: fail, do not fall back silently."""
    mod = _backend.cpp_module()
    assert mod is not None, "lopa_fast._C is not built: the README's install command should have built it"
    assert Path(mod.__file__).resolve().parent == Path(lopa_fast.__file__).resolve().parent
    assert hasattr(mod, "select_round_cpu")


def test_auto_picks_cpp_on_cpu_for_its_ops_only():
    cpu = torch.device("cpu")
    assert _backend.resolve("select_round", None, cpu) == "cpp"
    assert _backend.resolve("silu_mul", None, cpu) == "torch"  # no C++ kernel: its torch backend


def test_the_environment_backend_applies_to_the_ops_that_have_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(_backend.ENV, "cpp")
    assert _backend.resolve("select_round", None, cpu) == "cpp"
    assert _backend.resolve("silu_mul", None, cpu) == "torch"
    monkeypatch.setenv(_backend.ENV, "torch")
    assert _backend.resolve("select_round", None, cpu) == "torch"


def run_python(code: str, timeout: float = 300, **env) -> str:
    """`python -c code` from the repository root (env: extra variables); asserts it exits 0, returns its stdout."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                       env=dict(os.environ, **env))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_no_compiler_is_run_by_a_process():
    """Importing the package and running a LoPA round (the C++ op) starts no compiler: the extension is loaded."""
    code = ("import subprocess, torch, lopa_fast\n"
            "from lopa_fast.testing import random_model, tiny_hf_config\n"
            + SPY +
            "m = random_model(tiny_hf_config('dream', vocab_size=64, num_kv_heads=2), seed=0, sharpen=6)\n"
            "lopa_fast.generate(m, torch.tensor([5, 9, 2]), 'lopa', backend='fast', branching_factor=2,\n"
            "                   max_new_tokens=8, block_size=4)\n"
            "print('SPAWNED', seen)\n")
    out = run_python(code)
    assert out.strip().endswith("SPAWNED []"), out[-500:]


def test_root_kernels_folder_never_shadows_hugging_faces_kernels():
    """From the repository root (cwd and sys.path[0]), `import kernels` is Hugging Face's package (transformers >= 5.25
    imports it), not the root kernels/ folder, which has no __init__.py; lopa_fast.kernels still finds its kernels."""
    code = ("import sys, importlib.util\n"
            "assert sys.path[0] == '', sys.path[0]\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "import lopa_fast.kernels.triton.rms_norm as t, lopa_fast.kernels as k\n"
            "print(spec.origin if spec else None, t.__file__, k.CUDA_DIR)\n")
    origin, triton_file, cuda_dir = run_python(code, timeout=120).split()
    assert not (ROOT / "kernels" / "__init__.py").exists()
    if origin != "None":  # Hugging Face's kernels is installed (transformers >= 5.25 pulls it): it must win
        assert Path(origin).resolve().parent != ROOT / "kernels", origin
    assert Path(triton_file).resolve().parent == ROOT / "kernels" / "triton"
    assert (Path(cuda_dir) / "branch_attention.cu").is_file()
    if origin != "None":
        assert run_python("import transformers.integrations.hub_kernels as h; print('ok')").strip() == "ok"


def test_the_cuda_emulation_is_built_at_install_and_loaded_not_compiled(tmp_path):
    """setup.py builds the CUDA host emulation's libraries (lopa_fast/_emu/) with the package: a process loads them
    from there (an empty kernel cache, no compiler run) and they run the kernel."""
    code = ("import subprocess, torch\n"
            + SPY +
            "from lopa_fast.ops.cuda.emulation import emulator\n"
            "from lopa_fast.ops.cuda.constants import OPS\n"
            "emu = emulator(OPS)\n"
            "conf = emu.confidence(torch.tensor([[0.0, 2.0, 1.0]]))\n"
            "assert conf[0].tolist() == [1], conf\n"
            "print('LIBS', *sorted(L._lib._name for L in emu._l.values()))\n"
            "print('SPAWNED', seen)\n")
    out = run_python(code, LOPA_FAST_CACHE_DIR=str(tmp_path))
    libs = out.split("LIBS", 1)[1].split("\n", 1)[0].split()
    from lopa_fast.ops.cuda import emu_build  # noqa: PLC0415

    want = sorted(str(emu_build.installed_path(op)) for op in emu_build.OPS)
    assert libs == want, f"not the install's libraries (rebuild: pip install -e .): {libs}"
    assert out.strip().endswith("SPAWNED []"), out[-500:]
    assert not any(tmp_path.rglob("*.so")), "compiled into the cache"


def test_a_stale_installed_emulation_is_not_loaded(monkeypatch):
    """A library built from another source (an edited .cu in an editable install) is never loaded: its source key
    differs, and the emulation falls back to its cache build."""
    from lopa_fast.ops.cuda import emu_build, emulation  # noqa: PLC0415

    key = emu_build.unit("select_round")[1]
    assert emulation._installed("select_round", key) is not None, "no current library built at install"
    assert emulation._installed("select_round", "0" * 20) is None
