"""Build for lopa_fast.

The pure-Python package always installs (tests/test_packaging.py builds the wheel and runs the demo from it). The top-level `kernels/` directory is installed as
`lopa_fast.kernels` (a bare top-level `kernels` package would collide in site-packages).
No CUDA is compiled here: CUDA kernels are compiled at first use on a GPU machine (NVRTC via CuPy),
because a torch-header CUDA build costs minutes of scarce GPU time (docs/toolchain.md section 5).
"""
from setuptools import find_namespace_packages, setup

# namespace discovery: a subpackage without __init__.py (lopa_fast/reference today) must still ship
packages = find_namespace_packages(include=["lopa_fast", "lopa_fast.*"], exclude=["lopa_fast.assets.*", "*.__pycache__"])
packages += ["lopa_fast.kernels", "lopa_fast.kernels.triton"]

setup(
    packages=packages,
    package_dir={"lopa_fast.kernels": "kernels"},
    package_data={
        "lopa_fast": ["assets/**/*"],
        "lopa_fast.kernels": ["cuda/*.cu", "cuda/*.cuh"],
    },
    include_package_data=True,
)
