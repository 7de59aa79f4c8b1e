"""Load HF-format checkpoint directories (config.json + safetensors, optional PEFT LoRA adapter).

Only safetensors are read; pickled `pytorch_model.bin` checkpoints are refused unless the caller opts
in with `allow_pickle=True` (then read with `torch.load(weights_only=True)`). Every tensor's name and
shape is checked against the config before the model is built, so a bad checkpoint fails with one
error naming the file, the tensor, the expected and the actual shape, and nothing is half-loaded.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from pathlib import Path

import torch

from lopa_fast import logs
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


from lopa_fast.errors import CheckpointError, ConfigError, MemoryBudgetError  # noqa: E402  (CheckpointError re-exported)

log = logging.getLogger(__name__)
LONG_LOAD_BYTES = 256 * 2**20  # weights from this size on take seconds to read: the load is said at INFO


def default_dtype(device) -> torch.dtype:
    """The weights' dtype when none is named, on every surface (load_model, the CLI, the server, lm-eval):
    bfloat16 on CUDA (decoding is memory-bound there: half the bytes per weight pass), float32 elsewhere (a CPU
    has no fast bfloat16 matmul: 0.48-0.6 s vs 0.05-0.1 s per generate on the embedded model, measured)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


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
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})", file=path) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})", file=path) from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply", file=path) from None


def build_model(cfg: ModelConfig) -> DecoderLM:
    """An uninitialised model object for a config (weights must be loaded or initialised after)."""
    return LLaDAModel(cfg) if cfg.kind == "llada" else Qwen2Model(cfg)


@contextlib.contextmanager
def _no_parameter_init():
    """nn.Linear / nn.Embedding built without their random init (the checkpoint's tensors replace every parameter
    at once). On the meta device the init does no work, but its first call imports torch._dynamo through the meta
    kernels' decorators: 1.5 s of every CLI start (measured with -X importtime), for nothing."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, exactly as the checkpoint must hold them (computed from the config: no model
    skeleton is built, so a config with a million layers costs nothing before it is refused)."""
    H, V, I, D = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    out: dict[str, tuple[int, ...]] = {}
    if cfg.kind == "llada":
        pre = "model.transformer."
        out[pre + "wte.weight"] = (V, H)
        names = {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "attn_out": (H, q), "ff_proj": (I, H),
                 "up_proj": (I, H), "ff_out": (H, I), "attn_norm": (H,), "ff_norm": (H,)}  # fmt: skip
        bias = cfg.qkv_bias
        layer = pre + "blocks.{}."
        tail = {pre + "ln_f.weight": (H,)}
        head = pre + "ff_out.weight"
    else:
        out["model.embed_tokens.weight"] = (V, H)
        names = {"input_layernorm": (H,), "self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H),
                 "self_attn.v_proj": (kv, H), "self_attn.o_proj": (H, q), "post_attention_layernorm": (H,),
                 "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}  # fmt: skip
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


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
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
                                              path=f, key=name)  # fmt: skip
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


def total_memory(device="cpu") -> tuple[int, int]:
    """(total, available) bytes of the device's memory. CUDA: torch.cuda.mem_get_info. CPU: psutil's
    virtual_memory (total, available), lowered to the cgroup's limit when one is set (psutil does not read cgroups:
    v2 memory.max / memory.current, v1 memory.limit_in_bytes / memory.usage_in_bytes are read here) and to the room
    left under an address-space limit (RLIMIT_AS: `address_space_room`)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(total), int(free)
    try:
        import psutil

        vm = psutil.virtual_memory()
        total, avail = int(vm.total), int(vm.available)
    except (ImportError, OSError, RuntimeError):  # no psutil: the page counts POSIX gives
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total, avail = page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 1 << 62, 1 << 62
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < total:
            total = int(raw)
            try:
                avail = min(avail, total - int(Path(usage_file).read_text().strip()))
            except (OSError, ValueError):
                avail = min(avail, total)
        break
    room = address_space_room()
    if room is not None:  # an address-space cap (ulimit -v): what this process may still map
        total, avail = min(total, room), min(avail, room)
    return int(total), int(avail)


def address_space_room() -> int | None:
    """Bytes this process may still map under its address-space limit (RLIMIT_AS, `ulimit -v`): the soft limit
    minus the virtual size now; None when there is no such limit. Under a cap every allocation fails past it even
    with physical memory free, so the budget has to fit under it (issue 36: a budget sized from RAM alone let one
    batch fail with "can't allocate memory")."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    try:
        import psutil

        vms = psutil.Process().memory_info().vms
    except (ImportError, OSError, RuntimeError):
        try:
            with open("/proc/self/statm") as f:
                vms = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    return max(0, int(soft) - int(vms))


def check_memory(needed: int, device, what: str) -> None:
    """Refuse (MemoryBudgetError) when `needed` bytes exceed the device's total memory; warn above what is free."""
    total, avail = total_memory(device)
    gib = 2**30
    if needed > total:
        raise MemoryBudgetError(
            f"{what} needs about {needed / gib:.2f} GiB, more than the {torch.device(device).type} memory of this "
            f"machine ({total / gib:.2f} GiB, cgroup limits included)", needed_bytes=needed, total_bytes=total, what=what)
    if needed > avail:
        import warnings

        warnings.warn(f"{what} needs about {needed / gib:.2f} GiB, more than is free now ({avail / gib:.2f} GiB)",
                      RuntimeWarning, stacklevel=3)  # fmt: skip


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
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object", path=index, key="weight_map")
        files = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or not fname or "\x00" in fname:
                raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}; expected a shard file name",
                                      path=index, key=name)  # fmt: skip
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


def _read_tensors(path: Path, kind: str, files: dict[str, Path]) -> dict[str, torch.Tensor]:
    if kind == "pickle":
        out = {}
        for f in sorted(path.glob("pytorch_model*.bin")):
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    return _map_shards(files, lambda sf, name: sf.get_tensor(name), "reading tensors failed", bar="shards")


_LAYER_INDEX = re.compile(r"\.(?:layers|blocks)\.(\d+)\.")


def _check_against_headers(cfg: ModelConfig, headers: dict, cfg_file: Path) -> None:
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
        t = tensors[name]
        if isinstance(t, tuple):  # (shape, dtype) from a safetensors header
            actual, floating = tuple(t[0]), t[1] in _FLOAT_DTYPES
        else:
            actual, floating = tuple(t.shape), t.is_floating_point()
        if actual != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {actual}, expected {shape}", path=source, key=name)
        if not floating:
            dt = t[1] if isinstance(t, tuple) else t.dtype
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {dt}, expected a float", path=source, key=name)


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
    acfg = _read_json(cfg_file)
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
            raise CheckpointError(f"lora: {adapter_dir} has only adapter_model.bin (pickle); lopa_fast reads safetensors")
        raise CheckpointError(f"lora: {weights} is missing")
    _check_lora_numbers(acfg, cfg_file)
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights))
    except Exception as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({type(e).__name__}: {e})", path=weights) from e
    if not state:
        raise CheckpointError(f"lora: {weights} holds no tensors (an empty adapter would load as a no-op)", path=weights)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
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
    dtype=None,
    device="cpu",
    lora: str | os.PathLike | None = None,
    allow_pickle: bool = False,
) -> DecoderLM:
    """Load an HF-format model directory.

    path:   directory with config.json (model_type Dream / qwen2 / llada) and model.safetensors or a
            sharded model.safetensors.index.json; optional generation_config.json for special ids.
    dtype:  torch.float32 | torch.float16 | torch.bfloat16 (or their names); default `default_dtype(device)`:
            bfloat16 on CUDA, float32 on CPU.
    lora:   optional PEFT LoRA adapter directory, merged once at load (W += alpha/r * B @ A).
    Returns a model in eval mode with `mask_token_id`, `eos_token_id`, `pad_token_id`, `bos_token_id`.
    """
    dtype = default_dtype(device) if dtype is None else _resolve_dtype(dtype)
    path = Path(path)
    cfg = read_config(path)
    cfg_file = path / "config.json"
    kind, files = _weight_files(path, allow_pickle)
    if kind == "pickle":
        tensors = _read_tensors(path, kind, files)
        headers = {k: (tuple(v.shape), "F32" if v.is_floating_point() else "I64") for k, v in tensors.items()}
    else:
        tensors, headers = None, read_headers(files)  # names, shapes, dtypes: nothing is read yet
    _check_against_headers(cfg, headers, cfg_file)  # layer count / embedding first: no skeleton before this
    emb_name, head_name = head_names(cfg)
    untie = cfg.tie_word_embeddings and head_name in headers
    if untie:  # a separate head next to a tied embedding: loaded (untied) unless it is an exact copy
        from safetensors import safe_open

        if tensors is None:
            pair = {}
            for n in (emb_name, head_name):
                with safe_open(str(files[n]), framework="pt") as sf:
                    pair[n] = sf.get_tensor(n)
        else:
            pair = tensors
        if tuple(pair[head_name].shape) == tuple(pair[emb_name].shape) and torch.equal(pair[head_name], pair[emb_name]):
            untie = False
            headers = {k: v for k, v in headers.items() if k != head_name}
            files = {k: v for k, v in files.items() if k != head_name}
            if tensors is not None:
                tensors.pop(head_name)
        else:
            import dataclasses
            import warnings

            warnings.warn(
                f"{cfg_file}: tie_word_embeddings is set but the checkpoint's {head_name!r} differs from the "
                f"embedding {emb_name!r}; loading it as a separate (untied) head", RuntimeWarning, stacklevel=2)
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    shapes = expected_shapes(cfg)
    _check_tensors(headers, shapes, str(path))
    needed = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
    check_memory(needed, device, f"load_model({path}): the weights in {dtype}")
    what = (f"loading {path} ({needed / 2**30:.2f} GiB in {str(dtype).removeprefix('torch.')} to {device}"
            + (f", LoRA {lora} merged" if lora is not None else "") + ")")
    with logs.step(log, what, f"loaded {path.name}", long=needed >= LONG_LOAD_BYTES):
        if tensors is None:
            tensors = _read_tensors(path, kind, files)
        if lora is not None:
            tensors = merge_lora(tensors, lora)
        cast = {}
        # a tensor read from a safetensors file is a view of its memory map; on the CPU with no cast it would stay
        # one, so the loaded model would change (or the process die of SIGBUS) when the file is overwritten or
        # truncated under it: such tensors are copied into memory the process owns
        on_cpu = torch.device(device).type == "cpu"
        for k, v in tensors.items():
            c = v.to(dtype)
            if on_cpu and kind != "pickle" and c.data_ptr() == v.data_ptr():
                c = c.clone()
            if c.dtype != v.dtype and bool(torch.isinf(c).any()) and not bool(torch.isinf(v).any()):
                big = float(v.float().abs().max())
                raise CheckpointError(
                    f"{path}: tensor {k!r} overflows {dtype} (max |w| = {big:.4g} > {torch.finfo(dtype).max:.4g}); "
                    "load it in a wider dtype (torch.float32 or torch.bfloat16)", path=path, key=k)
            cast[k] = c
        with torch.device("meta"), _no_parameter_init():
            model = build_model(cfg)
        model.load_state_dict(cast, assign=True, strict=True)
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
    # the fast path's merged q/k/v and gate/up tensors make those parameters views of one storage, which
    # safetensors refuses to write as separate tensors: give each such view its own copy (only those)
    seen: dict[int, int] = {}
    for v in state.values():
        seen[v.untyped_storage().data_ptr()] = seen.get(v.untyped_storage().data_ptr(), 0) + 1
    state = {k: v.clone() if seen[v.untyped_storage().data_ptr()] > 1 else v for k, v in state.items()}
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
    try:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **kwargs)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"load_tokenizer: {path / 'tokenizer.json'} is not a tokenizer file the tokenizers "
                              f"library can read ({first}); a truncated or garbled copy?",
                              path=path / "tokenizer.json") from e  # fmt: skip
    template = tcfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is not None:
        tok.chat_template = template
    return tok
