"""Training recipes for the embedded models (seeded, CPU-only): `d2f` (block-diffusion, Dream-style), `ar` (the
causal Qwen2 drafter); `run` holds what both do around their model and loss."""
