"""Load HF-format checkpoint directories (config.json + safetensors, optional PEFT LoRA adapter).

Only safetensors are read; pickled `pytorch_model.bin` checkpoints are refused unless the caller opts
in with `allow_pickle=True` (then read with `torch.load(weights_only=True)`). Every tensor's name and
shape is checked against the config before the model is built, so a bad checkpoint fails with one
error naming the file, the tensor, the expected and the actual shape, and nothing is half-loaded.

Here: the dtype, building the model, the memory check before any tensor is read, `load_model` (the one entry point),
`save_checkpoint` and `load_tokenizer`. Reading the directory and its checks: lopa_fast/models/checkpoint.py; PEFT
LoRA adapters: lopa_fast/models/lora.py.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from lopa_fast import logs
from lopa_fast.errors import CheckpointError, MemoryBudgetError
from lopa_fast.models.checkpoint import (
    check_against_headers,
    check_tensors,
    expected_shapes,
    head_names,
    read_config,
    read_headers,
    read_json,
    read_tensors,
    weight_files,
)
from lopa_fast.models.config import ModelConfig
from lopa_fast.models.llada import LLaDAModel
from lopa_fast.models.lora import merge_lora
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


def total_memory(device="cpu") -> tuple[int, int]:
    """(total, available) bytes of the device's memory. CUDA: torch.cuda.mem_get_info. CPU: psutil's
    virtual_memory (total, available), lowered to the cgroup's limit when one is set (psutil does not read cgroups:
    v2 memory.max / memory.current, v1 memory.limit_in_bytes / memory.usage_in_bytes are read here) and to the room
    left under an address-space limit (RLIMIT_AS: `address_space_room`)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(total), int(free)
    import psutil

    vm = psutil.virtual_memory()
    total, avail = int(vm.total), int(vm.available)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
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
    import psutil

    return max(0, int(soft) - int(psutil.Process().memory_info().vms))


# A reading of the machine's memory costs ~130 us on CPU (psutil's /proc/meminfo parse plus the cgroup files: ~1.5 %
# of a tiny model's whole request), so a small request may reuse a recent one: younger than READING_REUSE_S and with
# the request needing at most 1 / READING_REUSE_SHARE of what was free then. For such a request to be judged wrongly,
# free memory would have to fall by 15/16 within a quarter second; and any check races the allocation that follows it
# anyway. Bigger requests, and the server's budget, always read afresh.
READING_REUSE_S = 0.25
READING_REUSE_SHARE = 16
_last_reading: dict = {}  # str(device) -> (the total_memory function that read it, time.monotonic(), total, avail)


def _memory_for(needed: int, device) -> tuple[int, int]:
    """total_memory(device), or its last reading when that is recent and `needed` small against it (above)."""
    key, now = str(device), time.monotonic()
    last = _last_reading.get(key)
    # (the function's identity: a reading of a replaced total_memory, e.g. a test's stand-in, is never reused)
    if last is not None and last[0] is total_memory and now - last[1] < READING_REUSE_S \
            and needed * READING_REUSE_SHARE <= last[3]:
        return last[2], last[3]
    total, avail = total_memory(device)
    _last_reading[key] = (total_memory, now, total, avail)
    return total, avail


def check_memory(needed: int, device, what: str) -> None:
    """Refuse (MemoryBudgetError) when `needed` bytes exceed the device's total memory; warn above what is free.
    A small request may be judged on a reading up to READING_REUSE_S old (`_memory_for`)."""
    total, avail = _memory_for(needed, device)
    gib = 2**30
    if needed > total:
        raise MemoryBudgetError(
            f"{what} needs about {needed / gib:.2f} GiB, more than the {torch.device(device).type} memory of this "
            f"machine ({total / gib:.2f} GiB, cgroup limits included)", needed_bytes=needed, total_bytes=total,
            what=what)
    if needed > avail:
        import warnings

        warnings.warn(f"{what} needs about {needed / gib:.2f} GiB, more than is free now ({avail / gib:.2f} GiB)",
                      RuntimeWarning, stacklevel=3)


def check_device(device) -> None:
    """A device this torch can place the model on, else ValueError naming it and why (a CUDA device on a CPU-only
    torch build or without a visible GPU: said in one line, not torch's bare AssertionError)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load_model: device={device!r} is not a torch device ({e}); allowed: 'cpu', 'cuda', "
                         "'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"load_model: device={device!r} asks for CUDA, but {why} (torch {torch.__version__}); "
                         "pass device='cpu'")


def load_model(
    path: str | os.PathLike,
    dtype=None,
    device="cpu",
    lora: str | os.PathLike | None = None,
    allow_pickle: bool = False,
    torch_dtype=None,
) -> DecoderLM:
    """Load an HF-format model directory.

    path:   directory with config.json (model_type Dream / qwen2 / llada) and model.safetensors or a
            sharded model.safetensors.index.json; optional generation_config.json for special ids.
    dtype:  torch.float32 | torch.float16 | torch.bfloat16 (or their names); default `default_dtype(device)`:
            bfloat16 on CUDA, float32 on CPU.
    lora:   optional PEFT LoRA adapter directory, merged once at load (W += alpha/r * B @ A).
    torch_dtype: transformers' name for dtype (accepted the same; both given: ValueError).
    Returns a model in eval mode with `mask_token_id`, `eos_token_id`, `pad_token_id`, `bos_token_id`.
    """
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError(f"load_model: dtype={dtype!r} and torch_dtype={torch_dtype!r} both given; pass one")
        dtype = torch_dtype
    check_device(device)
    dtype = default_dtype(device) if dtype is None else _resolve_dtype(dtype)
    path = Path(path)
    cfg = read_config(path)
    cfg_file = path / "config.json"
    kind, files = weight_files(path, allow_pickle)
    if kind == "pickle":
        tensors = read_tensors(path, kind, files)
        headers = {k: (tuple(v.shape), "F32" if v.is_floating_point() else "I64") for k, v in tensors.items()}
    else:
        tensors, headers = None, read_headers(files)  # names, shapes, dtypes: nothing is read yet
    check_against_headers(cfg, headers, cfg_file)  # layer count / embedding first: no skeleton before this
    emb_name, head_name = head_names(cfg)
    untie = cfg.tie_word_embeddings and head_name in headers
    if untie:  # a separate head next to a tied embedding: loaded (untied) unless it is an exact copy
        wanted = {n: files[n] for n in (emb_name, head_name)}
        pair = tensors if tensors is not None else read_tensors(path, kind, wanted)
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
    check_tensors(headers, shapes, str(path))
    needed = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
    check_memory(needed, device, f"load_model({path}): the weights in {dtype}")
    what = (f"loading {path} ({needed / 2**30:.2f} GiB in {str(dtype).removeprefix('torch.')} to {device}"
            + (f", LoRA {lora} merged" if lora is not None else "") + ")")
    with logs.step(log, what, f"loaded {path.name}", long=needed >= LONG_LOAD_BYTES):
        if tensors is None:
            tensors = read_tensors(path, kind, files)
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
    seen = collections.Counter(v.untyped_storage().data_ptr() for v in state.values())
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

    tcfg = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
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
                              path=path / "tokenizer.json") from e
    template = tcfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is not None:
        tok.chat_template = template
    return tok
