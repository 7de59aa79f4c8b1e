"""Reference vanilla diffusion decoding: LLaDA low-confidence remasking and Dream's samplers.

The model family decides which one runs (config.bind rejects the other family's knobs):

- LLaDA (ML-GSAI/LLaDA generate.py; docs/semantics.md section 4.1): x = [prompt | MASK x gen],
  semi-autoregressive blocks of `block_length`, `steps // num_blocks` steps per block with the transfer
  schedule floor(n/S) (+1 for the first n mod S steps); per step one cache-free forward over the whole
  sequence, x0 = argmax (float64 Gumbel-max at T > 0), confidence = softmax(logits)[x0] (`low_confidence`)
  or uniform noise (`random`), -inf beyond the current block and at non-masked positions, commit the
  top-k (`confidence_eos_eot_inf`: positions predicting EOS/EOT come last). `cfg_scale > 0`:
  unsupervised CFG (prompt positions masked in the unconditional copy; the two
  rows run as one batched forward), logits = un + (cfg_scale + 1) * (cond - un).
- Dream (Dream's `diffusion_generate` / `_sample`): one block over the whole generation, `steps` steps
  on timesteps linspace(1, eps, steps + 1) in float32; shifted logits (position 0 keeps its own row).
  `origin`: each mask is revealed with probability 1 - s/t (1 on the last step), sampled from the
  model; `maskgit_plus` (p_max), `topk_margin` (top1 - top2), `entropy` (neg-entropy): transfer
  int(n_mask * (1 - s/t)) (all on the last step) highest-confidence positions, or sample them from
  softmax(conf / alg_temp) when alg_temp > 0. With steps = max_new_tokens, step 0 transfers nothing
  (int(0.999...)) and the last step two (spec section 6 item 6): reproduced.

No early exit: forwards == steps always (both upstreams), except at a stop sequence (`stop=`): decoding ends
after the step that completes one in the finalised prefix (the tokens before the first mask).
"""
from __future__ import annotations

import warnings

import torch

from lopa_fast.output.progress import after_step
from lopa_fast import keyed
from lopa_fast.output import GenerateOutput, finalize_stats
from lopa_fast.reference.common import Clock, check_finite, draw_kw, request_noise, record_step, token_stats
from lopa_fast.sampling import gumbel_argmax
from lopa_fast.strategies.vanilla.spec import DREAM_CONFIDENCE, transfer_schedule


def _forward_full(model, x: torch.Tensor) -> torch.Tensor:
    return model.forward_window(x if x.dim() == 2 else x[None], mask="full")


def _llada(model, prompt, cfg, gen, stats, trace, on_round=None):
    P, G = prompt.numel(), cfg.max_new_tokens
    mask_id = cfg.mask_token_id
    x = torch.cat([prompt, prompt.new_full((G,), mask_id)])
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[:P] = True
    nb = G // cfg.block_length
    spb = cfg.steps // nb
    blocked = {cfg.eos_token_id} if cfg.eos_token_id is not None else set()
    eot = model.config.eot_token_id  # the family's (LLaDA's <|eot_id|>)
    if eot is not None and model.config.vocab_size > eot:
        blocked.add(eot)
    for b in range(nb):
        s, e = P + b * cfg.block_length, P + (b + 1) * cfg.block_length
        sched = transfer_schedule(int((x[s:e] == mask_id).sum()), spb)
        for i in range(spb):
            mask_index = x == mask_id
            if cfg.cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                both = _forward_full(model, torch.stack([x, un_x]))
                logits = both[1] + (cfg.cfg_scale + 1) * (both[0] - both[1])
            else:
                logits = _forward_full(model, x)[0]
            stats["forwards"] += 1
            stats["model_calls"] += 1
            read = (mask_index & (torch.arange(x.numel(), device=x.device) < e)).nonzero(as_tuple=True)[0]
            check_finite(logits[read], read, cfg, stats["forwards"])  # before the deliberate -inf below
            if cfg.logits_eos_inf and cfg.eos_token_id is not None:
                logits = logits.clone()
                logits[:, cfg.eos_token_id] = float("-inf")
            if cfg.suppress_mask_token:
                logits = logits.clone()
                logits[:, mask_id] = float("-inf")
            allpos = torch.arange(x.numel(), device=x.device)
            x0 = gumbel_argmax(logits, cfg.temperature, **draw_kw(gen, cfg, keyed.TOKEN, stats["forwards"], 0, allpos))
            if cfg.remasking == "low_confidence":
                p = torch.softmax(logits, dim=-1)
                x0_p = p.gather(-1, x0[:, None]).squeeze(-1)
            elif isinstance(gen, keyed.KeyedNoise):
                x0_p = keyed.uniform(gen.keys(keyed.REMASK, stats["forwards"], 0, allpos))
            else:
                x0_p = torch.rand(x0.shape, device=x0.device, generator=gen)
            if cfg.confidence_eos_eot_inf:
                # the flag's intent (upstream's chained assignment only zeroes p(EOT)): positions predicting
                # EOS/EOT are committed last. -1 (below every probability) rather than -inf, so that they
                # still win over the non-masked positions (-inf) and the block always fills.
                for t in blocked:
                    x0_p = torch.where(x0 == t, torch.full_like(x0_p, -1.0), x0_p)
            x0_p[e:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, x0_p, torch.full_like(x0_p, float("-inf")))
            k = sched[i]
            sel = torch.topk(conf, k).indices
            before = x.clone() if trace is not None else None
            x[sel] = x0[sel]
            stats["transferred"] += k
            record_step(trace, stats["forwards"], before, x, P, mask_id=mask_id)
            if after_step(x[P:], cfg, stats, on_round):  # the hook; a stop sequence in the finalised prefix ends it
                return x
    return x


def _dream(model, prompt, cfg, gen, stats, trace, on_round=None):
    P, G = prompt.numel(), cfg.max_new_tokens
    mask_id = cfg.mask_token_id
    x = torch.cat([prompt, prompt.new_full((G,), mask_id)])
    steps = cfg.steps
    timesteps = torch.linspace(1, cfg.eps, steps + 1, device=x.device)  # float32, as upstream
    kw = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
              suppress_token=mask_id if cfg.suppress_mask_token else None)
    for i in range(steps):
        before = x.clone() if trace is not None else None
        mask_index = x == mask_id
        raw = _forward_full(model, x)[0]
        stats["forwards"] += 1
        stats["model_calls"] += 1
        logits = torch.cat([raw[:1], raw[:-1]])
        mask_logits = logits[mask_index]
        mpos = mask_index.nonzero(as_tuple=True)[0]
        check_finite(mask_logits, mpos, cfg, stats["forwards"])
        step = stats["forwards"]
        t, s = timesteps[i], timesteps[i + 1]
        if cfg.alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full((int(mask_index.sum()),), mask_id, dtype=torch.long, device=x.device)
            if isinstance(gen, keyed.KeyedNoise):
                reveal = keyed.uniform(gen.keys(keyed.REVEAL, step, 0, mpos)) < p_transfer
            else:
                reveal = torch.rand(x0.shape, device=x.device, generator=gen) < p_transfer
            if bool(reveal.any()):
                draw = draw_kw(gen, cfg, keyed.TOKEN, step, 0, mpos[reveal])
                _, tok, _ = token_stats(mask_logits[reveal], **kw, **draw)
                x0[reveal] = tok
            x[mask_index] = x0
            stats["transferred"] += int(reveal.sum())
            record_step(trace, stats["forwards"], before, x, P, mask_id=mask_id)
            if after_step(x[P:], cfg, stats, on_round):
                break
            continue
        conf, x0, _ = token_stats(mask_logits, sampling_strategy=DREAM_CONFIDENCE[cfg.alg], **kw,
                                  **draw_kw(gen, cfg, keyed.TOKEN, step, 0, mpos))
        num_mask = mask_index.sum() / 1  # float32 tensor (upstream: mask_index.sum() / batch)
        n = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full_conf = torch.full(x.shape, float("-inf"), dtype=logits.dtype, device=x.device)
        full_conf[mask_index] = conf.to(logits.dtype)
        if n > 0:
            if cfg.alg_temp is None or cfg.alg_temp == 0:
                sel = torch.topk(full_conf, n).indices
            elif isinstance(gen, keyed.KeyedNoise):  # n of L without replacement, p ~ softmax(conf / alg_temp)
                w = torch.softmax(full_conf / cfg.alg_temp, dim=-1)
                allpos = torch.arange(x.numel(), device=x.device)
                sel = keyed.top_n_race(w, n, gen.keys(keyed.ORDER, step, 0, allpos)).nonzero(as_tuple=True)[0]
            else:
                sel = torch.multinomial(torch.softmax(full_conf / cfg.alg_temp, dim=-1), n, generator=gen)
            x_ = torch.full_like(x, mask_id)
            x_[mask_index] = x0
            x[sel] = x_[sel]
            stats["transferred"] += n
        record_step(trace, stats["forwards"], before, x, P, mask_id=mask_id)
        if after_step(x[P:], cfg, stats, on_round):
            break
    return x


def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """Vanilla decoding. prompt: LongTensor [P] on model.device; cfg: bound GenerateConfig; on_round: the
    progress hook (lopa_fast.output.progress.report_round), called after every step."""
    gen = request_noise(cfg, prompt.device)
    stats = {"forwards": 0, "model_calls": 0, "transferred": 0}
    trace = [] if cfg.return_trace else None
    with Clock(prompt.device) as clock:
        run = _llada if model.config.vanilla_commit == "block_topk" else _dream  # LLaDA's generate / Dream's
        x = run(model, prompt, cfg, gen, stats, trace, on_round)
    ids = x[prompt.numel() :].tolist()
    finalize_stats(stats, ids, cfg.eos_token_id, cfg.mask_token_id, clock.seconds, steps_plus_one=False)
    if stats["masks_left"] and not stats.get("stopped"):  # a stop ends decoding with masks left (cut by the API)
        warnings.warn(
            f"vanilla: {stats['masks_left']} of {len(ids)} generated positions still hold the mask id "
            f"{cfg.mask_token_id} after steps={cfg.steps} (the model predicted the mask token, or alg='origin' left "
            "them); see stats['masks_left'], or pass suppress_mask_token=True", RuntimeWarning, stacklevel=3)
    return GenerateOutput(ids, stats, trace)
