"""Golden trajectories for the `vanilla` and `threshold` references, from the UPSTREAM samplers.

Usage:
    python tests/golden/make_blockloop_golden.py --llada <ML-GSAI/LLaDA checkout> \
        --fastdllm <NVlabs/Fast-dLLM checkout> --lopa <zhijie-group/LoPA checkout> [--out ...json]

Tested at ML-GSAI/LLaDA b7e6c35 (`generate.py`), NVlabs/Fast-dLLM 24cc59e (`llada/generate.py`:
generate / generate_with_prefix_cache / generate_with_dual_cache with `threshold`;
`dream/model/generation_utils_block.py`: the Dream block sampler, prefix and dual cache) and LoPA 433177a
(`scale_dream_d2f/model_cache/dream/generation_utils.py`: Dream's own `_sample`, the vanilla Dream sampler).
Their files are imported at run time; nothing of them is copied here, only token ids and forward counts
are written.

The network is ours (tiny seeded random LLaDA / Dream models) behind adapters with each upstream
model's call contract: `model(x).logits` (LLaDA, no cache); Fast-dLLM LLaDA's legacy cache (per layer
(k, v) [1, H, L, D], keys before RoPE, prefix slicing, `replace_position` in-place block update); Dream's
`self(x, attention_mask, tok_idx, ...)` with Fast-dLLM's cache ([1, L, Hkv*D] before RoPE, in-place dual
update, query positions ending at the block end). The old Fast-dLLM loop always runs one cached forward
after a refresh: replayed with `count_noop_forward=True`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

from lopa_fast.models.transformer import rms_norm  # noqa: E402
from lopa_fast.testing import model_from_spec, weights_fingerprint  # noqa: E402

MODELS = {
    "llada": (dict(kind="llada", vocab_size=64), dict(seed=4, sharpen=5.0)),
    "dream": (dict(kind="dream", vocab_size=64), dict(seed=5, sharpen=5.0)),
}


def dense_forward(m, ids, past=None, replace=None, layout="bhld"):
    """Plain forward of our weights with a pre-RoPE cache in upstream's layouts.

    past: per layer (k, v) before RoPE ("bhld": [1, Hkv, L, D]; "bl": [1, L, Hkv*D]) or None.
    replace: (s, e) to overwrite cache positions [s, e) in place (dual cache), queries at [s, e).
    Returns raw logits [1, n, V] and the new per-layer cache (same layout, before RoPE).
    """
    cfg = m.config
    n = ids.shape[1]
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def to_std(t):  # -> [1, L, Hkv, D]
        return t.transpose(1, 2) if layout == "bhld" else t.view(1, t.shape[1], Hkv, D)

    def from_std(t):
        return t.transpose(1, 2) if layout == "bhld" else t.reshape(1, t.shape[1], Hkv * D)

    h = F.embedding(ids, m.embed_weight())
    new = []
    for i in range(cfg.num_layers):
        w = m.layer(i)
        x = rms_norm(h, w.attn_norm, cfg.rms_norm_eps)
        q = w.q(x).view(1, n, Hq, D)
        k = w.k(x).view(1, n, Hkv, D)
        v = w.v(x).view(1, n, Hkv, D)
        if past is None:
            K, V, qpos0 = k, v, 0
        elif replace is not None:
            s, e = replace
            K, V = to_std(past[i][0]).clone(), to_std(past[i][1]).clone()
            K[:, s:e], V[:, s:e] = k, v
            qpos0 = e - n
        else:
            K = torch.cat([to_std(past[i][0]), k], 1)
            V = torch.cat([to_std(past[i][1]), v], 1)
            qpos0 = K.shape[1] - n
        new.append((from_std(K), from_std(V)))
        Lk = K.shape[1]
        ck, sk = m.rope_tables(torch.arange(Lk))
        cq, sq = m.rope_tables(torch.arange(qpos0, qpos0 + n))
        qr = m._apply_rope(q, cq, sq).transpose(1, 2)
        kr = m._apply_rope(K, ck, sk).transpose(1, 2).repeat_interleave(Hq // Hkv, 1)
        vr = V.transpose(1, 2).repeat_interleave(Hq // Hkv, 1)
        a = F.scaled_dot_product_attention(qr, kr, vr)
        h = h + w.o(a.transpose(1, 2).reshape(1, n, Hq * D))
        x = rms_norm(h, w.mlp_norm, cfg.rms_norm_eps)
        h = h + w.down(F.silu(w.gate(x)) * w.up(x))
    h = rms_norm(h, m.final_norm_weight(), cfg.rms_norm_eps)
    return F.linear(h, m.head_weight()), new


class LLaDAAdapter:
    """`model(x, attention_mask=..., past_key_values=..., use_cache=..., replace_position=...)`."""

    def __init__(self, m):
        self.m, self.device, self.calls = m, torch.device("cpu"), 0

    def __call__(self, x, attention_mask=None, past_key_values=None, use_cache=False, replace_position=None):
        self.calls += 1
        if x.shape[0] > 1:  # CFG batch: rows independently
            outs = [self(x[b : b + 1]).logits for b in range(x.shape[0])]
            self.calls -= x.shape[0]
            return SimpleNamespace(logits=torch.cat(outs), past_key_values=None)
        rep = None
        if replace_position is not None:
            idx = replace_position[0].nonzero()[:, 0]
            rep = (int(idx.min()), int(idx.max()) + 1)
        logits, cache = dense_forward(self.m, x, past_key_values, rep, "bhld")
        return SimpleNamespace(logits=logits, past_key_values=cache)


class DreamAdapter:
    """Dream's `self(x, attention_mask, tok_idx, past_key_values=, use_cache=, dual_cache=, replace_position=)`."""

    def __init__(self, m):
        self.m, self.device, self.calls = m, torch.device("cpu"), 0

    def __call__(self, x, attention_mask=None, tok_idx=None, past_key_values=None, use_cache=False, dual_cache=False,
                 replace_position=None):
        self.calls += 1
        rep = None
        if dual_cache and past_key_values is not None:
            idx = replace_position[0].nonzero()[:, 0]
            rep = (int(idx.min()), int(idx.max()) + 1)
        logits, cache = dense_forward(self.m, x, past_key_values, rep, "bl")
        return SimpleNamespace(logits=logits, past_key_values=cache)


def load(path, name):
    if not os.path.isfile(path):
        raise SystemExit(f"missing upstream file {path}")
    d = os.path.dirname(path)
    sys.path.insert(0, d)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def import_fastdllm_llada(checkout):
    import types

    sys.modules.setdefault("model", types.ModuleType("model"))
    sys.modules["model.modeling_llada"] = types.SimpleNamespace(LLaDAModelLM=object)
    return load(os.path.join(checkout, "llada", "generate.py"), "fastdllm_llada_generate")


def gen_config(**kw):
    base = dict(output_history=False, return_dict_in_generate=False, temperature=0.0, top_p=None, top_k=None,
                alg_temp=None, eps=1e-3)
    base.update(kw)
    return SimpleNamespace(**base)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llada", required=True)
    ap.add_argument("--fastdllm", required=True)
    ap.add_argument("--lopa", required=True)
    ap.add_argument("--out", default=os.path.join(HERE, "blockloop_upstream.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    llada_gen = load(os.path.join(args.llada, "generate.py"), "llada_generate")
    fast_llada = import_fastdllm_llada(args.fastdllm)
    fast_dream = load(os.path.join(args.fastdllm, "dream", "model", "generation_utils_block.py"), "fast_dream_block")
    dream_gen = load(os.path.join(args.lopa, "scale_dream_d2f", "model_cache", "dream", "generation_utils.py"),
                     "dream_generation_utils")
    models = {name: model_from_spec(*MODELS[name]) for name in MODELS}
    cases = []
    prompts = [[3, 9, 4, 1], [7], [11, 4, 30, 8, 1, 1, 12, 40, 2]]

    def record(case, ids, forwards):
        cases.append({**case, "generated_ids": ids, "forwards": forwards})
        print(case, forwards, ids[:12], flush=True)

    # ---- LLaDA vanilla (ML-GSAI generate.py) ----
    m = models["llada"]
    for j, (steps, gen_len, bl, remasking, cfg_scale, seed) in enumerate(
        [(16, 16, 16, "low_confidence", 0.0, None), (8, 16, 4, "low_confidence", 0.0, None),
         (16, 16, 8, "random", 0.0, 7), (8, 16, 8, "low_confidence", 1.5, None),
         (12, 24, 8, "low_confidence", 0.0, None)]
    ):
        a = LLaDAAdapter(m)
        prompt = prompts[j % 3]
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            ones = torch.ones(1, len(prompt), dtype=torch.long)  # upstream's CFG path needs a mask
            x = llada_gen.generate(a, torch.tensor([prompt]), attention_mask=ones, steps=steps, gen_length=gen_len,
                                   block_length=bl, temperature=0.0, cfg_scale=cfg_scale, remasking=remasking,
                                   mask_id=m.mask_token_id)
        kw = dict(steps=steps, block_length=bl, remasking=remasking, cfg_scale=cfg_scale)
        case = dict(model="llada", strategy="vanilla", prompt=prompt, max_new_tokens=gen_len, kw=kw, torch_seed=seed)
        record(case, x[0, len(prompt):].tolist(), a.calls)

    # ---- LLaDA threshold (Fast-dLLM 24cc59e) ----
    fns = {None: fast_llada.generate, "prefix": fast_llada.generate_with_prefix_cache,
           "dual": fast_llada.generate_with_dual_cache}
    for j, (cache, tau, gen_len, bl) in enumerate(
        [(None, 0.9, 16, 8), (None, 0.6, 24, 8), ("prefix", 0.9, 16, 8), ("prefix", 0.6, 24, 4),
         ("dual", 0.9, 16, 8), ("dual", 0.5, 24, 8)]
    ):
        a = LLaDAAdapter(m)
        prompt = prompts[j % 3]
        with torch.no_grad():
            x, nfe = fns[cache](a, torch.tensor([prompt]), steps=gen_len // bl, gen_length=gen_len, block_length=bl,
                                temperature=0.0, remasking="low_confidence", mask_id=m.mask_token_id,
                                threshold=tau)
        assert nfe == a.calls, (nfe, a.calls)
        kw = dict(threshold=tau, block_length=bl, cache=cache, count_noop_forward=cache is not None)
        case = dict(model="llada", strategy="threshold", prompt=prompt, max_new_tokens=gen_len, kw=kw)
        record(case, x[0, len(prompt):].tolist(), nfe)

    # ---- Dream vanilla (Dream's _sample) ----
    m = models["dream"]
    for j, (alg, steps, gen_len, alg_temp, seed) in enumerate(
        [("maskgit_plus", 16, 16, None, None), ("topk_margin", 8, 16, None, None), ("entropy", 16, 16, None, None),
         ("origin", 8, 16, None, 11), ("entropy", 8, 16, 0.5, 12), ("maskgit_plus", 24, 24, None, None)]
    ):
        a = DreamAdapter(m)
        prompt = prompts[j % 3]
        if seed is not None:
            torch.manual_seed(seed)
        gc = gen_config(max_length=len(prompt) + gen_len, mask_token_id=m.mask_token_id, steps=steps, alg=alg,
                        alg_temp=alg_temp)
        with torch.no_grad():
            x = dream_gen.DreamGenerationMixin._sample(a, torch.tensor([prompt]), None, gc, lambda i, x, l: x,
                                                      lambda i, x, l: l)
        kw = dict(steps=steps, alg=alg)
        if alg_temp is not None:
            kw["alg_temp"] = alg_temp
        case = dict(model="dream", strategy="vanilla", prompt=prompt, max_new_tokens=gen_len, kw=kw, torch_seed=seed)
        record(case, x[0, len(prompt):].tolist(), a.calls)

    # ---- Dream threshold (Fast-dLLM Dream block sampler: prefix / dual cache) ----
    for j, (dual, tau, gen_len, bl) in enumerate([(False, 0.9, 16, 8), (False, 0.6, 24, 8), (True, 0.9, 16, 8),
                                                  (True, 0.5, 24, 4)]):
        a = DreamAdapter(m)
        prompt = prompts[j % 3]
        gc = gen_config(max_length=len(prompt) + gen_len, mask_token_id=m.mask_token_id, steps=gen_len // bl,
                        alg="confidence_threshold")
        with torch.no_grad():
            x = fast_dream.DreamGenerationMixin._sample(a, torch.tensor([prompt]), None, gc, threshold=tau,
                                                       block_length=bl, dual_cache=dual)
        kw = dict(threshold=tau, block_length=bl, cache="dual" if dual else "prefix", count_noop_forward=True)
        case = dict(model="dream", strategy="threshold", prompt=prompt, max_new_tokens=gen_len, kw=kw)
        record(case, x[0, len(prompt):].tolist(), a.calls)

    out = {
        "source": "ML-GSAI/LLaDA b7e6c35 generate.py; NVlabs/Fast-dLLM 24cc59e llada/generate.py and "
        "dream/model/generation_utils_block.py; LoPA 433177a Dream generation_utils.py; CPU fp32, T=0",
        "command": "python tests/golden/make_blockloop_golden.py --llada <LLaDA> --fastdllm <Fast-dLLM> --lopa <LoPA>",
        "models": {name: {"hf": MODELS[name][0], "random": MODELS[name][1], "fingerprint": weights_fingerprint(models[name])}
                   for name in MODELS},
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0)
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
