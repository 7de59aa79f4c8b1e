"""Build for lopa_fast.

The pure-Python package always installs (tests/test_packaging.py builds the wheel and runs the demo from it),
kernels included: lopa_fast/kernels (Triton modules, and the CUDA sources as package data).
No CUDA is compiled here: CUDA kernels are compiled at first use on a GPU machine (NVRTC via CuPy),
because a torch-header CUDA build costs minutes of scarce GPU time (docs/toolchain.md section 5).
"""
from setuptools import find_namespace_packages, setup

# namespace discovery: a subpackage without __init__.py (lopa_fast/reference today) must still ship
packages = find_namespace_packages(include=["lopa_fast", "lopa_fast.*"], exclude=["lopa_fast.assets.*", "*.__pycache__"])

setup(
    packages=packages,
    package_data={
        "lopa_fast": ["assets/**/*"],
        "lopa_fast.kernels": ["cuda/*.cu", "cuda/*.cuh", "cuda/README.md"],
    },
    include_package_data=True,
)
