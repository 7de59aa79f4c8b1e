"""The kernels: `lopa_fast.kernels.triton` (@triton.jit kernels + launchers) and the CUDA sources (`cuda/*.cu`).

They live at the repository root, kernels/triton and kernels/cuda (the design card's layout). An installed wheel
carries them here, as this package (setup.py's package_dir); in a source checkout (an editable install, the tests)
this module adds the root folder to the package's path. The root folder has no __init__.py, so from the repository
root `import kernels` still finds Hugging Face's `kernels` package (transformers >= 5.25 imports it).
"""
from pathlib import Path

_ROOT_KERNELS = Path(__file__).resolve().parents[2] / "kernels"
if (_ROOT_KERNELS / "triton" / "__init__.py").is_file() and str(_ROOT_KERNELS) not in __path__:
    __path__.append(str(_ROOT_KERNELS))

# the folder holding the CUDA sources (.cu / .cuh) in either layout
CUDA_DIR = next(Path(p) / "cuda" for p in __path__ if (Path(p) / "cuda").is_dir())
