"""lm-evaluation-harness model `lopa_fast` (optional: `pip install .[eval]`; lm-eval has no plugin discovery):
`python -m lopa_fast lm-eval ARGS` (`main`) or `evaluate(lm, tasks, output_path=...)`. How each request type runs
(generate_until through `lopa_fast.generate`, loglikelihood as the masked-diffusion ELBO) and what is recorded:
docs/lm_eval.md. Modules: elbo.py (the ELBO estimator, torch only), model.py (`LopaFastLM`), run.py (the API / CLI).
"""
from lopa_fast.lm_eval.elbo import (
    draw_masks,
    elbo_terms,
    greedy_matches,
    mask_counts,
    masked_logprobs,
    mc_loglikelihood,
)
from lopa_fast.lm_eval.model import LopaFastLM  # registers the `lopa_fast` model with lm-eval
from lopa_fast.lm_eval.run import evaluate, main, prepare

__all__ = ["LopaFastLM", "draw_masks", "elbo_terms", "evaluate", "greedy_matches", "main", "mask_counts",
           "masked_logprobs", "mc_loglikelihood", "prepare"]
