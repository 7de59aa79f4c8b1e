"""Build for lopa_fast.

The package installs with its kernels (kernels/ at the repository root, installed as lopa_fast.kernels: Triton
modules, and the CUDA sources as package data)
and, when a C++ compiler works, the extension `lopa_fast._C` (csrc/*.cpp, pybind11, no torch headers: ~10 s with
g++ -O2), built here and only here: nothing is compiled per process. Without a compiler (or pybind11) the build of
the extension fails softly: the package installs pure-Python, says so once here, and the ops fall back to their
torch backends (lopa_fast.ops._backend.cpp_available; one log line at first use).
CUDA kernels are compiled at first use on a GPU machine (NVRTC via CuPy): docs/toolchain.md section 5.
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
    """Build lopa_fast._C if a compiler works; otherwise install pure-Python and say so once."""

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
        "lopa_fast": ["assets/**/*"],
        "lopa_fast.kernels.cuda": ["*.cu", "*.cuh", "README.md"],
    },
    include_package_data=True,
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
