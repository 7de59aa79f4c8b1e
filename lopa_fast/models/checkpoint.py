"""Reading an HF-format checkpoint directory: config.json (+ generation_config.json), the safetensors weight files
(one file or shards + index; pickles only when asked) and their headers, and the checks of every tensor's name,
shape and dtype against the config before anything is built (the layout a family's checkpoint must have:
`expected_shapes`, `head_names`). A bad checkpoint fails with one error naming the file, the tensor, the expected
and the actual shape."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from lopa_fast import logs
from lopa_fast.errors import CheckpointError, ConfigError
from lopa_fast.models.config import ModelConfig, parse_config

log = logging.getLogger(__name__)


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})", file=path) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})", file=path) from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply", file=path) from None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, exactly as the checkpoint must hold them (computed from the config: no model
    skeleton is built, so a config with a million layers costs nothing before it is refused)."""
    H, V, I, D = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741 (I: MLP width)
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    out: dict[str, tuple[int, ...]] = {}
    if cfg.kind == "llada":
        pre = "model.transformer."
        out[pre + "wte.weight"] = (V, H)
        names = {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "attn_out": (H, q), "ff_proj": (I, H),
                 "up_proj": (I, H), "ff_out": (H, I), "attn_norm": (H,), "ff_norm": (H,)}
        bias = cfg.qkv_bias
        layer = pre + "blocks.{}."
        tail = {pre + "ln_f.weight": (H,)}
        head = pre + "ff_out.weight"
    else:
        out["model.embed_tokens.weight"] = (V, H)
        names = {"input_layernorm": (H,), "self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H),
                 "self_attn.v_proj": (kv, H), "self_attn.o_proj": (H, q), "post_attention_layernorm": (H,),
                 "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}
        bias = True
        layer = "model.layers.{}."
        tail = {"model.norm.weight": (H,)}
        head = "lm_head.weight"
    for i in range(cfg.num_layers):
        p = layer.format(i)
        for n, shape in names.items():
            out[p + n + ".weight"] = shape
            if bias and n.split(".")[-1] in ("q_proj", "k_proj", "v_proj"):
                out[p + n + ".bias"] = shape[:1]
    out.update(tail)
    if not cfg.tie_word_embeddings:
        out[head] = (V, H)
    return out


def head_names(cfg: ModelConfig) -> tuple[str, str]:
    """(embedding tensor name, separate head tensor name) of a family."""
    if cfg.kind == "llada":
        return "model.transformer.wte.weight", "model.transformer.ff_out.weight"
    return "model.embed_tokens.weight", "lm_head.weight"


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _map_shards(files: dict[str, Path], read, what: str, bar: str | None = None) -> dict:
    """{tensor: read(safe_open handle, name)} over the shards `files` maps the tensors to, each shard opened
    once. A tensor missing from its shard, or any safetensors error, is a CheckpointError naming the file.
    `bar`: a progress bar of that name over the shards (several shards only; lopa_fast.logs.progress)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    out = {}
    shards = by_file.items()
    if bar is not None and len(by_file) > 1:
        shards = logs.progress(shards, log, bar, total=len(by_file))
    for f, names in shards:
        try:
            with safe_open(str(f), framework="pt") as sf:
                present = set(sf.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{f}: the index maps tensor {name!r} to this shard, but it is not there",
                                              path=f, key=name)
                    out[name] = read(sf, name)
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError, OSError, ...: name the file
            raise CheckpointError(f"{f}: {what} ({type(e).__name__}: {e})", path=f) from e
    return out


def _shape_and_dtype(sf, name: str) -> tuple[tuple[int, ...], str]:
    sl = sf.get_slice(name)
    return tuple(sl.get_shape()), str(sl.get_dtype())


def read_headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor: (shape, safetensors dtype)} from the headers of the weight files (no tensor is read).
    Any safetensors error is re-raised as CheckpointError naming the file."""
    return _map_shards(files, _shape_and_dtype, "not a readable safetensors file")


def hub_id_hint(path) -> str:
    """"; ... does not fetch hub ids ..." when a missing `path` reads as a Hugging Face hub id ("org/name": relative,
    two parts, its first not a local directory), else ""."""
    p = Path(path)
    if p.is_absolute() or len(p.parts) != 2 or str(p).startswith(".") or p.parent.exists():
        return ""
    return (f"; {p} looks like a Hugging Face hub id, and lopa_fast does not fetch hub ids: download it first "
            f"(huggingface-cli download {p} --local-dir DIR) and pass DIR")


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"load_model: {path} is not a directory (expected an HF-format model directory)"
                              + hub_id_hint(path))
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"load_model: {cfg_file} is missing")
    gen_file = path / "generation_config.json"
    gen = read_json(gen_file) if gen_file.is_file() else None
    return parse_config(read_json(cfg_file), gen, source=str(cfg_file))


def weight_files(path: Path, allow_pickle: bool) -> tuple[str, dict[str, Path]]:
    """('safetensors' | 'pickle', {tensor_name: file}) for a model directory."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object", path=index, key="weight_map")
        files = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or not fname or "\x00" in fname:
                raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}; expected a shard file name",
                                      path=index, key=name)
            parts = Path(fname).parts
            if Path(fname).is_absolute() or os.path.isabs(fname) or ".." in parts or "\\" in fname:
                raise CheckpointError(
                    f"{index}: tensor {name!r} maps to shard {fname!r}, outside the model directory "
                    "(shard names must be relative, without '..')", path=index, key=name)
            f = path / fname
            # the lexical check above is the rule; a shard that is a symlink (HF cache layout: blobs/) is allowed
            if not f.is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to shard {fname!r}, which is missing")
            files[name] = f
        return "safetensors", files
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return "safetensors", {k: single for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"{single}: not a readable safetensors file ({type(e).__name__}: {e})",
                                  path=single) from e
    pickles = sorted(path.glob("pytorch_model*.bin"))
    if pickles:
        if not allow_pickle:
            raise CheckpointError(
                f"load_model: {path} has only pickle weights ({pickles[0].name}); lopa_fast reads safetensors. "
                "Convert the checkpoint, or pass allow_pickle=True to read it with torch.load(weights_only=True)."
            )
        return "pickle", {}
    raise CheckpointError(f"load_model: no model.safetensors or model.safetensors.index.json in {path}")


def read_tensors(path: Path, kind: str, files: dict[str, Path]) -> dict[str, torch.Tensor]:
    if kind == "pickle":
        out = {}
        for f in sorted(path.glob("pytorch_model*.bin")):
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    return _map_shards(files, lambda sf, name: sf.get_tensor(name), "reading tensors failed", bar="shards")


_LAYER_INDEX = re.compile(r"\.(?:layers|blocks)\.(\d+)\.")


def check_against_headers(cfg: ModelConfig, headers: dict, cfg_file: Path) -> None:
    """The config's layer count, vocabulary and hidden size against the weight headers, before any shape table
    or skeleton is built from them (a config claiming a million layers fails here, in microseconds)."""
    seen = {int(m.group(1)) for k in headers for m in [_LAYER_INDEX.search(k)] if m}
    layers_key = "n_layers" if cfg.kind == "llada" else "num_hidden_layers"
    n = max(seen) + 1 if seen else 0
    if n != cfg.num_layers:
        raise ConfigError(
            f"{cfg_file}: {layers_key}={cfg.num_layers}, but the weight files hold {n} layer(s)",
            file=cfg_file, key=layers_key, value=cfg.num_layers)
    emb_name, _ = head_names(cfg)
    if emb_name in headers:
        shape = headers[emb_name][0]
        want = (cfg.vocab_size, cfg.hidden_size)
        if tuple(shape) != want:
            key = ("embedding_size/vocab_size", "d_model") if cfg.kind == "llada" else ("vocab_size", "hidden_size")
            bad = key[0] if len(shape) != 2 or shape[0] != want[0] else key[1]
            raise ConfigError(
                f"{cfg_file}: {bad} disagrees with the weights: {emb_name!r} has shape {tuple(shape)}, "
                f"the config implies {want}", file=cfg_file, key=bad)


def check_tensors(tensors: dict, shapes: dict, source: str) -> None:
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
        t = tensors[name]
        if isinstance(t, tuple):  # (shape, dtype) from a safetensors header
            actual, floating = tuple(t[0]), t[1] in _FLOAT_DTYPES
        else:
            actual, floating = tuple(t.shape), t.is_floating_point()
        if actual != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {actual}, expected {shape}", path=source,
                                  key=name)
        if not floating:
            dt = t[1] if isinstance(t, tuple) else t.dtype
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {dt}, expected a float", path=source, key=name)
