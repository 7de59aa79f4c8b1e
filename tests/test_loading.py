"""HF-format checkpoint loading: single file, sharded, PEFT LoRA merge, special ids, tokenizer, bad input."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import lopa_fast
from lopa_fast.models import CheckpointError, save_checkpoint
from lopa_fast.testing import random_model, tiny_hf_config


def _write(tmp_path, kind="dream", shard_size=None, **cfg_kw):
    hf_cfg = tiny_hf_config(kind, **cfg_kw)
    model = random_model(hf_cfg, seed=2)
    d = tmp_path / f"{kind}_ckpt"
    save_checkpoint(model, d, hf_cfg, shard_size=shard_size)
    return d, model, hf_cfg


@pytest.mark.parametrize("kind", ["dream", "qwen2", "llada"])
@pytest.mark.parametrize("shard_size", [None, 5])
def test_roundtrip_logits(tmp_path, kind, shard_size):
    d, model, _ = _write(tmp_path, kind, shard_size=shard_size, num_kv_heads=2 if kind != "llada" else 4)
    if shard_size:
        assert (d / "model.safetensors.index.json").is_file()
    loaded = lopa_fast.load_model(d, dtype=torch.float32)
    ids = torch.randint(0, 60, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
    assert loaded.mask_token_id == (None if kind == "qwen2" else 63) and loaded.eos_token_id == 62
    assert not any(p.requires_grad for p in loaded.parameters())


def test_dtype_and_generation_config_ids(tmp_path):
    d, _, hf_cfg = _write(tmp_path, "qwen2")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["eos_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [40, 41], "mask_token_id": 7}))
    m = lopa_fast.load_model(d, dtype="bf16")
    assert m.dtype == torch.bfloat16
    assert m.eos_token_id == 40 and m.config.eos_token_ids == [40, 41] and m.mask_token_id == 7


def test_default_dtype_is_float32_on_cpu_bfloat16_on_cuda(tmp_path):
    """One default on every surface (load_model, CLI, server, lm-eval): a CPU has no fast bfloat16 matmul."""
    from lopa_fast.models.loading import default_dtype

    d, _, _ = _write(tmp_path, "qwen2")
    assert lopa_fast.load_model(d).dtype == torch.float32
    assert default_dtype("cpu") == torch.float32 and default_dtype("cuda:1") == torch.bfloat16


def _write_adapter(tmp_path, model, targets, r=4, alpha=8, use_rslora=False, extra_cfg=None):
    d = tmp_path / "adapter"
    d.mkdir()
    g = torch.Generator().manual_seed(9)
    tensors = {}
    for name, mod in model.named_modules():
        if name.split(".")[-1] in targets:
            out_f, in_f = mod.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = 0.3 * torch.randn(r, in_f, generator=g)
            tensors[f"base_model.model.{name}.lora_B.weight"] = 0.3 * torch.randn(out_f, r, generator=g)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
           "use_rslora": use_rslora, "base_model_name_or_path": "tiny"}
    cfg.update(extra_cfg or {})
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d, tensors


@pytest.mark.parametrize("use_rslora", [False, True])
def test_lora_merge_equals_on_the_fly(tmp_path, use_rslora):
    d, model, _ = _write(tmp_path, "dream")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter, tensors = _write_adapter(tmp_path, model, targets, use_rslora=use_rslora)
    merged = lopa_fast.load_model(d, dtype=torch.float32, lora=adapter)
    scale = 8 / 2.0 if use_rslora else 8 / 4
    handles = []
    for name, mod in model.named_modules():
        if name.split(".")[-1] in targets:
            A = tensors[f"base_model.model.{name}.lora_A.weight"]
            B = tensors[f"base_model.model.{name}.lora_B.weight"]
            handles.append(mod.register_forward_hook(lambda m, i, o, A=A, B=B: o + scale * (i[0] @ A.T) @ B.T))
    ids = torch.randint(0, 60, (1, 8))
    with torch.no_grad():
        expected = model(ids)
        got = merged(ids)
    for h in handles:
        h.remove()
    # fp32 rounding of (W + dBA) x vs Wx + dBAx: logits are O(1), so 5e-5 is ~100 ulp, far below the
    # O(1) effect of the adapter asserted just below.
    torch.testing.assert_close(got, expected, atol=5e-5, rtol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(model(ids), got, atol=1e-3)


def test_tokenizer_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<|mask|>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": template})
    )
    t = lopa_fast.load_tokenizer(tmp_path)
    assert t.encode("hello world") == [2, 3]
    assert t.eos_token_id == 0
    ids = t.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == [2]


# ---- bad input -----------------------------------------------------------------------------------
def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        lopa_fast.load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        lopa_fast.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("dream")))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        lopa_fast.load_model(tmp_path)
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        lopa_fast.load_tokenizer(tmp_path)


def test_unknown_model_type(tmp_path):
    d, _, hf_cfg = _write(tmp_path)
    (d / "config.json").write_text(json.dumps({**hf_cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unknown model_type 'gpt2'"):
        lopa_fast.load_model(d)


def _rewrite_weights(d, fn):
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


def test_missing_extra_and_misshapen_tensors(tmp_path):
    d, _, _ = _write(tmp_path)
    _rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model.layers.1.mlp.up_proj.weight"):
        lopa_fast.load_model(d)
    d, _, _ = _write(tmp_path / "b")
    _rewrite_weights(d, lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model.extra.weight"):
        lopa_fast.load_model(d)
    d, _, _ = _write(tmp_path / "c")
    _rewrite_weights(d, lambda t: t.__setitem__("model.norm.weight", torch.zeros(31)))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(31,\), expected \(32,\)"):
        lopa_fast.load_model(d)


def test_unsupported_dtype(tmp_path):
    d, _, _ = _write(tmp_path)
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        lopa_fast.load_model(d, dtype=torch.int8)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        lopa_fast.load_model(d, dtype="fp8")


def test_sharded_index_names_missing_shard(tmp_path):
    d, _, _ = _write(tmp_path, shard_size=5)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (d / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard '{shard}', which is missing"):
        lopa_fast.load_model(d)


def test_lora_bad_target_and_pickle_only(tmp_path):
    d, model, _ = _write(tmp_path)
    adapter, tensors = _write_adapter(tmp_path, model, ["q_proj"])
    bogus = {k.replace("q_proj", "qkv_proj"): v for k, v in tensors.items()}
    save_file(bogus, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="targets module 'model.layers.0.self_attn.qkv_proj'"):
        lopa_fast.load_model(d, lora=adapter)
    with pytest.raises(CheckpointError, match="not a directory"):
        lopa_fast.load_model(d, lora=tmp_path / "no_adapter")
    p = tmp_path / "pickled"
    p.mkdir()
    (p / "config.json").write_text((d / "config.json").read_text())
    torch.save(model.state_dict(), p / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickle weights"):
        lopa_fast.load_model(p)
    loaded = lopa_fast.load_model(p, dtype=torch.float32, allow_pickle=True)
    ids = torch.randint(0, 60, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
