"""PEFT LoRA adapters: read an adapter directory (adapter_config.json + adapter_model.safetensors) and merge it into
a checkpoint's tensors once at load (W += scale * B @ A)."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch

from lopa_fast.errors import CheckpointError, ConfigError
from lopa_fast.models.checkpoint import read_json

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


def _check_lora_numbers(acfg: dict, cfg_file: Path) -> None:
    """r / lora_alpha (and their per-module patterns) are positive numbers: r an int >= 1, alpha finite."""
    def bad(key, value, allowed):
        raise ConfigError(f"{cfg_file}: {key}={value!r}; allowed: {allowed}", file=cfg_file, key=key, value=value)

    def check_r(key, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            bad(key, v, "an int >= 1 (the LoRA rank)")

    def check_alpha(key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            bad(key, v, "a finite number")

    check_r("r", acfg.get("r", 8))
    if "lora_alpha" in acfg:
        check_alpha("lora_alpha", acfg["lora_alpha"])
    for key, check in (("rank_pattern", check_r), ("alpha_pattern", check_alpha)):
        pat = acfg.get(key) or {}
        if not isinstance(pat, dict):
            bad(key, pat, "an object {module pattern: value}")
        for k, v in pat.items():
            check(f"{key}[{k!r}]", v)


def read_lora(adapter_dir: str | os.PathLike) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config, {base module name: (A [r, in], B [out, r])}) of a PEFT LoRA adapter directory."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise CheckpointError(f"lora: {adapter_dir} is not a directory (expected a PEFT adapter directory)")
    cfg_file = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise CheckpointError(f"lora: {cfg_file} is missing")
    acfg = read_json(cfg_file)
    if not isinstance(acfg, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object", file=cfg_file)
    if str(acfg.get("peft_type", "LORA")).upper() != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type={acfg.get('peft_type')!r}; only 'LORA' adapters are supported")
    if acfg.get("bias", "none") != "none":
        raise CheckpointError(f"{cfg_file}: bias={acfg.get('bias')!r}; only bias='none' adapters are supported")
    if acfg.get("fan_in_fan_out", False):
        raise CheckpointError(f"{cfg_file}: fan_in_fan_out=true is not supported (Conv1D-style weights)")
    if acfg.get("use_dora", False):
        raise CheckpointError(f"{cfg_file}: use_dora=true is not supported")
    if not weights.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            raise CheckpointError(f"lora: {adapter_dir} has only adapter_model.bin (pickle); lopa_fast reads "
                                  "safetensors")
        raise CheckpointError(f"lora: {weights} is missing")
    _check_lora_numbers(acfg, cfg_file)
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights))
    except Exception as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({type(e).__name__}: {e})",
                              path=weights) from e
    if not state:
        raise CheckpointError(f"lora: {weights} holds no tensors (an empty adapter would load as a no-op)",
                              path=weights)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = _LORA_KEY.match(key)
        if m is None:
            raise CheckpointError(f"{weights}: unexpected tensor {key!r} (expected "
                                  "base_model.model.<module>.lora_A/B.weight)")
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
