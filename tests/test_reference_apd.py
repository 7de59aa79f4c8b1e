"""The reference APD decoder (lopa_fast/reference/apd.py) against the UPSTREAM `apd_sample`, plus its rules.

tests/golden/apd_upstream.json was produced by `python tests/golden/make_apd_golden.py <apd checkout>`, which
runs danielmisrael/apd's own `DreamGenerationMixin.apd_sample` (a555561) on seeded tiny Dream + Qwen2 models
(CPU, fp32) over a grid of (R, W, M, K, prompt length, EOS, temperature / top-p / top-k). Every case must match
token for token, in the acceptance counts, and in dLLM and verifier forwards.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

import lopa_fast
from lopa_fast.config import GenerateConfig
from lopa_fast.reference import apd
from lopa_fast.testing import model_from_spec, random_model, tiny_hf_config, weights_fingerprint

HERE = os.path.dirname(__file__)
DATA = json.load(open(os.path.join(HERE, "golden", "apd_upstream.json")))
_spec = importlib.util.spec_from_file_location("make_apd_golden", os.path.join(HERE, "golden", "make_apd_golden.py"))
MAKER = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MAKER)  # the dense adapters only (upstream is imported by its main())


@pytest.fixture(scope="module")
def models():
    out = {}
    for name, spec in DATA["models"].items():
        m = model_from_spec(spec["hf"], spec["random"])
        if spec["zero_head_rows_from"] is not None:
            with torch.no_grad():
                m.head_weight()[spec["zero_head_rows_from"] :] = 0
        if weights_fingerprint(m) != spec["fingerprint"]:
            pytest.fail(f"lopa_fast.testing now builds different weights for {name}; regenerate the goldens with "
                        "tests/golden/make_apd_golden.py", pytrace=False)  # fmt: skip
        out[name] = m
    return out


def test_golden_grid_covers_the_knobs():
    cases = DATA["cases"]
    assert len(cases) >= 50
    assert {c["apd_mixture_weight"] for c in cases} >= {None, 0.1, 0.3, 0.5, 0.6, 0.7, 0.9}
    assert {c["kv_window"] for c in cases} >= {None, 0, 1, 2, 4, 8, 16}
    assert {c["max_lookahead"] for c in cases} >= {None, 1, 4, 8, 12, 16}
    assert {len(c["prompt"]) for c in cases} == {1, 3, 9}
    assert any(c["temperature"] > 0 for c in cases)
    counts = [c["acceptance_counts"] for c in cases if c["apd_mixture_weight"] is not None]
    assert any(all(a == 1 for a in cs) for cs in counts)  # first-token-only steps throughout
    assert any(cs[0] == c["max_new_tokens"] for cs, c in zip(counts, cases)) or any(len(cs) == 1 for cs in counts)
    assert any(sum(c["acceptance_counts"]) < c["max_new_tokens"] for c in cases)  # the EOS stop


def _run(models, case, **extra):
    kw = {k: case[k] for k in ("apd_mixture_weight", "kv_window", "max_lookahead", "tokens_per_step", "max_new_tokens",
                                "temperature", "top_p", "top_k", "seed", "eos_token_id")}  # fmt: skip
    kw.update(extra)
    ver = models[case["verifier"]] if case["verifier"] else None
    return lopa_fast.generate(models[case["dllm"]], case["prompt"], strategy="apd", verifier=ver, **kw)


@pytest.mark.parametrize("i", range(len(DATA["cases"])))
def test_reference_matches_upstream(models, i):
    case = DATA["cases"][i]
    out = _run(models, case)
    n = min(sum(case["acceptance_counts"]), case["max_new_tokens"])
    assert out.generated_ids == case["sequence"][:n]
    mask = models[case["dllm"]].mask_token_id
    assert all(t == mask for t in case["sequence"][n:])  # upstream leaves the unreached tail masked
    assert out.stats["acceptance_counts"] == case["acceptance_counts"]
    assert out.stats["dllm_forwards"] == out.stats["forwards"] == case["dllm_forwards"]
    assert out.stats["verifier_forwards"] == case["verifier_forwards"]
    assert out.stats["tpf"] == pytest.approx(n / case["dllm_forwards"])


# ---- the acceptance rule on hand-built logits ----------------------------------------------------------
def _onehot(ids, V=8, scale=5.0):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float() * scale


def test_accept_all_first_only_and_prefix():
    x0 = torch.tensor([1, 2, 3, 4])
    same = _onehot([1, 2, 3, 4])
    assert apd.accept_count(x0, same, same, 0.5) == 4  # all accepted
    # the verifier dominates (R small) and disagrees at every position: only the first token (always accepted)
    assert apd.accept_count(x0, same, _onehot([0, 0, 0, 0], scale=50.0), 0.1) == 1
    # agreement up to position 2, then a disagreement, then agreement again: the prefix stops at the first miss
    assert apd.accept_count(x0, same, _onehot([1, 2, 0, 4], scale=50.0), 0.1) == 2
    # R = 1: the dLLM alone is the target, so an argmax draft is always accepted
    assert apd.accept_count(x0, same, _onehot([0, 0, 0, 0], scale=50.0), 1.0) == 4
    # mixed logits: 0.6 * l_D + 0.4 * l_AR, computed by hand
    l_d = torch.tensor([[2.0, 0.0], [2.0, 0.0]])
    l_ar = torch.tensor([[0.0, 3.5], [0.0, 2.0]])  # row 0: 1.2 vs 1.4 (miss, but first), row 1: 1.2 vs 0.8
    assert apd.accept_count(torch.tensor([0, 0]), l_d, l_ar, 0.6) == 2
    l_ar2 = torch.tensor([[0.0, 0.0], [0.0, 3.5]])  # row 1: 1.2 vs 1.4 -> miss
    assert apd.accept_count(torch.tensor([0, 0]), l_d, l_ar2, 0.6) == 1


# ---- caches ---------------------------------------------------------------------------------------------
def test_verifier_cache_rollback_equals_recompute(models):
    q = models["q64"]
    torch.manual_seed(0)
    seq = torch.randint(0, 60, (20,))
    alt = torch.randint(0, 60, (20,))
    full = q.forward_window(seq[None], mask="causal")[0]
    cache = q.new_cache(40)
    q.forward_window(torch.cat([seq[:12], alt[12:]])[None], cache=cache, start=0, mask="causal", commit=20)
    cache.truncate(12)  # roll back the rejected tail
    out = q.forward_window(seq[12:][None], cache=cache, start=12, mask="causal", commit=8)[0]
    torch.testing.assert_close(out, full[12:], rtol=1e-5, atol=1e-5)


def test_dllm_window_cache_is_upstreams_crop_and_recompute(models):
    d = models["d64"]
    torch.manual_seed(1)
    x = torch.randint(0, 60, (24,))
    x[14:] = d.mask_token_id
    ref = MAKER.Adapter(d, causal=False)
    c_up = MAKER.Cache()
    ref(x[:20][None], past_key_values=c_up)  # first step: [0, 20) without a cache
    x[14:17] = torch.tensor([3, 4, 5])  # three accepted
    c_up.crop(9)
    up = ref(x[9:24][None], past_key_values=c_up, position_ids=torch.arange(9, 24)[None]).logits[0]
    cache = d.new_cache(24)
    apd.dllm_window_logits(d, cache, x.clone().index_fill_(0, torch.arange(14, 17), d.mask_token_id), 0, 20)
    ours = apd.dllm_window_logits(d, cache, x, 9, 24)
    torch.testing.assert_close(ours, torch.cat([up[:1], up[:-1]]), rtol=1e-5, atol=1e-5)
    assert cache.length == 24


# ---- oracles --------------------------------------------------------------------------------------------
def test_leftright_k1_is_left_to_right_argmax(models):
    d = models["d64"]
    prompt = [5, 9, 2]
    x = torch.tensor(prompt + [d.mask_token_id] * 12)
    for p in range(3, 15):
        x[p] = d.forward_window(x[None], mask="full")[0, p - 1].argmax()
    eos = min(t for t in range(63) if t not in x.tolist())
    out = lopa_fast.generate(d, prompt, strategy="apd", max_new_tokens=12, eos_token_id=eos)
    assert out.generated_ids == x[3:].tolist()
    assert out.stats["verifier_forwards"] == 0 and out.stats["acceptance_counts"] == [1] * len(out.generated_ids)
    k3 = lopa_fast.generate(d, prompt, strategy="apd", max_new_tokens=12, tokens_per_step=3, kv_window=2)
    assert k3.stats["acceptance_counts"] == [3, 3, 3, 3] and k3.stats["forwards"] == 4


def _oracle(d, q, prompt, n_new, R, M=None):
    """APD without caches (dLLM and verifier recomputed from scratch each step), the paper's prev_logits."""
    mask = d.mask_token_id
    x = torch.tensor(prompt + [mask] * n_new)
    P, L, curr, counts = len(prompt), len(prompt) + n_new, len(prompt), []
    while curr < L:
        right = min(curr + M, L) if M else L
        raw = d.forward_window(x[:right][None], mask="full")[0]
        ld = torch.cat([raw[:1], raw[:-1]])[curr:right]
        x0 = ld.argmax(-1)
        draft = x[:right].clone()
        draft[curr:right] = x0
        lar = q.forward_window(draft[None], mask="causal")[0][curr - 1 : right - 1]
        agree = (R * ld[:, : q.config.vocab_size] + (1 - R) * lar).argmax(-1) == x0
        agree[0] = True
        na = int(torch.cumprod(agree.long(), 0).sum())
        x[curr : curr + na] = x0[:na]
        curr += na
        counts.append(na)
    return x[P:].tolist(), counts


@pytest.mark.parametrize("R,M", [(0.5, None), (0.9, 4), (0.7, 8)])
def test_exact_prev_logits_equals_a_cache_free_oracle(models, R, M):
    d, q = models["d64"], models["q64"]
    want, counts = _oracle(d, q, [5, 9, 2], 20, R, M)
    eos = min(t for t in range(63) if t not in want + [5, 9, 2])  # never stops early, like the oracle
    out = lopa_fast.generate(d, [5, 9, 2], strategy="apd", verifier=q, apd_mixture_weight=R, max_lookahead=M,
                             max_new_tokens=20, eos_token_id=eos, exact_prev_logits=True)  # fmt: skip
    assert out.generated_ids == want and out.stats["acceptance_counts"] == counts


def test_quirk_flags_are_no_ops_at_t0(models):
    d, q = models["d66"], models["q64b"]
    kw = dict(strategy="apd", verifier=q, apd_mixture_weight=0.7, kv_window=4, max_lookahead=8, max_new_tokens=24)
    base = lopa_fast.generate(d, [7, 3], **kw)
    for flag in ("single_temperature", "coupled_gumbel"):
        assert lopa_fast.generate(d, [7, 3], **kw, **{flag: True}).generated_ids == base.generated_ids
    # at T > 0 they change the sampler (and stay seeded-deterministic)
    hot = dict(kw, temperature=0.7, seed=3)
    a = lopa_fast.generate(d, [7, 3], **hot, single_temperature=True, coupled_gumbel=True)
    b = lopa_fast.generate(d, [7, 3], **hot, single_temperature=True, coupled_gumbel=True)
    assert a.generated_ids == b.generated_ids


def test_trace_and_stats(models):
    d, q = models["d64"], models["q64"]
    out = lopa_fast.generate(d, [5, 9, 2], strategy="apd", verifier=q, apd_mixture_weight=0.7, kv_window=4,
                             max_lookahead=8, max_new_tokens=24, return_trace=True)  # fmt: skip
    st = out.stats
    assert st["model_calls"] == st["dllm_forwards"] + st["verifier_forwards"]
    assert sum(st["acceptance_counts"]) >= len(out.generated_ids)
    assert [t["num_accept"] for t in out.trace] == st["acceptance_counts"]
    assert [p for t in out.trace for p, _ in t["accepted"]] == list(range(len(out.generated_ids)))


# ---- errors ---------------------------------------------------------------------------------------------
def test_errors(models):
    d, q = models["d64"], models["q64"]
    with pytest.raises(ValueError, match=r"apd_mixture_weight=0.7 needs a verifier"):
        lopa_fast.generate(d, [1, 2], strategy="apd", apd_mixture_weight=0.7, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"verifier= given but apd_mixture_weight=None"):
        lopa_fast.generate(d, [1, 2], strategy="apd", verifier=q, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"verifier kind 'dream'.*causal AR qwen2"):
        lopa_fast.generate(d, [1, 2], strategy="apd", verifier=d, apd_mixture_weight=0.7, max_new_tokens=8)
    big = random_model(tiny_hf_config("qwen2", vocab_size=70), seed=0)
    with pytest.raises(ValueError, match=r"verifier vocab_size=70 > drafter vocab_size=64.*prefix"):
        lopa_fast.generate(d, [1, 2], strategy="apd", verifier=big, apd_mixture_weight=0.7, max_new_tokens=8)
    small = random_model(tiny_hf_config("qwen2", vocab_size=32), seed=0)
    with pytest.raises(ValueError, match=r"eos_token_id=62 is outside the verifier's vocabulary \[0, 32\)"):
        lopa_fast.generate(d, [1, 2], strategy="apd", verifier=small, apd_mixture_weight=0.7, max_new_tokens=8)
    llada = random_model(tiny_hf_config("llada", vocab_size=64), seed=0)
    with pytest.raises(ValueError, match=r"Dream-family dLLM"):
        lopa_fast.generate(llada, [1, 2], strategy="apd", max_new_tokens=8)
    with pytest.raises(ValueError, match=r"verifier= applies to strategy='apd'"):
        lopa_fast.generate(d, [1, 2], strategy="d2f", verifier=q, max_new_tokens=8, block_size=4)
    with pytest.raises(ValueError, match=r"backend='fast' does not cover strategy='apd'"):
        lopa_fast.generate(d, [1, 2], strategy="apd", backend="fast", max_new_tokens=8)
    out = lopa_fast.generate(d, [1, 2], strategy="apd", backend="auto", verifier=q, apd_mixture_weight=0.7,
                             max_new_tokens=8)  # fmt: skip
    assert out.stats["backend"] == "reference" and out.stats["strategy"] == "apd"


class _Tok:
    def __init__(self, words):
        self.words = words

    def __len__(self):
        return len(self.words)

    def convert_ids_to_tokens(self, ids):
        return [self.words[i] for i in ids]


def test_tokenizer_prefix_check(models):
    d, q = models["d64"], models["q64"]
    cfg = GenerateConfig(strategy="apd", apd_mixture_weight=0.5).bind(d)
    words = [f"w{i}" for i in range(64)]
    apd.check_models(d, q, cfg, tokenizer=_Tok(words), verifier_tokenizer=_Tok(list(words)))
    other = list(words)
    other[7] = "x"
    with pytest.raises(ValueError, match=r"id 7 is 'w7' for the drafter and 'x' for the verifier"):
        apd.check_models(d, q, cfg, tokenizer=_Tok(words), verifier_tokenizer=_Tok(other))


@pytest.mark.parametrize("kw,match", [
    (dict(apd_mixture_weight=1.5), r"apd_mixture_weight=1.5; allowed: a probability in \[0, 1\]"),
    (dict(kv_window=-1), r"kv_window=-1; allowed: an int >= 0"),
    (dict(max_lookahead=0), r"max_lookahead=0; allowed: an int >= 1"),
    (dict(apd_mixture_weight=0.5, tokens_per_step=2), r"tokens_per_step=2 applies to the verifier-free leftright"),
    (dict(tokens_per_step=4, max_lookahead=2), r"tokens_per_step=4 > max_lookahead=2"),
    (dict(coupled_gumbel=True), r"coupled_gumbel=True applies to APD with a verifier"),
    (dict(exact_prev_logits=1), r"exact_prev_logits=1 \(int\); expected True or False"),
])  # fmt: skip
def test_knob_validation(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GenerateConfig(strategy="apd", **kw).validate()


def test_apd_knobs_belong_to_apd():
    with pytest.raises(ValueError, match=r"kv_window=4 does not apply to strategy='lopa'; it is a knob of apd"):
        GenerateConfig(strategy="lopa", kv_window=4).validate()
