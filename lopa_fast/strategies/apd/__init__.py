"""apd: Adaptive Parallel Decoding (a dLLM drafts, a small causal verifier accepts the agreed prefix).
Files: lopa_fast/strategies/__init__.py says what each of this folder's modules holds."""
