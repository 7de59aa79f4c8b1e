"""Load HF-format checkpoint directories (config.json + safetensors, optional PEFT LoRA adapter).

Only safetensors are read; pickled `pytorch_model.bin` checkpoints are refused unless the caller opts
in with `allow_pickle=True` (then read with `torch.load(weights_only=True)`). Every tensor's name and
shape is checked against the config before the model is built, so a bad checkpoint fails with one
error naming the file, the tensor, the expected and the actual shape, and nothing is half-loaded.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from lopa_fast.models.config import ModelConfig, parse_config
from lopa_fast.models.llada import LLaDAModel
from lopa_fast.models.qwen2 import Qwen2Model
from lopa_fast.models.transformer import DecoderLM

SUPPORTED_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """A checkpoint directory or adapter that cannot be loaded as asked."""


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"load_model: dtype={dtype!r}; allowed: {sorted(SUPPORTED_DTYPES)}")
        return SUPPORTED_DTYPES[dtype]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"load_model: dtype={dtype}; allowed: torch.float32, torch.float16, torch.bfloat16")
    return dtype


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def build_model(cfg: ModelConfig) -> DecoderLM:
    """An uninitialised model object for a config (weights must be loaded or initialised after)."""
    return LLaDAModel(cfg) if cfg.kind == "llada" else Qwen2Model(cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, exactly as the checkpoint must hold them."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"load_model: {path} is not a directory (expected an HF-format model directory)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"load_model: {cfg_file} is missing")
    gen_file = path / "generation_config.json"
    gen = _read_json(gen_file) if gen_file.is_file() else None
    return parse_config(_read_json(cfg_file), gen, source=str(cfg_file))


def _weight_files(path: Path, allow_pickle: bool) -> tuple[str, dict[str, Path]]:
    """('safetensors' | 'pickle', {tensor_name: file}) for a model directory."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {}
        for name, fname in weight_map.items():
            f = path / fname
            if not f.is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to shard {fname!r}, which is missing")
            files[name] = f
        return "safetensors", files
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return "safetensors", {k: single for k in f.keys()}
    pickles = sorted(path.glob("pytorch_model*.bin"))
    if pickles:
        if not allow_pickle:
            raise CheckpointError(
                f"load_model: {path} has only pickle weights ({pickles[0].name}); lopa_fast reads safetensors. "
                "Convert the checkpoint, or pass allow_pickle=True to read it with torch.load(weights_only=True)."
            )
        return "pickle", {}
    raise CheckpointError(f"load_model: no model.safetensors or model.safetensors.index.json in {path}")


def _read_tensors(path: Path, kind: str, files: dict[str, Path]) -> dict[str, torch.Tensor]:
    if kind == "pickle":
        out = {}
        for f in sorted(path.glob("pytorch_model*.bin")):
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    out = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            present = set(sf.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{f}: the index maps tensor {name!r} to this shard, but it is not there")
                out[name] = sf.get_tensor(name)
    return out


def _check_tensors(tensors: dict, shapes: dict, source: str) -> None:
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise CheckpointError(
            f"{source}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} "
            "(not part of this model_type's architecture)"
        )
    for name, shape in shapes.items():
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {actual}, expected {shape}")
        if not tensors[name].is_floating_point():
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {tensors[name].dtype}, expected a float")


# ---- PEFT LoRA ------------------------------------------------------------------------------------
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def _lora_scale(acfg: dict, module: str) -> float:
    r = acfg.get("r", 8)
    alpha = acfg.get("lora_alpha", r)
    for pattern, value in (acfg.get("rank_pattern") or {}).items():
        if re.search(rf"(^|\.){re.escape(pattern)}$", module) or re.fullmatch(pattern, module):
            r = value
    for pattern, value in (acfg.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){re.escape(pattern)}$", module) or re.fullmatch(pattern, module):
            alpha = value
    return alpha / math.sqrt(r) if acfg.get("use_rslora", False) else alpha / r


def read_lora(adapter_dir: str | os.PathLike) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config, {base module name: (A [r, in], B [out, r])}) of a PEFT LoRA adapter directory."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise CheckpointError(f"lora: {adapter_dir} is not a directory (expected a PEFT adapter directory)")
    cfg_file = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise CheckpointError(f"lora: {cfg_file} is missing")
    acfg = _read_json(cfg_file)
    if acfg.get("peft_type", "LORA").upper() != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type={acfg.get('peft_type')!r}; only 'LORA' adapters are supported")
    if acfg.get("bias", "none") != "none":
        raise CheckpointError(f"{cfg_file}: bias={acfg.get('bias')!r}; only bias='none' adapters are supported")
    if acfg.get("fan_in_fan_out", False):
        raise CheckpointError(f"{cfg_file}: fan_in_fan_out=true is not supported (Conv1D-style weights)")
    if acfg.get("use_dora", False):
        raise CheckpointError(f"{cfg_file}: use_dora=true is not supported")
    if not weights.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            raise CheckpointError(f"lora: {adapter_dir} has only adapter_model.bin (pickle); lopa_fast reads safetensors")
        raise CheckpointError(f"lora: {weights} is missing")
    from safetensors.torch import load_file

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(weights)).items():
        m = _LORA_KEY.match(key)
        if m is None:
            raise CheckpointError(f"{weights}: unexpected tensor {key!r} (expected base_model.model.<module>.lora_A/B.weight)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{weights}: module {module!r} has lora_{list(ab)[0]} but not its pair")
        out[module] = (ab["A"], ab["B"])
    return acfg, out


def merge_lora(tensors: dict[str, torch.Tensor], adapter_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """W += scale * B @ A for every adapted module (computed in fp32); returns a new dict."""
    acfg, pairs = read_lora(adapter_dir)
    merged = dict(tensors)
    for module, (A, B) in pairs.items():
        key = f"{module}.weight"
        if key not in tensors:
            raise CheckpointError(
                f"lora: {adapter_dir} targets module {module!r}, but the model has no tensor {key!r}"
            )
        W = tensors[key]
        if A.shape[1] != W.shape[1] or B.shape[0] != W.shape[0] or A.shape[0] != B.shape[1]:
            raise CheckpointError(
                f"lora: {module}: A {tuple(A.shape)} / B {tuple(B.shape)} do not fit weight {tuple(W.shape)}"
            )
        delta = _lora_scale(acfg, module) * (B.float() @ A.float())
        merged[key] = (W.float() + delta).to(W.dtype)
    return merged


# ---- public --------------------------------------------------------------------------------------
def load_model(
    path: str | os.PathLike,
    dtype=torch.bfloat16,
    device="cpu",
    lora: str | os.PathLike | None = None,
    allow_pickle: bool = False,
) -> DecoderLM:
    """Load an HF-format model directory.

    path:   directory with config.json (model_type Dream / qwen2 / llada) and model.safetensors or a
            sharded model.safetensors.index.json; optional generation_config.json for special ids.
    dtype:  torch.float32 | torch.float16 | torch.bfloat16 (or their names).
    lora:   optional PEFT LoRA adapter directory, merged once at load (W += alpha/r * B @ A).
    Returns a model in eval mode with `mask_token_id`, `eos_token_id`, `pad_token_id`, `bos_token_id`.
    """
    dtype = _resolve_dtype(dtype)
    path = Path(path)
    cfg = read_config(path)
    kind, files = _weight_files(path, allow_pickle)
    tensors = _read_tensors(path, kind, files)
    shapes = expected_shapes(cfg)
    # Tied-embedding checkpoints may still carry an lm_head copy (some exports do): drop only an exact tie.
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors and "lm_head.weight" not in shapes:
        tensors.pop("lm_head.weight")
    _check_tensors(tensors, shapes, str(path))
    if lora is not None:
        tensors = merge_lora(tensors, lora)
    with torch.device("meta"):
        model = build_model(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, assign=True, strict=True)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    model.name_or_path = str(path)
    return model


def save_checkpoint(model: DecoderLM, path: str | os.PathLike, config: dict, shard_size: int | None = None) -> None:
    """Write `model` as an HF-format directory: config.json + model.safetensors (or shards + index).

    config: the config.json dict to write (the caller's HF config; it must describe `model`).
    shard_size: max tensors per shard; None = one file.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    if shard_size is None:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    shards = [names[i : i + shard_size] for i in range(0, len(names), shard_size)]
    weight_map = {}
    for i, chunk in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k] for k in chunk}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in chunk})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a model directory (transformers' fast tokenizer over tokenizer.json), with the
    chat template when tokenizer_config.json or chat_template.jinja has one. No network, no remote code."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"load_tokenizer: {path / 'tokenizer.json'} is missing")
    from transformers import PreTrainedTokenizerFast

    tcfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    kwargs = {
        k: tcfg[k]
        for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")
        if isinstance(tcfg.get(k), str)
    }
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **kwargs)
    template = tcfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is not None:
        tok.chat_template = template
    return tok
