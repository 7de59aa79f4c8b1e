"""d2f and lopa: D2F's pipelined-block round, and LoPA's round with k lookahead branches (k=1 is D2F).
Files: lopa_fast/strategies/__init__.py says what each of this folder's modules holds."""
