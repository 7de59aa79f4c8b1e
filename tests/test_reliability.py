"""Issue 17: broken numbers and hostile checkpoints -- detect, refuse, explain; never hang, never answer wrongly.

One test per failure of the issue. Hang cases are bounded by a generous wall-clock guard (a hang guard, not a
speed claim).
"""
import json
import math
import os
import time
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import lopa_fast
from lopa_fast import (
    CheckpointError,
    ConfigError,
    KnobError,
    MemoryBudgetError,
    NonFiniteLogitsError,
    RoundCapError,
)
from lopa_fast.models import save_checkpoint
from lopa_fast.testing import random_model, tiny_hf_config

HANG_GUARD_S = 60.0


def _ckpt(tmp_path, kind="dream", shard_size=None, name="ckpt", **kw):
    hf = tiny_hf_config(kind, **kw)
    model = random_model(hf, seed=3, sharpen=4.0)
    d = tmp_path / name
    save_checkpoint(model, d, hf, shard_size=shard_size)
    return d, model, hf


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


# ---- errors module -----------------------------------------------------------------------------------
def test_error_types_are_exported_and_keep_their_builtin_bases():
    assert issubclass(CheckpointError, ValueError) and issubclass(ConfigError, CheckpointError)
    assert issubclass(RoundCapError, RuntimeError) and issubclass(NonFiniteLogitsError, RuntimeError)
    assert issubclass(KnobError, ValueError) and issubclass(MemoryBudgetError, ValueError)
    import lopa_fast.config  # a submodule is an attribute of its package once imported (the test alone: not yet)
    import lopa_fast.models

    assert lopa_fast.config.RoundCapError is RoundCapError and lopa_fast.models.CheckpointError is CheckpointError
    e = NonFiniteLogitsError(strategy="lopa", round=3, position=7, value=float("nan"))
    assert (e.strategy, e.round, e.position) == ("lopa", 3, 7) and "round 3" in str(e) and "position 7" in str(e)


# ---- config schema -----------------------------------------------------------------------------------
def test_million_layers_fails_fast_naming_the_key(tmp_path):
    d, _, _ = _ckpt(tmp_path)
    _edit_config(d, num_hidden_layers=1_000_000)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="num_hidden_layers=1000000") as ei:
        lopa_fast.load_model(d, dtype=torch.float32)
    assert time.perf_counter() - t0 < HANG_GUARD_S
    assert ei.value.key == "num_hidden_layers" and ei.value.file.endswith("config.json")


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_size": -32}, "hidden_size"),
        ({"hidden_size": "32"}, "hidden_size"),
        ({"num_attention_heads": 5}, "num_attention_heads"),  # does not divide hidden_size=32
        ({"num_key_value_heads": 3}, "num_key_value_heads"),  # does not divide 4 heads
        ({"vocab_size": 1.5}, "vocab_size"),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
        ({"mask_token_id": 64}, "mask_token_id"),
        ({"eos_token_id": [3, 99]}, "eos_token_id"),
        ({"bos_token_id": "x"}, "bos_token_id"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ],
)
def test_bad_config_values_name_file_and_key(tmp_path, changes, key):
    d, _, _ = _ckpt(tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(ConfigError, match=key) as ei:
        lopa_fast.load_model(d, dtype=torch.float32)
    assert ei.value.key == key and "config.json" in str(ei.value)


def test_config_not_utf8_not_object(tmp_path):
    d, _, _ = _ckpt(tmp_path)
    (d / "config.json").write_bytes(b'{"model_type": "Dream\xff\xfe"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        lopa_fast.load_model(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected an object"):
        lopa_fast.load_model(d)
    (d / "config.json").write_text('"Dream"')
    with pytest.raises(ConfigError, match="expected an object"):
        lopa_fast.load_model(d)


def test_config_disagreeing_with_weight_headers(tmp_path):
    d, _, _ = _ckpt(tmp_path)
    _edit_config(d, vocab_size=80)
    with pytest.raises(ConfigError, match="vocab_size") as ei:
        lopa_fast.load_model(d)
    assert ei.value.key == "vocab_size"


def test_memory_estimate_refuses_above_total_and_warns_above_free(tmp_path, monkeypatch):
    from lopa_fast.models import loading

    d, _, _ = _ckpt(tmp_path)
    monkeypatch.setattr(loading, "total_memory", lambda device="cpu": (1000, 500))
    with pytest.raises(MemoryBudgetError, match="GiB") as ei:
        lopa_fast.load_model(d)
    assert ei.value.needed_bytes > ei.value.total_bytes == 1000
    monkeypatch.setattr(loading, "total_memory", lambda device="cpu": (1 << 40, 1000))
    with pytest.warns(RuntimeWarning, match="more than is free"):
        lopa_fast.load_model(d)


def test_a_small_request_reuses_a_recent_memory_reading_and_a_big_one_reads_afresh(monkeypatch):
    import psutil

    from lopa_fast.models import loading

    reads = []
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reads.append(1) or real())
    monkeypatch.setattr(loading, "_last_reading", {})
    _, avail = loading.total_memory("cpu")
    reads.clear()
    small = avail // (4 * loading.READING_REUSE_SHARE)
    for _ in range(3):
        loading.check_memory(small, "cpu", "a small request")
    assert len(reads) == 1  # the first reads, the next two reuse it (well within READING_REUSE_S)
    loading.check_memory(avail // 2, "cpu", "a big request")  # more than 1 / READING_REUSE_SHARE of the free memory
    assert len(reads) == 2
    monkeypatch.setattr(loading, "READING_REUSE_S", 0.0)  # an old reading is never reused
    loading.check_memory(small, "cpu", "a small request")
    assert len(reads) == 3
    monkeypatch.setattr(loading, "READING_REUSE_S", 60.0)
    monkeypatch.setattr(loading, "total_memory", lambda device="cpu": (1000, 500))  # a new reader: read afresh
    with pytest.raises(MemoryBudgetError):
        loading.check_memory(2000, "cpu", "a request")


def test_total_memory_reads_the_machine():
    from lopa_fast.models.loading import total_memory

    total, avail = total_memory("cpu")
    assert 0 < avail <= total


# ---- checkpoint safety ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["ABS", "../outside.safetensors", "sub/../../outside.safetensors"])
def test_index_path_escape_is_refused(tmp_path, bad):
    d, _, _ = _ckpt(tmp_path, shard_size=5)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = str(outside) if bad == "ABS" else bad
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the model directory") as ei:
        lopa_fast.load_model(d)
    assert ei.value.key == name


def test_symlinked_shards_stay_allowed(tmp_path):
    d, model, _ = _ckpt(tmp_path, shard_size=5)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in d.glob("model-*.safetensors"):  # the HF cache layout: snapshot files are symlinks into blobs/
        target = blobs / f.name
        f.rename(target)
        os.symlink(target, f)
    loaded = lopa_fast.load_model(d, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids), model(ids))


def test_corrupt_safetensors_names_the_file(tmp_path):
    d, _, _ = _ckpt(tmp_path)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors") as ei:
        lopa_fast.load_model(d)
    assert ei.value.path.endswith("model.safetensors")
    d2, _, _ = _ckpt(tmp_path, shard_size=5, name="sharded")
    shard = sorted(d2.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=shard.name):
        lopa_fast.load_model(d2)


def test_tied_checkpoint_with_a_different_head_is_untied(tmp_path):
    d, model, hf = _ckpt(tmp_path)  # untied weights, declared tied below
    _edit_config(d, tie_word_embeddings=True)
    with pytest.warns(RuntimeWarning, match="untied"):
        loaded = lopa_fast.load_model(d, dtype=torch.float32)
    assert not loaded.config.tie_word_embeddings
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids), model(ids))
    # an exact copy of the embedding is still dropped silently (some exports carry one)
    state = load_file(str(d / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(d / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tied = lopa_fast.load_model(d, dtype=torch.float32)
    assert tied.config.tie_word_embeddings


def _adapter(tmp_path, model, cfg_extra=None, tensors=None):
    a = tmp_path / "adapter"
    a.mkdir(exist_ok=True)
    acfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **(cfg_extra or {})}
    (a / "adapter_config.json").write_text(json.dumps(acfg))
    if tensors is None:
        W = model.model.layers[0].self_attn.q_proj.weight
        pre = "base_model.model.model.layers.0.self_attn.q_proj"
        tensors = {f"{pre}.lora_A.weight": torch.randn(2, W.shape[1]), f"{pre}.lora_B.weight": torch.randn(W.shape[0], 2)}
    save_file(tensors, str(a / "adapter_model.safetensors"))
    return a


def test_lora_errors(tmp_path):
    d, model, _ = _ckpt(tmp_path)
    lopa_fast.load_model(d, lora=_adapter(tmp_path, model))  # the valid adapter loads
    with pytest.raises(CheckpointError, match="no tensors"):
        lopa_fast.load_model(d, lora=_adapter(tmp_path, model, tensors={}))
    with pytest.raises(ConfigError, match="r=0") as ei:
        lopa_fast.load_model(d, lora=_adapter(tmp_path, model, {"r": 0}))
    assert ei.value.key == "r"
    with pytest.raises(ConfigError, match="lora_alpha='16'"):
        lopa_fast.load_model(d, lora=_adapter(tmp_path, model, {"lora_alpha": "16"}))
    nomatch = {"base_model.model.model.nothing.lora_A.weight": torch.zeros(2, 4),
               "base_model.model.model.nothing.lora_B.weight": torch.zeros(4, 2)}
    with pytest.raises(CheckpointError, match="targets module"):
        lopa_fast.load_model(d, lora=_adapter(tmp_path, model, tensors=nomatch))


def test_fp16_overflow_names_the_tensor(tmp_path):
    d, _, _ = _ckpt(tmp_path)
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = 1e6
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight.*overflows") as ei:
        lopa_fast.load_model(d, dtype=torch.float16)
    assert ei.value.key == "model.layers.1.mlp.up_proj.weight"
    lopa_fast.load_model(d, dtype=torch.bfloat16)  # bf16 holds it


# ---- numerics guard ------------------------------------------------------------------------------------
STRATEGY_KW = {
    "vanilla": dict(steps=8),
    "threshold": dict(threshold=0.9),
    "d2f": {},
    "lopa": dict(branching_factor=2),
}


def _tiny_model(kind="dream"):
    return random_model(tiny_hf_config(kind), seed=1, sharpen=4.0)


@pytest.mark.parametrize("backend", ["reference", "fast"])
@pytest.mark.parametrize("kind", ["dream", "llada"])
@pytest.mark.parametrize("strategy", ["vanilla", "threshold", "d2f", "lopa"])
def test_nan_logits_raise_naming_strategy_round_position(strategy, kind, backend):
    model = _tiny_model(kind)
    with torch.no_grad():
        model.final_norm_weight().fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError, match=strategy) as ei:
        lopa_fast.generate(model, [3, 4, 5], strategy, backend, max_new_tokens=8, block_size=4,
                           **STRATEGY_KW[strategy])
    e = ei.value
    assert e.strategy == strategy and e.round == 1 and e.position >= 3
    # the d2f / lopa rounds flag the row on the device and report "NaN/inf"; the others read the value
    reads_value = backend == "reference" or strategy in ("vanilla", "threshold")
    assert math.isnan(e.value) if reads_value else e.value == "NaN/inf"


@pytest.mark.parametrize("strategy", ["vanilla", "threshold", "d2f", "lopa"])
def test_one_inf_logit_raises(strategy):
    model = _tiny_model()
    with torch.no_grad():
        model.head_weight()[7].fill_(float("inf"))
    with pytest.raises(NonFiniteLogitsError):
        lopa_fast.generate(model, [3, 4, 5], strategy, max_new_tokens=8, block_size=4, **STRATEGY_KW[strategy])


@pytest.mark.parametrize("strategy", ["vanilla", "threshold", "d2f", "lopa"])
def test_sampling_never_reaches_multinomial_with_nan(strategy):
    model = _tiny_model()
    with torch.no_grad():
        model.final_norm_weight().fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError):
        lopa_fast.generate(model, [3, 4, 5], strategy, max_new_tokens=8, block_size=4, temperature=0.7, seed=1,
                           **STRATEGY_KW[strategy])
    # finite logits that a tiny temperature overflows are caught too
    with pytest.raises(NonFiniteLogitsError, match="temperature"):
        lopa_fast.generate(_tiny_model(), [3, 4, 5], strategy, max_new_tokens=8, block_size=4, temperature=1e-44,
                           seed=1, **STRATEGY_KW[strategy])


def test_guard_changes_no_token_on_finite_models():
    model = _tiny_model()
    out = lopa_fast.generate(model, [3, 4, 5], "lopa", max_new_tokens=8, block_size=4, branching_factor=2)
    assert len(out.generated_ids) == 8 and out.stats["forwards"] >= 1


@pytest.mark.parametrize("compile", [False, True])
def test_fast_and_reference_raise_the_same_type_for_nan(compile):
    model = _tiny_model()
    with torch.no_grad():
        model.final_norm_weight().fill_(float("nan"))
    for backend in ("reference", "fast"):
        with pytest.raises(NonFiniteLogitsError) as ei:
            lopa_fast.generate(model, [3, 4, 5], "lopa", backend, max_new_tokens=8, block_size=4, branching_factor=2,
                               **({"compile": compile} if backend == "fast" else {}))
        assert ei.value.strategy == "lopa" and ei.value.position >= 3, (backend, ei.value)


# ---- caps and knobs -----------------------------------------------------------------------------------------
def test_vanilla_steps_above_max_new_tokens_capped_or_refused():
    model = _tiny_model()
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="steps=1000000 exceeds max_new_tokens=8"):
        out = lopa_fast.generate(model, [3, 4, 5], "vanilla", max_new_tokens=8, steps=10**6)
    assert out.stats["forwards"] == 8 and time.perf_counter() - t0 < HANG_GUARD_S
    with pytest.raises(KnobError, match="steps=1000000") as ei:
        lopa_fast.generate(model, [3, 4, 5], "vanilla", max_new_tokens=8, steps=10**6, on_round_cap="error")
    assert ei.value.knob == "steps"


def test_vanilla_warns_when_it_returns_masks():
    model = _tiny_model()
    with torch.no_grad():  # every position predicts the mask id (63)
        model.head_weight().zero_()
        model.head_weight()[63] = 1.0
        model.final_norm_weight().fill_(1.0)
    with pytest.warns(RuntimeWarning, match="still hold the mask id"):
        out = lopa_fast.generate(model, [3, 4, 5], "vanilla", max_new_tokens=4, steps=4, alg="maskgit_plus")
    assert out.stats["masks_left"] > 0


@pytest.mark.parametrize(
    "ids, kw, knob",
    [
        ([3, 4], dict(seed=2**64), "seed"),
        ([3, 2**70], {}, "input_ids"),
        ([3, 4], dict(mask_token_id=2**70), "mask_token_id"),
        ([3, 4], dict(branching_factor=10**30), "branching_factor"),
        ([3, 4], dict(max_new_tokens=10**6, block_size=4), "max_new_tokens"),
        ([3, 4], dict(max_new_tokens=2**40, block_size=4), "max_new_tokens"),
    ],
)
def test_overflowing_knobs_name_the_knob_before_work(ids, kw, knob):
    model = _tiny_model()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=knob):
        lopa_fast.generate(model, ids, "lopa", **kw)
    assert time.perf_counter() - t0 < HANG_GUARD_S


def test_request_memory_estimate_refuses_before_allocating(monkeypatch):
    from lopa_fast.models import loading

    hf = tiny_hf_config("dream", max_position_embeddings=10**7)
    model = random_model(hf, seed=0)
    monkeypatch.setattr(loading, "total_memory", lambda device="cpu": (2**30, 2**30))
    with pytest.raises(MemoryBudgetError, match="max_new_tokens=1000000"):
        lopa_fast.generate(model, [3, 4], "lopa", "fast", max_new_tokens=10**6, block_size=4)
