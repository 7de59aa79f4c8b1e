"""Produce golden D2F / LoPA trajectories by running the UPSTREAM decoding loops on tiny random models.

Usage:
    python tests/golden/make_lopa_golden.py /path/to/LoPA-checkout [--d2f /path/to/Discrete-Diffusion-Forcing]
        [--out tests/golden/lopa_upstream.json]

The checkout is zhijie-group/LoPA (tested at 433177a608dee8901bae0e7c02f9b6f341a6f6d0). Its file
`scale_dream_d2f/scale_dream_d2f.py` is imported at run time (nothing of it is copied into this repo);
only the resulting token ids and step counts are written. What is upstream and what is ours:

- upstream: `DreamLoRA._generate_enhanced_speculative` (LoPA; branching_factor 1/2/4) and
  `_generate_original_single_branch` (D2F), with their block states, masks (`extract_attention_mask`),
  shift, sampling, scoring, spawn and cache bookkeeping, unchanged. The lm-eval harness class is built
  without its __init__ (only the decoding attributes are set), and the heavy imports it does not use on
  this path (lm_eval, accelerate, peft, datasets, its Dream modeling file) are stubbed.
- optionally D2F's own decoder (`--d2f`: Discrete-Diffusion-Forcing D2F-eval/eval_dream.py
  `_generate_block_single`, 771f745, block-causal), replayed as `d2f` with use_full_attention=False.
- ours: the network. A small adapter runs our tiny model's weights through a plain dense-mask forward
  (SDPA with upstream's additive mask, RoPE at cache_len + arange, KV cache = past + first
  `update_kvcache` window positions, exactly the contract of upstream's modified Dream model), and a
  DynamicCache stand-in with `to_legacy_cache` / `from_legacy_cache` (transformers 5 removed them).

tests/test_reference_golden.py replays every case through `lopa_fast.generate(..., backend="reference")`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

from lopa_fast.testing import model_from_spec, sdpa_forward, weights_fingerprint  # noqa: E402

MODELS = {
    # name: (tiny_hf_config kwargs, random_model kwargs)
    "gqa64": (dict(kind="dream", vocab_size=64), dict(seed=1, sharpen=6.0)),
    "mha48": (dict(kind="dream", vocab_size=48, num_heads=2, num_kv_heads=2), dict(seed=3, sharpen=8.0,
                                                                                   zero_mask_row=False)),
}


class LegacyCache:
    """DynamicCache stand-in: per layer (k, v) [1, Hkv, L, D]."""

    def __init__(self, layers=None):
        self.layers = list(layers or [])

    def get_seq_length(self):
        return 0 if not self.layers else self.layers[0][0].shape[2]

    def to_legacy_cache(self):
        return tuple(self.layers)

    @classmethod
    def from_legacy_cache(cls, legacy):
        return cls([(k, v) for k, v in legacy])


class DenseAdapter:
    """Callable like upstream's modified DreamModel: (input_ids, attention_mask, past_key_values,
    use_cache, update_kvcache) -> .logits [1, n, V], .past_key_values (mutated in place, as upstream)."""

    def __init__(self, model):
        self.m = model
        self.calls = 0

    def eval(self):
        return self

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, update_kvcache=0):
        m = self.m
        self.calls += 1
        if past_key_values is None:
            past_key_values = LegacyCache()
        start = past_key_values.get_seq_length()
        n = input_ids.shape[1]
        mask = None if attention_mask is None else attention_mask[..., : start + n].to(m.dtype)
        logits, layers = sdpa_forward(m, input_ids, past_key_values.layers, start, mask)
        if update_kvcache:
            keep = start + update_kvcache
            past_key_values.layers = [(K[:, :, :keep], V[:, :, :keep]) for K, V in layers]
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


def import_upstream(checkout: str):
    """Import scale_dream_d2f.py with its unused heavy dependencies stubbed."""
    src = os.path.join(checkout, "scale_dream_d2f")
    if not os.path.isfile(os.path.join(src, "scale_dream_d2f.py")):
        raise SystemExit(f"{checkout}: no scale_dream_d2f/scale_dream_d2f.py (pass a LoPA checkout)")

    import transformers  # noqa: F401  (before the stubs: it probes for accelerate by spec)
    import transformers.cache_utils  # noqa: F401

    def stub(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    class _Any:
        def __init__(self, *a, **k):
            pass

    # stubbed only where not installed (transformers >= 5 imports the real accelerate's dispatch_model)
    for name, attrs in (("accelerate", dict(Accelerator=_Any, InitProcessGroupKwargs=_Any)),
                        ("datasets", dict(Dataset=_Any)), ("peft", dict(PeftConfig=_Any, PeftModel=_Any))):
        try:
            __import__(name)
        except ImportError:
            stub(name, **attrs)
    stub("lm_eval")
    stub("lm_eval.utils")
    sys.modules["lm_eval"].utils = sys.modules["lm_eval.utils"]
    stub("lm_eval.api")
    stub("lm_eval.api.instance", Instance=_Any)
    stub("lm_eval.api.model", TemplateLM=object, LM=object)
    stub("lm_eval.api.registry", register_model=lambda *a, **k: (lambda cls: cls))
    stub("lm_eval.models")
    stub("lm_eval.models.utils", get_dtype=lambda d: d)
    stub("lm_eval.__main__", cli_evaluate=lambda *a, **k: None)
    stub("model_cache")
    stub("model_cache.dream")
    stub("model_cache.dream.model_dream", DreamModel=_Any)
    stub("model_cache.dream.configuration_dream", DreamConfig=_Any)
    for name in ("tqdm", "jinja2"):
        try:
            __import__(name)
        except ImportError:
            stub(name, tqdm=_Any)
    import importlib.util

    spec = importlib.util.spec_from_file_location("upstream_lopa", os.path.join(src, "scale_dream_d2f.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.DynamicCache = LegacyCache
    return mod


def run_case(up, model, case):
    lm = object.__new__(up.DreamLoRA)
    adapter = DenseAdapter(model)
    attrs = dict(
        model=adapter, _device=torch.device("cpu"), mask_token_id=model.mask_token_id,
        tokenizer=SimpleNamespace(eos_token_id=case["eos_token_id"]), target_dtype=torch.float32,
        max_length=len(case["prompt"]) + case["max_new_tokens"] + 8, temperature=0.0, top_p=case.get("top_p"),
        top_k=case.get("top_k"),
        use_uncertainty_logic=case["strategy"] == "lopa", base_branch_competition=True,
        branch_verification_mode=True, verification_force_base_winner=False,
        shared_past_key_values=None, shared_last_logits=None, debug_print=False,
    )
    for k in ("max_new_tokens", "block_size", "block_add_threshold", "decoded_token_threshold", "skip_threshold",
              "sampling_strategy", "branching_factor", "branch_topp", "selection_conf_alpha",
              "use_full_attention"):
        attrs[k] = case[k]
    lm.__dict__.update(attrs)
    prompt = torch.tensor([case["prompt"]])
    if case["strategy"] == "lopa":
        ids, steps, _, stats = lm._generate_enhanced_speculative(prompt)
    else:
        ids, stats = lm._generate_original_single_branch(prompt)
        steps = stats["steps_taken"]
    # model calls actually issued (upstream's branch_processing_count also counts the final, forward-less round)
    return {"generated_ids": ids, "upstream_steps": steps, "model_calls": adapter.calls}


def run_d2f_orig(mod, model, case):
    """D2F's own `_generate_block_single` (Discrete-Diffusion-Forcing D2F-eval/eval_dream.py): block-causal
    only, 'margin_confidence' is its name for margin; it returns text, so the tokenizer stand-in encodes ids."""
    lm = object.__new__(mod.DreamLoRA)
    adapter = DenseAdapter(model)
    tok = SimpleNamespace(eos_token_id=case["eos_token_id"], eos_token="<never>",
                          decode=lambda ids, **k: ",".join(str(int(t)) for t in ids))
    attrs = dict(
        model=adapter, _device=torch.device("cpu"), mask_token_id=model.mask_token_id, tokenizer=tok,
        target_dtype=torch.float32, max_length=len(case["prompt"]) + case["max_new_tokens"] + 8, temperature=0.0,
        top_p=None, top_k=None,
        sampling_strategy={"margin": "margin_confidence"}.get(case["sampling_strategy"], case["sampling_strategy"]),
    )
    for k in ("max_new_tokens", "block_size", "block_add_threshold", "decoded_token_threshold", "skip_threshold"):
        attrs[k] = case[k]
    lm.__dict__.update(attrs)
    text = lm._generate_block_single(torch.tensor([case["prompt"]]))
    return {"generated_ids": [int(t) for t in text.split(",") if t], "forwards": adapter.calls}


def import_d2f_orig(checkout: str):
    path = os.path.join(checkout, "D2F-eval", "eval_dream.py")
    if not os.path.isfile(path):
        raise SystemExit(f"{checkout}: no D2F-eval/eval_dream.py (pass a Discrete-Diffusion-Forcing checkout)")
    import importlib.util

    spec = importlib.util.spec_from_file_location("upstream_d2f_eval", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def d2f_orig_cases():
    prompts = [[5, 9, 2], [7], list(range(3, 20))]
    grid = []
    for i, (name, samp) in enumerate([(n, s) for n in MODELS for s in ("default", "margin", "neg_entropy")]):
        grid.append(dict(
            model=name, strategy="d2f", source="D2F-eval", sampling_strategy=samp, use_full_attention=False,
            prompt=prompts[i % 3], max_new_tokens=24 if i % 2 else 32, block_size=8 if i % 2 else 4,
            block_add_threshold=[0.1, 0.25, 0.5][i % 3], decoded_token_threshold=[0.95, 0.9, 0.7][i % 3],
            skip_threshold=[0.9, 0.8][i % 2], eos_token_id=5 if i % 4 else 62 if name == "gqa64" else 46,
        ))
    return grid


def cases():
    prompts = [[5, 9, 2], [7], list(range(3, 20)), [11, 4, 30, 8, 1, 1, 12]]
    grid = []
    i = 0
    for name in MODELS:
        for strategy, bf in (("d2f", 1), ("lopa", 1), ("lopa", 2), ("lopa", 4)):
            for samp in ("default", "margin", "neg_entropy"):
                for full in (True, False):
                    i += 1
                    grid.append(dict(
                        model=name, strategy=strategy, branching_factor=bf, sampling_strategy=samp,
                        use_full_attention=full, prompt=prompts[i % len(prompts)], max_new_tokens=24 if i % 3 else 32,
                        block_size=8 if i % 3 else 4, block_add_threshold=[0.1, 0.25, 0.5][i % 3],
                        decoded_token_threshold=[0.95, 0.9, 0.7][i % 3], skip_threshold=[0.9, 0.8, 0.7][(i // 3) % 3],
                        branch_topp=[1.0, 0.5][i % 2], selection_conf_alpha=[0.0, 0.0, 0.3][i % 3],
                        eos_token_id=5 if i % 4 else 62 if name == "gqa64" else 46,
                    ))
    # top-p / top-k filters also apply at T=0 (they renormalise p_max)
    for j, (strategy, bf, top_p, top_k) in enumerate([("d2f", 1, 0.9, None), ("lopa", 2, None, 5),
                                                      ("lopa", 4, 0.8, 10), ("lopa", 2, 0.95, None)]):
        grid.append(dict(
            model="gqa64", strategy=strategy, branching_factor=bf, sampling_strategy=["default", "neg_entropy"][j % 2],
            use_full_attention=j < 2, prompt=prompts[j], max_new_tokens=24, block_size=8, block_add_threshold=0.25,
            decoded_token_threshold=0.9, skip_threshold=0.8, branch_topp=1.0, selection_conf_alpha=0.0,
            eos_token_id=5, top_p=top_p, top_k=top_k,
        ))
    return grid


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="path to a zhijie-group/LoPA checkout")
    ap.add_argument("--d2f", help="optional: a zhijie-group/Discrete-Diffusion-Forcing checkout (D2F's own loop)")
    ap.add_argument("--out", default=os.path.join(HERE, "lopa_upstream.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    up = import_upstream(args.checkout)
    models = {name: model_from_spec(*MODELS[name]) for name in MODELS}
    out = {
        "source": "zhijie-group/LoPA scale_dream_d2f/scale_dream_d2f.py (433177a), run on CPU fp32, T=0",
        "command": "python tests/golden/make_lopa_golden.py <LoPA checkout> --d2f <D2F checkout>",
        "models": {name: {"hf": MODELS[name][0], "random": MODELS[name][1], "fingerprint": weights_fingerprint(models[name])}
                   for name in MODELS},
        "cases": [],
    }
    for case in cases():
        with torch.inference_mode():
            res = run_case(up, models[case["model"]], case)
        out["cases"].append({**case, **res})
        print(case["model"], case["strategy"], case["branching_factor"], case["sampling_strategy"],
              case["use_full_attention"], res["upstream_steps"], len(res["generated_ids"]), flush=True)
    if args.d2f:
        d2f = import_d2f_orig(args.d2f)
        out["source"] += "; zhijie-group/Discrete-Diffusion-Forcing D2F-eval/eval_dream.py (771f745)"
        for case in d2f_orig_cases():
            with torch.inference_mode():
                res = run_d2f_orig(d2f, models[case["model"]], case)
            out["cases"].append({**case, **res})
            print("D2F-eval", case["model"], case["sampling_strategy"], res["forwards"], len(res["generated_ids"]))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0)
    print(f"wrote {len(out['cases'])} cases to {args.out}")


if __name__ == "__main__":
    main()
