"""The reference APD decoder (lopa_fast/strategies/apd/reference.py) against the UPSTREAM `apd_sample`, plus its rules.

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
from lopa_fast.strategies.apd import reference as apd
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
                        "tests/golden/make_apd_golden.py", pytrace=False)
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
                                "temperature", "top_p", "top_k", "seed", "eos_token_id")}
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
                             max_new_tokens=20, eos_token_id=eos, exact_prev_logits=True)
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
                             max_lookahead=8, max_new_tokens=24, return_trace=True)
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
    with pytest.raises(ValueError, match=r"verifier model_type 'Dream'.*causal AR qwen2"):
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
    # the fast backend covers apd at T > 0 with sampler='keyed' only (tests/test_fast_apd.py); upstream's order
    # (apd's default) stays on the reference
    with pytest.raises(ValueError, match=r"backend='fast' \(apd\) sampler='upstream'.*pass sampler='keyed'"):
        lopa_fast.generate(d, [1, 2], strategy="apd", backend="fast", max_new_tokens=8, temperature=0.5)
    out = lopa_fast.generate(d, [1, 2], strategy="apd", backend="auto", verifier=q, apd_mixture_weight=0.7,
                             max_new_tokens=8)
    assert out.stats["backend"] == "fast" and out.stats["strategy"] == "apd"
    with pytest.warns(RuntimeWarning, match=r"apd runs on the reference backend"):
        hot = lopa_fast.generate(d, [1, 2], strategy="apd", backend="auto", verifier=q, apd_mixture_weight=0.7,
                                 max_new_tokens=8, temperature=0.5, seed=1)
    assert hot.stats["backend"] == "reference"


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
])
def test_knob_validation(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GenerateConfig(strategy="apd", **kw).validate()


def test_apd_knobs_belong_to_apd():
    with pytest.raises(ValueError, match=r"kv_window=4 does not apply to strategy='lopa'; it is a knob of apd"):
        GenerateConfig(strategy="lopa", kv_window=4).validate()


# ---- the real checkpoints' layouts: Dream-v0-Instruct-7B drafting, Qwen2.5-0.5B verifying ----------------------
# Scaled down from the public files, keeping every structural fact: Dream (model_type "Dream", DreamModel, q/k/v
# biases, untied lm_head, 28 query / 4 KV heads -> 7 per KV head, mask 151666, eos = pad = bos 151643, sharded
# safetensors + index) and Qwen2.5-0.5B (model_type "qwen2", Qwen2ForCausalLM, 14 query / 2 KV heads,
# tie_word_embeddings true and no lm_head.weight in the file, one model.safetensors). Vocabularies: Qwen2.5's head
# has 151,936 rows (151,665 tokenizer entries, then padding) and Dream's 152,064 = 151,936 + 128, its tokenizer
# Qwen2.5's plus <|beginoftext|> 151665 and <|mask|> 151666. Here: ordinary tokens 0..79, <|endoftext|> 80,
# <|im_start|> 81, <|im_end|> 82 (verifier tokenizer: 83 entries, head 96 rows), Dream adds <|beginoftext|> 83 and
# <|mask|> 84 (tokenizer 85 entries, head 104 rows = 96 + 8). Weights are stored in bfloat16 like the originals.
LAYOUT_V_AR, LAYOUT_V_DLLM, LAYOUT_EOS, LAYOUT_MASK = 96, 104, 80, 84
_LAYOUT_WORDS = [f"w{i}" for i in range(80)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _layout_config(kind, vocab_size):
    if kind == "dream":  # Dream-v0-Instruct-7B's config.json keys (geometry scaled down)
        return {
            "architectures": ["DreamModel"], "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
            "bos_token_id": LAYOUT_EOS, "eos_token_id": LAYOUT_EOS, "hidden_act": "silu", "hidden_size": 56,
            "initializer_range": 0.02, "intermediate_size": 296, "mask_token_id": LAYOUT_MASK,
            "max_position_embeddings": 256, "max_window_layers": 2, "model_type": "Dream", "num_attention_heads": 7,
            "num_hidden_layers": 2, "num_key_value_heads": 1, "pad_token_id": LAYOUT_EOS, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": True,
            "use_sliding_window": False, "vocab_size": vocab_size,
        }
    return {  # Qwen2.5-0.5B's config.json keys (geometry scaled down)
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": LAYOUT_EOS,
        "eos_token_id": LAYOUT_EOS, "hidden_act": "silu", "hidden_size": 56, "initializer_range": 0.02,
        "intermediate_size": 304, "max_position_embeddings": 256, "max_window_layers": 2, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 256, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _layout_tensors(cfg, seed):
    """The public tensor names and shapes (HF Qwen2 layout), random bf16 values."""
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * D
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (H, H), p + "self_attn.q_proj.bias": (H,),
            p + "self_attn.k_proj.weight": (kv, H), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (H, H), p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
    shapes["model.norm.weight"] = (H,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    out = {}
    for name, shape in shapes.items():
        r = torch.randn(shape, generator=g)
        t = 1 + 0.1 * r if name.endswith("norm.weight") else 0.3 * r
        out[name] = t.to(torch.bfloat16)
    if "lm_head.weight" in out:  # the drafter never prefers <|mask|> or the rows past the verifier's vocabulary
        out["lm_head.weight"][LAYOUT_MASK] = 0
        out["lm_head.weight"][LAYOUT_V_AR:] = 0
    return out


def _write_layout(path, kind, vocab_size, words, seed=0, shards=None, **cfg_kw):
    """An HF directory in the public layout: config.json, (sharded) safetensors, tokenizer.json."""
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True)
    cfg = _layout_config(kind, vocab_size) | cfg_kw
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = _layout_tensors(cfg, seed)
    if shards is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:  # Dream-v0-Instruct-7B ships model-0000N-of-00004.safetensors + model.safetensors.index.json
        names = list(tensors)
        chunks = [names[i::shards] for i in range(shards)]
        weight_map = {}
        for i, chunk in enumerate(chunks):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k] for k in chunk}, str(path / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in chunk})
        total = sum(t.numel() * 2 for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in words if w.startswith("<|")])
    tok.save(str(path / "tokenizer.json"))
    return tensors


@pytest.fixture(scope="module")
def real_layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("apd_layout")
    dream_words = _LAYOUT_WORDS + ["<|beginoftext|>", "<|mask|>"]
    d_t = _write_layout(root / "Dream-v0-Instruct-7B", "dream", LAYOUT_V_DLLM, dream_words, seed=1, shards=4)
    q_t = _write_layout(root / "Qwen2.5-0.5B", "qwen2", LAYOUT_V_AR, _LAYOUT_WORDS, seed=2)
    return root, d_t, q_t


def test_real_checkpoint_layouts_load_and_run_apd(real_layout):
    """Dream-v0-Instruct-7B / Qwen2.5-0.5B layouts (scaled): load_model reads both, the verifier's head is its
    embedding (no lm_head tensor), the vocabularies pair (verifier rows a strict prefix), and APD runs."""
    root, d_t, q_t = real_layout
    assert "lm_head.weight" not in q_t and "lm_head.weight" in d_t
    assert not (root / "Qwen2.5-0.5B" / "model.safetensors.index.json").exists()
    assert len(list((root / "Dream-v0-Instruct-7B").glob("model-0000?-of-00004.safetensors"))) == 4
    d = lopa_fast.load_model(root / "Dream-v0-Instruct-7B", dtype=torch.float32)
    q = lopa_fast.load_model(root / "Qwen2.5-0.5B", dtype=torch.float32)
    dtok = lopa_fast.load_tokenizer(root / "Dream-v0-Instruct-7B")
    qtok = lopa_fast.load_tokenizer(root / "Qwen2.5-0.5B")
    assert (d.config.kind, d.attention, d.logits_shift, d.config.tie_word_embeddings) == ("dream", "full", True, False)
    assert (q.config.kind, q.attention, q.config.tie_word_embeddings) == ("qwen2", "causal", True)
    assert (d.mask_token_id, d.eos_token_id, d.pad_token_id, q.eos_token_id) == (LAYOUT_MASK, LAYOUT_EOS, LAYOUT_EOS,
                                                                                  LAYOUT_EOS)
    assert (len(qtok), len(dtok)) == (83, 85) and dtok.convert_ids_to_tokens(LAYOUT_MASK) == "<|mask|>"
    # tied head: the verifier's logits are its final hidden states times the file's embedding
    emb = q_t["model.embed_tokens.weight"].float()
    assert q.head_weight().data_ptr() == q.model.embed_tokens.weight.data_ptr() and torch.equal(q.head_weight(), emb)
    ids = torch.tensor([[3, 17, 42, 80, 5]])
    with torch.no_grad():
        h = q.forward_window(ids, mask="causal", output="hidden")
        logits_q, logits_d = q(ids), d(ids)
    torch.testing.assert_close(logits_q, h @ emb.T)
    assert logits_q.shape[-1] == LAYOUT_V_AR and logits_d.shape[-1] == LAYOUT_V_DLLM
    torch.testing.assert_close(d.head_weight(), d_t["lm_head.weight"].float())
    cfg = GenerateConfig(strategy="apd", apd_mixture_weight=0.7, max_new_tokens=24).resolve(d)
    apd.check_models(d, q, cfg, tokenizer=dtok, verifier_tokenizer=qtok)  # the shared 83 token strings agree

    prompt = dtok("w3 w17 w42 w5 w9")["input_ids"]
    assert prompt == [3, 17, 42, 5, 9]
    for R, W, M in ((0.7, 16, 100), (0.6, 2, 5), (0.9, None, None)):
        out = lopa_fast.generate(d, prompt, strategy="apd", verifier=q, apd_mixture_weight=R, kv_window=W,
                                 max_lookahead=M, max_new_tokens=24, temperature=0.0)
        st = out.stats
        # auto runs the fast APD step at T = 0; `again` below is the reference on the same pair
        assert st["backend"] == "fast" and st["dllm_forwards"] == st["verifier_forwards"] == st["forwards"]
        assert len(st["acceptance_counts"]) == st["forwards"] and all(c >= 1 for c in st["acceptance_counts"])
        assert sum(st["acceptance_counts"]) == len(out.generated_ids) <= 24
        assert all(t < LAYOUT_V_AR and t != LAYOUT_MASK for t in out.generated_ids)
        assert out.generated_ids[-1] == LAYOUT_EOS or len(out.generated_ids) == 24
        assert st["tpf"] == pytest.approx(len(out.generated_ids) / st["dllm_forwards"])
        # the reference gives the same trajectory (the fast step on the real layouts: tied verifier head, 96 vs 104
        # vocabulary rows)
        again = apd.generate(d, torch.tensor(prompt), dataclasses_replace(cfg, R, W, M), verifier=q)
        assert again.generated_ids == out.generated_ids and again.stats["acceptance_counts"] == st["acceptance_counts"]


def dataclasses_replace(cfg, R, W, M):
    """cfg with other APD knobs (already validated and bound)."""
    import dataclasses

    return dataclasses.replace(cfg, apd_mixture_weight=R, kv_window=W, max_lookahead=M)


def test_real_checkpoint_layout_mismatches_raise(real_layout, tmp_path):
    """A verifier whose vocabulary is not a prefix of Dream's (more rows; the stop token outside it; other token
    strings) or that is not causal (Dream itself) is refused before any forward, with the documented error."""
    root, _, _ = real_layout
    d = lopa_fast.load_model(root / "Dream-v0-Instruct-7B", dtype=torch.float32)
    kw = dict(strategy="apd", apd_mixture_weight=0.7, max_new_tokens=8)
    _write_layout(tmp_path / "big", "qwen2", LAYOUT_V_DLLM + 8, _LAYOUT_WORDS, seed=3)
    with pytest.raises(ValueError, match=rf"verifier vocab_size={LAYOUT_V_DLLM + 8} > drafter vocab_size="
                                         rf"{LAYOUT_V_DLLM}.*prefix"):
        lopa_fast.generate(d, [3, 4], verifier=lopa_fast.load_model(tmp_path / "big"), **kw)
    # a smaller vocabulary of its own (its stop token 60 inside it) does not hold the drafter's stop token
    _write_layout(tmp_path / "small", "qwen2", 64, _LAYOUT_WORDS[:64], seed=3, eos_token_id=60, bos_token_id=60)
    with pytest.raises(ValueError, match=rf"eos_token_id={LAYOUT_EOS} is outside the verifier's vocabulary \[0, 64\)"):
        lopa_fast.generate(d, [3, 4], verifier=lopa_fast.load_model(tmp_path / "small"), **kw)
    with pytest.raises(ValueError, match=r"verifier model_type 'Dream'.*causal AR qwen2"):
        lopa_fast.generate(d, [3, 4], verifier=d, **kw)
    other = _LAYOUT_WORDS[:10] + ["x10"] + _LAYOUT_WORDS[11:]
    _write_layout(tmp_path / "other", "qwen2", LAYOUT_V_AR, other, seed=3)
    cfg = GenerateConfig(**kw).resolve(d)
    with pytest.raises(ValueError, match=r"tokenizers differ on the shared vocabulary prefix: id 10 is 'w10'"):
        apd.check_models(d, lopa_fast.load_model(tmp_path / "other"), cfg,
                         tokenizer=lopa_fast.load_tokenizer(root / "Dream-v0-Instruct-7B"),
                         verifier_tokenizer=lopa_fast.load_tokenizer(tmp_path / "other"))
