"""Where lopa_fast keeps what it compiles (CUDA cubins, the host emulation's libraries): one directory, outside
the ops package so that the kernel loaders under lopa_fast.ops.cuda need not import the backend dispatch that loads
them (no import cycle)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(sub: str) -> Path:
    """$LOPA_FAST_CACHE_DIR/<sub> (default ~/.cache/lopa_fast/<sub>), created: compiled kernels and ops."""
    d = Path(os.environ.get("LOPA_FAST_CACHE_DIR", Path.home() / ".cache" / "lopa_fast")) / sub
    d.mkdir(parents=True, exist_ok=True)
    return d
