"""lm-evaluation-harness model `lopa_fast` (optional: `pip install .[eval]`; lm-eval has no plugin discovery).

    python -m lopa_fast lm-eval --model lopa_fast \\
        --model_args pretrained=DIR,lora=DIR,strategy=lopa,branching_factor=4,block_size=32 \\
        --tasks gsm8k --apply_chat_template --output_path results/

`python -m lopa_fast lm-eval ARGS` (`main`) parses ARGS with lm-eval's own parser and configuration
(`EvaluatorConfig`: the same flags, defaults and checks as `lm-eval run`), builds the `LopaFastLM` instance, runs
`lm_eval.simple_evaluate` on it and saves lm-eval's result dict with lm-eval's `EvaluationTracker` under
`--output_path` (a directory, or a `.json` path). From Python, `evaluate(lm, tasks, output_path=...)` does the same.
Without `pretrained=` the embedded d2f-arith model runs.

- `generate_until` runs each request through `lopa_fast.generate` (batch 1; lm-eval's batch_size is accepted and
  ignored): the context tokenised (as is, or without added specials when lm-eval applied the chat template,
  which already holds them), `until` as text stops (lopa_fast.request.text.split_stops: tokenised into generate's
  `stop=`, the one stop mechanism, and matched on the text), `max_gen_toks` as max_new_tokens, `do_sample` /
  `temperature` / `top_p` / `top_k` as the sampling knobs; every other model_arg is a generate knob (GenerateConfig's
  names).
- `loglikelihood` (multiple-choice tasks, lambada, ...): the masked-diffusion ELBO of the continuation, a Monte
  Carlo estimate over `mc_num` noisy copies (`mc_loglikelihood`, as LLaDA's and Dream's own lm-eval code do);
  `is_greedy` by LLaDA's greedy check (`greedy_matches`). `loglikelihood_rolling` (perplexity tasks) sums the ELBO
  of lm-eval's rolling windows. Both need a full-attention (diffusion) model.
- Per generate_until request the tokens, forwards, TPF and finish reason are recorded (`LopaFastLM.records`);
  `evaluate` adds the totals to the result dict (key "lopa_fast"), prints them and writes them, with every
  request, to `lopa_fast_stats_<date>.json` next to lm-eval's `results_<date>.json`.

Modules: elbo.py (the masked-diffusion ELBO estimator and the greedy check: torch only), model.py (`LopaFastLM`, the
registered model, and its model-arg checks), run.py (`evaluate` / `main`: lm-eval's Python API and command line).
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
