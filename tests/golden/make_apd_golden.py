"""Produce golden APD trajectories by running the UPSTREAM `apd_sample` on tiny random Dream + Qwen2 models.

Usage:
    git clone https://github.com/danielmisrael/apd upstream/apd        # /upstream/ is git-ignored
    python tests/golden/make_apd_golden.py upstream/apd [--out tests/golden/apd_upstream.json]

The checkout is danielmisrael/apd (tested at a555561). Its `dream/generation_utils.py` is imported at run time
(nothing of it is copied into this repo; it needs `transformers` for its imports); only the resulting token ids,
acceptance counts and forward counts are written. What is upstream and what is ours:

- upstream: `DreamGenerationMixin.apd_sample` unchanged (draft sampling, the acceptance criterion, the window /
  cache bookkeeping, prev_logits, the EOS stop, the leftright branch), with one substitution at import: the
  hard-coded Qwen2.5 vocabulary size 151936 (the slice of the Dream logits) becomes the tiny verifier's
  vocabulary size, which is what the constant means for the real pair.
- ours: the networks. Small adapters run our tiny models' weights through a plain dense forward (SDPA,
  RoPE at the given positions) with an HF-DynamicCache-like cache (`crop`, `get_seq_length`): the Dream
  adapter attends fully over cache + chunk (the contract of APD's modified modeling_dream.py), the Qwen2 one
  causally. The adapters count their calls.

tests/test_reference_apd.py replays every case through `lopa_fast.generate(..., backend="reference")`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

from lopa_fast.testing import model_from_spec, sdpa_forward, weights_fingerprint  # noqa: E402

# name: (tiny_hf_config kwargs, random_model kwargs, head rows zeroed from this id on (or None))
MODELS = {
    "d64": (dict(kind="dream", vocab_size=64), dict(seed=11, sharpen=6.0), None),
    "q64": (dict(kind="qwen2", vocab_size=64), dict(seed=12, sharpen=6.0), None),
    # Dream's layout: two extra ids past the verifier's vocabulary (mask = 65); they are never drafted
    "d66": (dict(kind="dream", vocab_size=66, eos_token_id=5), dict(seed=1, sharpen=6.0), 64),
    "q64b": (dict(kind="qwen2", vocab_size=64, num_layers=1, eos_token_id=5), dict(seed=2, sharpen=5.0), None),
}


def build(name: str):
    """The tiny model `name` (tests/test_reference_apd.py builds them the same way)."""
    hf, rnd, zero_from = MODELS[name]
    m = model_from_spec(hf, rnd)
    if zero_from is not None:
        with torch.no_grad():
            m.head_weight()[zero_from:] = 0
    return m


class Cache:
    """HF DynamicCache stand-in: per layer (k, v) [1, Hkv, L, D]; `crop` keeps the first n positions."""

    def __init__(self):
        self.layers = []

    def get_seq_length(self):
        return 0 if not self.layers else self.layers[0][0].shape[2]

    def crop(self, n):
        self.layers = [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]


class Adapter:
    """Callable like an HF model: (input_ids [1, n], past_key_values, position_ids, ...) -> .logits [1, n, V],
    .past_key_values (the given cache, extended by the chunk, or a new one)."""

    def __init__(self, model, causal: bool):
        self.m, self.causal = model, causal
        self.device = torch.device("cpu")
        self.calls = 0

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask=None, past_key_values=None, cache_position=None, position_ids=None,
                 **kw):
        if attention_mask is not None and attention_mask != "full":
            raise AssertionError(f"unexpected attention_mask {attention_mask!r}")
        m = self.m
        self.calls += 1
        cache = past_key_values if past_key_values is not None else Cache()
        start, n = cache.get_seq_length(), input_ids.shape[1]
        pos = torch.arange(start, start + n)
        if position_ids is not None:
            assert torch.equal(position_ids[0], pos), (position_ids, start)
        mask = (torch.arange(start + n)[None, :] <= pos[:, None]) if self.causal else None
        logits, cache.layers = sdpa_forward(m, input_ids, cache.layers, start, mask)
        return SimpleNamespace(logits=logits, past_key_values=cache)


def import_upstream(checkout: str, verifier_vocab: int):
    path = os.path.join(checkout, "dream", "generation_utils.py")
    if not os.path.isfile(path):
        raise SystemExit(f"{checkout}: no dream/generation_utils.py (pass a danielmisrael/apd checkout)")
    src = open(path).read()
    assert src.count("151936") == 1, "upstream changed: expected one hard-coded Qwen vocab size"
    src = src.replace("151936", str(verifier_vocab))
    spec = importlib.util.spec_from_loader(f"upstream_apd_{verifier_vocab}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def run_upstream(up, dllm, verifier, case):
    """One `apd_sample` call; returns the trajectory fields of the golden case."""
    P = len(case["prompt"])
    gcfg = SimpleNamespace(
        output_history=False, return_dict_in_generate=True, max_length=P + case["max_new_tokens"],
        mask_token_id=dllm.mask_token_id, temperature=case["temperature"], top_p=case["top_p"], top_k=case["top_k"],
        tokens_per_step=case["tokens_per_step"], kv_window=case["kv_window"], max_lookahead=case["max_lookahead"],
        apd_mixture_weight=case["apd_mixture_weight"], eos_token_id=case["eos_token_id"],
    )
    d = Adapter(dllm, causal=False)
    v = Adapter(verifier, causal=True) if verifier is not None else None
    if case["temperature"] > 0:
        torch.manual_seed(case["seed"])
    out = up.DreamGenerationMixin.apd_sample(d, torch.tensor([case["prompt"]]), None, gcfg,
                                             lambda *a: None, lambda *a: None, v)
    prof = out.profile
    return {
        "sequence": out.sequences[0, P:].tolist(),
        "acceptance_counts": [int(c) for c in prof.acceptance_counts],
        "dllm_forwards": int(prof.num_forward_evals),
        "verifier_forwards": v.calls if v is not None else 0,
    }


def cases():
    prompts = [[7], [5, 9, 2], [11, 4, 30, 8, 1, 1, 12, 20, 3]]
    # (R, W, M, K): upstream presets (0.7, 16, 100) and (0.6, 32, 200) scaled to 24-32 new tokens, plus corners
    rwm = [(0.5, None, None, None), (0.7, 4, 8, None), (0.6, 8, 16, None), (0.9, 0, 4, None), (0.3, 2, None, None),
           (0.5, None, 1, None), (0.7, 1, 12, None), (0.9, 16, None, None), (0.1, 3, 6, None),
           (None, None, None, 1), (None, 4, 8, 3), (None, 0, 2, 2)]
    grid, i = [], 0
    for dllm, ver in (("d64", "q64"), ("d66", "q64b")):
        for R, W, M, K in rwm:
            for eos in ("none", "mid"):
                i += 1
                grid.append(dict(dllm=dllm, verifier=ver if R is not None else None, apd_mixture_weight=R, kv_window=W,
                                 max_lookahead=M, tokens_per_step=K, prompt=prompts[i % 3],
                                 max_new_tokens=[24, 32][i % 2], eos=eos, temperature=0.0, top_p=None, top_k=None,
                                 seed=None))
    # T > 0 (quirk Q1: logits / T and noise^T), top-p / top-k, EOS inside the prompt (stops after one step)
    more = [("d64", "q64", 0.7, 4, 8, None, 0.5, 0.95, None, 3, "mid"), ("d66", "q64b", 0.5, None, None, None, 0.3,
            None, 10, 4, "none"), ("d64", None, None, 2, 6, 2, 0.8, 0.9, None, 5, "mid"),
            ("d66", "q64b", 0.9, 8, 16, None, 1.0, None, None, 6, "none"), ("d64", "q64", 0.6, 8, 16, None, 0.0, None,
            None, None, "prompt")]
    for j, (dllm, ver, R, W, M, K, T, tp, tk, seed, eos) in enumerate(more):
        grid.append(dict(dllm=dllm, verifier=ver, apd_mixture_weight=R, kv_window=W, max_lookahead=M,
                         tokens_per_step=K, prompt=prompts[j % 3], max_new_tokens=24, eos=eos, temperature=T, top_p=tp,
                         top_k=tk, seed=seed))
    return grid


def resolve_eos(up, models, case):
    """"none": the smallest id absent from the prompt and the whole no-EOS run (never stops early); "mid": the
    token the no-EOS run writes at generated position 9; "prompt": the prompt's first token."""
    if case["eos"] == "prompt":
        return case["prompt"][0]
    probe = run_upstream(up[case["dllm"]], models[case["dllm"]], models.get(case["verifier"]),
                         {**case, "eos_token_id": -1})
    if case["eos"] == "mid":
        return probe["sequence"][9]
    used = set(probe["sequence"]) | set(case["prompt"]) | {models[case["dllm"]].mask_token_id}
    return min(t for t in range(64) if t not in used)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="path to a danielmisrael/apd checkout")
    ap.add_argument("--out", default=os.path.join(HERE, "apd_upstream.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {name: build(name) for name in MODELS}
    mods = {}
    for d, v in (("d64", "q64"), ("d66", "q64b")):
        mods[d] = import_upstream(args.checkout, models[v].config.vocab_size)
    out = {
        "source": "danielmisrael/apd dream/generation_utils.py DreamGenerationMixin.apd_sample (a555561), CPU fp32",
        "command": "python tests/golden/make_apd_golden.py <apd checkout>",
        "models": {name: {"hf": MODELS[name][0], "random": MODELS[name][1], "zero_head_rows_from": MODELS[name][2],
                          "fingerprint": weights_fingerprint(models[name])} for name in MODELS},
        "cases": [],
    }
    for case in cases():
        with torch.inference_mode():
            case = {**case, "eos_token_id": resolve_eos(mods, models, case)}
            res = run_upstream(mods[case["dllm"]], models[case["dllm"]], models.get(case["verifier"]), case)
        out["cases"].append({**case, **res})
        print(case["dllm"], case["apd_mixture_weight"], case["kv_window"], case["max_lookahead"], case["eos"],
              res["acceptance_counts"], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0)
    print(f"wrote {len(out['cases'])} cases to {args.out}")


if __name__ == "__main__":
    main()
