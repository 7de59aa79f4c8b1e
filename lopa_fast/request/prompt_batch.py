"""A list of prompts decoded together: whether their plans share forwards, and the batched run.

A strategy with a batch driver (its spec's `driver`: vanilla, threshold, d2f, lopa, apd) on the fast backend runs
every live request's windows in ONE forward per round / step (apd: one drafter forward, then one verifier forward;
lopa_fast.decode.batch; with compile=True one compiled / captured batched step per step key:
lopa_fast.decode.compiled_batch); otherwise (the reference backend, distributed=True, a driver that does not cover
the config) the prompts are decoded one after another, each as it would be alone."""
from __future__ import annotations

import torch

from lopa_fast.request import threads
from lopa_fast.config import GenerateConfig
from lopa_fast.output.finish import cut_to_length
from lopa_fast.output import GenerateOutput


def batches(cfg: GenerateConfig, plans) -> bool:
    """Whether the plans (lopa_fast.request.plan.Plan, one per prompt, under the validated `cfg`) share forwards: the
    strategy's driver batches this config (lopa_fast.decode.batch.batchable) and every prompt runs on the fast
    backend."""
    from lopa_fast.decode.batch import batchable

    return batchable(cfg, plans[0].spec) and all(p.backend == "fast" for p in plans)


def run(plans) -> list[GenerateOutput]:
    """Decode batched plans (`batches` said so) together: one GenerateOutput per plan, in order, each equal to
    decoding that prompt alone, cut to its requested length; stats["batched"]: the number of prompts."""
    from lopa_fast.decode.batch import run_batch

    model = plans[0].model
    with torch.inference_mode(), threads.scoped(model):
        outs = run_batch(model, [p.ids for p in plans], [p.cfg for p in plans], on_round=[p.on_round for p in plans],
                         verifier=plans[0].verifier, spec=plans[0].spec)
    results = []
    for out, p in zip(outs, plans):
        out.stats.setdefault("strategy", p.cfg.strategy)
        out.stats["backend"] = "fast"
        out.stats["batched"] = len(plans)
        results.append(cut_to_length(out, p.length, p.cfg))
    return results
