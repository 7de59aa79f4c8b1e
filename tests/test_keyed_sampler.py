"""The keyed sampler (lopa_fast.keyed): draws are pure functions of their keys, marginals match the softmax,
and decoding with it gives the same tokens on both backends for the same seed (every strategy with a fast
path, T in {0.2, 1.0}, with top-p / top-k), different tokens for different seeds."""
import math

import pytest
import torch

import lopa_fast
from lopa_fast import keyed
from lopa_fast.sampling import token_stats
from lopa_fast.testing import random_model, tiny_hf_config

# chi-square critical values at p = 0.001 (df -> value), so a correct sampler fails with probability 1e-3
# for a random seed; the seeds below are fixed, so the test is deterministic
CHI2_999 = {7: 24.32, 5: 20.52}


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = probs.double() * n
    keep = exp > 0
    return float((((counts.double() - exp) ** 2)[keep] / exp[keep]).sum())


def test_hash_is_a_pure_function_of_the_key():
    pos = torch.arange(50)
    a = keyed.key(7, keyed.TOKEN, 3, 1, pos)
    assert torch.equal(a, keyed.key(7, keyed.TOKEN, 3, 1, pos))
    assert torch.equal(a[10:20], keyed.key(7, keyed.TOKEN, 3, 1, pos[10:20]))  # no dependence on batch / order
    for other in (keyed.key(8, 0, 3, 1, pos), keyed.key(7, 1, 3, 1, pos), keyed.key(7, 0, 4, 1, pos),
                  keyed.key(7, 0, 3, 2, pos)):
        assert not torch.equal(a, other)
    # tensor and int fields hash alike (the fast path keeps the step on the device)
    assert torch.equal(a, keyed.key(7, keyed.TOKEN, torch.tensor(3), torch.tensor(1), pos))
    u = keyed.uniform(keyed.key(0, 0, 0, 0, torch.arange(200_000)))
    assert u.dtype == torch.float64 and bool((u > 0).all() and (u < 1).all())
    assert abs(u.mean().item() - 0.5) < 3 * math.sqrt(1 / 12 / u.numel()) * 2
    hist = torch.histc(u.float(), bins=8, min=0, max=1)
    assert chi2(hist, torch.full((8,), 1 / 8)) < CHI2_999[7]


def test_seed_hashing_covers_large_seeds():
    pos = torch.arange(4)
    assert not torch.equal(keyed.key(2**63 - 1, 0, 0, 0, pos), keyed.key(2**62, 0, 0, 0, pos))


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_keyed_marginals_match_softmax(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25]])
    n = 40_000
    keys = keyed.key(11, keyed.TOKEN, torch.arange(n), 0, torch.zeros(n, dtype=torch.long))
    _, x0, p = token_stats(logits.expand(n, -1), temperature=temperature, keys=keys)
    probs = torch.softmax(logits[0] / temperature, -1)
    counts = torch.bincount(x0, minlength=8)
    assert chi2(counts, probs) < CHI2_999[7], (counts / n, probs)
    assert torch.allclose(p, probs[x0])


def test_keyed_top_p_top_k_never_draw_filtered_ids():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    n = 20_000
    keys = keyed.key(5, keyed.TOKEN, torch.arange(n), 0, torch.zeros(n, dtype=torch.long))
    _, x0, _ = token_stats(logits.expand(n, -1), temperature=1.0, top_k=3, keys=keys)
    assert set(x0.tolist()) == {0, 1, 2}
    kept = torch.softmax(logits[0, :3], -1)
    assert chi2(torch.bincount(x0, minlength=3)[:3], kept) < 13.82  # df 2, p = 0.001
    _, x0, _ = token_stats(logits.expand(n, -1), temperature=1.0, top_p=0.6, keys=keys)
    assert set(x0.tolist()) <= {0, 1}


def test_keyed_llada_gumbel_and_race():
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5, 1.5]])
    n = 30_000
    keys = keyed.key(3, keyed.TOKEN, torch.arange(n), 0, torch.zeros(n, dtype=torch.long))
    x0 = keyed.gumbel_argmax(logits.expand(n, -1), 1.0, keys)
    assert chi2(torch.bincount(x0, minlength=6), torch.softmax(logits[0], -1)) < CHI2_999[5]
    # without replacement: 2 of 4 weights, each pair's frequency as sequential sampling says
    w = torch.tensor([0.4, 0.3, 0.2, 0.1])
    picks = torch.stack([keyed.top_n_race(w, 2, keyed.key(9, keyed.ORDER, t, 0, torch.arange(4))) for t in range(4000)])
    assert bool((picks.sum(1) == 2).all())
    incl = picks.double().mean(0)
    # inclusion probability of item i: p_i + sum_{j != i} p_j p_i / (1 - p_j)
    exact = torch.tensor([w[i] + sum(w[j] * w[i] / (1 - w[j]) for j in range(4) if j != i) for i in range(4)])
    assert torch.allclose(incl, exact.double(), atol=0.03), (incl, exact)


def test_sampler_knob_validation():
    with pytest.raises(ValueError, match="sampler='bogus'"):
        lopa_fast.GenerateConfig(sampler="bogus").validate()
    assert lopa_fast.GenerateConfig(strategy="apd", sampler="keyed").validate().sampler == "keyed"  # opt-in for apd
    m = random_model(tiny_hf_config("dream", vocab_size=64), seed=0)
    assert lopa_fast.GenerateConfig(max_new_tokens=8, block_size=4).bind(m).sampler == "keyed"
    assert lopa_fast.GenerateConfig(strategy="apd", max_new_tokens=8).bind(m).sampler == "upstream"


@pytest.fixture(scope="module")
def decoding_models():
    return {"dream": random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=3),
            "llada": random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=3)}


STRATEGY_ROWS = [
    ("dream", "vanilla", dict(steps=8, alg="maskgit_plus")),
    ("dream", "vanilla", dict(steps=8, alg="origin")),
    ("llada", "vanilla", dict(steps=8, block_length=8, remasking="random", cfg_scale=1.0)),
    ("dream", "threshold", dict(threshold=0.9, block_length=8, cache="dual")),
    ("llada", "threshold", dict(factor=1.0, block_length=8, cache="prefix")),
    ("dream", "d2f", dict(block_size=8)),
    ("dream", "lopa", dict(block_size=8, branching_factor=2)),
    ("llada", "lopa", dict(block_size=8, branching_factor=4, use_full_attention=False)),
]


@pytest.mark.parametrize("temperature", [0.2, 1.0])
@pytest.mark.parametrize("row", range(len(STRATEGY_ROWS)))
def test_same_seed_same_tokens_on_both_backends(decoding_models, row, temperature):
    mname, strategy, kw = STRATEGY_ROWS[row]
    m = decoding_models[mname]
    kw = dict(kw, max_new_tokens=16, temperature=temperature)
    if mname == "dream":  # LLaDA's vanilla sampler is Gumbel-max on raw logits (no top-p / top-k)
        kw.update(top_p=0.9, top_k=20)
    runs = {}
    for seed in (1, 2, 3):
        ref = lopa_fast.generate(m, [3, 4, 5, 6], strategy, "reference", seed=seed, **kw)
        fast = lopa_fast.generate(m, [3, 4, 5, 6], strategy, "fast", seed=seed, **kw)
        assert fast.stats["backend"] == "fast"
        assert fast.generated_ids == ref.generated_ids and fast.stats["forwards"] == ref.stats["forwards"], seed
        runs[seed] = fast.generated_ids
    if temperature == 1.0:  # the seed is honoured: different seeds, different tokens (at T = 0.2 these sharpened
        assert len({tuple(v) for v in runs.values()}) > 1  # models often give every seed the greedy answer)
