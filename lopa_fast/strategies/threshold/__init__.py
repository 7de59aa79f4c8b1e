"""threshold: Fast-dLLM's confidence-threshold (and dParallel's entropy-threshold) decoding over blocks.
Files: lopa_fast/strategies/__init__.py says what each of this folder's modules holds."""
