"""The embedded models shipped with the package (HF-format directories, trained by lopa_fast.train).

    d2f-arith/   Dream-architecture block-diffusion model for the embedded arithmetic task
                 (recipe: python -m lopa_fast.train.d2f; training_log.txt inside)
    ar-arith/    causal Qwen2 AR model with the same tokenizer, the APD verifier
                 (recipe: python -m lopa_fast.train.ar)
    ar-arith-var/  the APD verifier for the arith-var task (127-id tokenizer; README.md here)
    d2f-arith-var/ the Dream-architecture model of the arith-var task, the dParallel teacher (README.md here)
    dparallel-arith-var/ its dParallel (certainty-forcing) student
    mdm-arith-var/ the base teacher in LLaDA's regime (plain masked diffusion, issue 27)
    dparallel-mdm-arith-var/ its dParallel student (LLaDA's semi-AR certainty-forcing views)
"""
from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "d2f-arith"


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Directory of an embedded model; ValueError naming the available ones if `name` is unknown."""
    path = ASSETS_DIR / name
    if not (path / "config.json").is_file():
        have = sorted(p.name for p in ASSETS_DIR.iterdir() if (p / "config.json").is_file())
        raise ValueError(f"embedded model {name!r} not found in {ASSETS_DIR}; available: {have or 'none'}")
    return path
