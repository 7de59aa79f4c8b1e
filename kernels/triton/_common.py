"""Helpers shared by the Triton launchers."""
from __future__ import annotations

import os


def is_interpreter() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1, set by tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
