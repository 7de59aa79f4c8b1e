"""Checkpoints written by the installed transformers and peft themselves (not hand-written fixtures): config.json
as `save_pretrained` writes it today (transformers 5 puts rope_theta only inside `rope_parameters`), a LoRA adapter
as `peft` writes it, loaded by `lopa_fast.load_model` and compared in fp32 with transformers' own forward (and
PEFT's `merge_and_unload`) within 1e-5; Dream and LLaDA layouts; scaled RoPE refused naming the field."""
import json

import pytest
import torch

import lopa_fast
from lopa_fast.errors import ConfigError
from lopa_fast.models.config import parse_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 61
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_qwen2(rope_theta: float, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=rope_theta, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # the init's small weights make logits nearly equal; scale them so differences show
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return model


def _with_lora(model, out, seed: int = 1):
    """A PEFT LoRA (r 4, alpha 8, every projection; B drawn, not PEFT's zero init) saved to `out`; returns the
    merged model (`merge_and_unload`), the reference for the merged load."""
    torch.manual_seed(seed)
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    pm = peft.get_peft_model(model, lcfg)
    pm.save_pretrained(out)
    return pm.merge_and_unload().eval()


def _logits_bidirectional(model, ids):
    n = ids.shape[1]
    return model(ids, attention_mask=torch.zeros(1, 1, n, n)).logits  # Dream: an all-zero additive mask


def test_qwen2_saved_by_transformers_matches_with_rope_parameters(tmp_path):
    hf = _tiny_qwen2(1e6)
    hf.save_pretrained(tmp_path / "base")
    saved = json.loads((tmp_path / "base" / "config.json").read_text())
    if transformers.__version__.startswith("5"):  # the layout that was read wrong: no top-level rope_theta
        assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 1e6
    ours = lopa_fast.load_model(tmp_path / "base", dtype=torch.float32)
    assert ours.config.rope_theta == 1e6
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = hf(ids).logits
        torch.testing.assert_close(ours(ids), base, atol=1e-5, rtol=1e-5)
        merged = _with_lora(hf, tmp_path / "lora")  # merges into hf itself
        ours_lora = lopa_fast.load_model(tmp_path / "base", dtype=torch.float32, lora=tmp_path / "lora")
        want = merged(ids).logits
        assert (want - base).abs().max() > 1e-2  # the adapter moves the logits
        torch.testing.assert_close(ours_lora(ids), want, atol=1e-5, rtol=1e-5)


def test_dream_layout_saved_by_transformers(tmp_path):
    """Dream's checkpoints are Qwen2 tensors with model_type "Dream" and a mask id (its config class is remote
    code): the transformers save with those two keys changed, bidirectional logits, a PEFT adapter merged."""
    hf = _tiny_qwen2(5e5, seed=2)
    hf.save_pretrained(tmp_path / "dream")
    cfg_file = tmp_path / "dream" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(model_type="Dream", architectures=["DreamModel"], mask_token_id=VOCAB - 1)
    cfg_file.write_text(json.dumps(cfg))
    ids = torch.randint(0, VOCAB, (1, 33), generator=torch.Generator().manual_seed(1))
    ours = lopa_fast.load_model(tmp_path / "dream", dtype=torch.float32)
    assert ours.config.rope_theta == 5e5 and ours.mask_token_id == VOCAB - 1
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), _logits_bidirectional(hf, ids), atol=1e-5, rtol=1e-5)
        merged = _with_lora(hf, tmp_path / "lora", seed=3)
        ours_lora = lopa_fast.load_model(tmp_path / "dream", dtype=torch.float32, lora=tmp_path / "lora")
        torch.testing.assert_close(ours_lora(ids), _logits_bidirectional(merged, ids), atol=1e-5, rtol=1e-5)


class _LLaDAConfig(transformers.PretrainedConfig):
    """LLaDA's config class is remote code (configuration_llada.py); this subclass writes its keys the way
    `save_pretrained` of the installed transformers does."""
    model_type = "llada"


class _LLaDABlock(torch.nn.Module):
    def __init__(self, d, kv, ff):
        super().__init__()
        self.attn_norm, self.ff_norm = torch.nn.RMSNorm(d, eps=1e-5), torch.nn.RMSNorm(d, eps=1e-5)
        self.q_proj, self.k_proj = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, kv, bias=False)
        self.v_proj, self.attn_out = torch.nn.Linear(d, kv, bias=False), torch.nn.Linear(d, d, bias=False)
        self.ff_proj, self.up_proj = torch.nn.Linear(d, ff, bias=False), torch.nn.Linear(d, ff, bias=False)
        self.ff_out = torch.nn.Linear(ff, d, bias=False)


class _LLaDATensors(torch.nn.Module):
    """LLaDA's tensor names (model.transformer.{wte, blocks.i.*, ln_f, ff_out}); a module PEFT can wrap."""

    def __init__(self, vocab, d, kv, ff, layers):
        super().__init__()
        self.model = torch.nn.Module()
        t = self.model.transformer = torch.nn.Module()
        t.wte = torch.nn.Embedding(vocab, d)
        t.blocks = torch.nn.ModuleList(_LLaDABlock(d, kv, ff) for _ in range(layers))
        t.ln_f = torch.nn.RMSNorm(d, eps=1e-5)
        t.ff_out = torch.nn.Linear(d, vocab, bias=False)


def test_llada_layout_saved_by_transformers_and_peft(tmp_path):
    from safetensors.torch import save_file

    from tests.test_models import _llada_plain_forward

    keys = dict(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=48, embedding_size=VOCAB,
                vocab_size=VOCAB, max_sequence_length=128, rope_theta=5e5, rms_norm_eps=1e-5, layer_norm_type="rms",
                block_type="llama", include_bias=False, include_qkv_bias=False, weight_tying=False, rope=True,
                alibi=False, mask_token_id=VOCAB - 1, eos_token_id=VOCAB - 2, pad_token_id=VOCAB - 2)
    _LLaDAConfig(**keys).save_pretrained(tmp_path / "llada")
    torch.manual_seed(4)
    net = _LLaDATensors(VOCAB, 32, 16, 48, 2)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "llada" / "model.safetensors")
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(2))
    ours = lopa_fast.load_model(tmp_path / "llada", dtype=torch.float32)
    assert ours.config.rope_theta == 5e5
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), _llada_plain_forward(net.state_dict(), keys, ids), atol=1e-5, rtol=1e-5)
    lcfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj",
                                                               "up_proj", "ff_out"], init_lora_weights=False)
    torch.manual_seed(5)
    pm = peft.get_peft_model(net, lcfg)
    pm.save_pretrained(tmp_path / "lora")
    merged = pm.merge_and_unload().state_dict()
    ours_lora = lopa_fast.load_model(tmp_path / "llada", dtype=torch.float32, lora=tmp_path / "lora")
    with torch.no_grad():
        torch.testing.assert_close(ours_lora(ids), _llada_plain_forward(merged, keys, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "Dream"])
@pytest.mark.parametrize("scaling, field", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                          "original_max_position_embeddings": 32}}, "rope_parameters.rope_type"),
    ({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_theta": 1e6, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
])
def test_scaled_rope_is_refused_naming_the_field(kind, scaling, field):
    cfg = {"model_type": kind, "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, **scaling}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        parse_config(cfg)
    assert e.value.key == field


def test_rope_spellings_agree():
    """The three spellings of one plain rope base parse to the same number; the LLaDA ones too."""
    base = {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    for extra in ({"rope_theta": 1e6}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                  {"rope_theta": 1e6, "rope_scaling": {"rope_type": "default"}}):
        assert parse_config({**base, **extra}).rope_theta == 1e6, extra
    assert parse_config(base).rope_theta == 10000.0  # transformers' default
    llada = {"model_type": "llada", "d_model": 32, "n_heads": 4, "n_layers": 1, "mlp_hidden_size": 48,
             "vocab_size": VOCAB, "mask_token_id": VOCAB - 1, "eos_token_id": VOCAB - 2,
             "pad_token_id": VOCAB - 2}
    assert parse_config({**llada, "rope_theta": 5e5}).rope_theta == 5e5
    assert parse_config({**llada, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}).rope_theta == 5e5
    with pytest.raises(ConfigError, match="rope_parameters.rope_type"):
        parse_config({**llada, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    with pytest.raises(ConfigError, match="alibi"):
        parse_config({**llada, "alibi": True})
    with pytest.raises(ConfigError, match="use_sliding_window"):
        parse_config({**base, "use_sliding_window": True})
