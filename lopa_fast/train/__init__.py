"""Training recipes for the embedded models (seeded, CPU-only): `d2f` (block-diffusion Dream-style)."""
