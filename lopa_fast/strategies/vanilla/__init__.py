"""vanilla: the model family's own sampler (LLaDA low-confidence / random remasking, Dream's algs).
Files: lopa_fast/strategies/__init__.py says what each of this folder's modules holds."""
