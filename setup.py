"""Build for lopa_fast.

The package installs with its kernels (kernels/ at the repository root, installed as lopa_fast.kernels: Triton
modules, and the CUDA sources as package data)
and, when a C++ compiler works, the extension `lopa_fast._C` (csrc/*.cpp, pybind11, no torch headers: ~10 s with
g++ -O2), built here and only here: nothing is compiled per process. Without a compiler (or pybind11) the build of
the extension fails softly: the package installs pure-Python, says so once here, and the ops fall back to their
torch backends (lopa_fast.ops._backend.cpp_available; one log line at first use).
CUDA kernels are compiled at first use on a GPU machine (NVRTC via CuPy): docs/toolchain.md section 5.
Their host emulation (the tests' CPU route through the exact .cu: lopa_fast.ops.cuda.emu_build) is built here too,
next to lopa_fast._C, into lopa_fast/_emu/ (~6 s with g++ -O1); a soft failure as well: it then compiles at first
use into the cache.
"""
import glob
import os
import sys

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext

# namespace discovery: a subpackage without __init__.py (lopa_fast/reference today) must still ship
packages = find_namespace_packages(include=["lopa_fast", "lopa_fast.*"], exclude=["lopa_fast.assets.*", "*.__pycache__"])
# the kernels live at the repository root (kernels/triton, kernels/cuda: the design card's layout) and install as
# lopa_fast.kernels.triton / lopa_fast.kernels.cuda under lopa_fast/kernels/__init__.py. kernels/ has no __init__.py
# on purpose: from the repository root it is only a namespace portion, which loses to Hugging Face's regular
# `kernels` package (transformers >= 5.25 imports it), so it never shadows it.
packages += ["lopa_fast.kernels.triton", "lopa_fast.kernels.cuda"]
package_dir = {"lopa_fast.kernels.triton": "kernels/triton", "lopa_fast.kernels.cuda": "kernels/cuda"}


def extensions() -> list:
    try:
        import pybind11
    except ImportError:
        sys.stderr.write("lopa_fast: pybind11 is not installed; lopa_fast._C (the C++ CPU ops) is not built\n")
        return []
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    # -ffp-contract=off: no fused multiply-add, so the C++ ops round exactly as the torch reference does
    flags = ["-O2", "-std=c++17", "-ffp-contract=off", "-fvisibility=hidden"]
    return [Extension("lopa_fast._C", sources, include_dirs=[pybind11.get_include(), "csrc"], language="c++",
                      extra_compile_args=flags)]


class OptionalBuildExt(build_ext):
    """Build lopa_fast._C if a compiler works; otherwise install pure-Python and say so once. Then the CUDA host
    emulation's libraries (soft as well)."""

    def run(self):
        super().run()
        self.build_cuda_emulation()

    def build_cuda_emulation(self):
        import shutil
        import tempfile
        from pathlib import Path

        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
        try:
            if cxx is None:
                raise RuntimeError("no C++ compiler")
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this tree's lopa_fast (needs torch)
            from lopa_fast.ops.cuda import emu_build

            package_dir = Path(self.get_ext_fullpath("lopa_fast._C")).parent  # in place (editable) or build/lib
            with tempfile.TemporaryDirectory() as tmp:
                emu_build.build_all(package_dir, cxx, Path(tmp))
        except Exception as e:  # noqa: BLE001 - the emulation is for the tests; it can still build at first use
            sys.stderr.write(f"lopa_fast: the CUDA host emulation was not built at install ({str(e)[:300]}); "
                             "it compiles at first use instead\n")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - any compiler / linker failure means "no extension", not "no package"
            sys.stderr.write(f"lopa_fast: building {ext.name} failed ({e}); installing without it: the C++ CPU ops "
                             "fall back to their torch backends (same results, slower)\n")


setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "lopa_fast": ["assets/**/*", "_emu/*.so"],
        "lopa_fast.kernels.cuda": ["*.cu", "*.cuh", "README.md"],
    },
    include_package_data=True,
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
