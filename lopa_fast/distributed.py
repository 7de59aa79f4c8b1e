"""Branch parallelism across processes (torch.distributed): the runtime of a distributed request.

`generate(..., backend="fast", distributed=True)` inside an initialised process group (gloo on CPU, NCCL on
GPUs: one rank per device, the model on cuda:LOCAL_RANK) decodes ONE request with every rank of the group: the
round's branch slots split over the ranks, the token statistics of the needed LM-head rows exchanged
(lopa_fast.strategies.lopa.distributed: the round, its messages and its driver factory `driver`). This module is the
runtime around it, and imports no strategy: the process group (`check_group`, `init_from_env`), the counted
collectives (`Comm`) and the request fingerprint every rank must share (`weights_fingerprint`,
`request_fingerprint`).

Faults (every one a DistributedError on every rank; a dead peer's wait bounded by the group's timeout:
LOPA_FAST_DIST_TIMEOUT_S under `init_from_env`) and what each rank returns (the same GenerateOutput, plus
stats["distributed"]): docs/distributed.md.
"""
from __future__ import annotations

import datetime
import os
import zlib

import torch
import torch.distributed as dist

from lopa_fast.errors import DistributedError, KnobError

# the collective timeout of a group started by init_from_env: a dead peer is reported after at most this long
# (a peer that raises is reported at once, through the error flag of the round's all_gather)
DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "LOPA_FAST_DIST_TIMEOUT_S"

def check_group() -> None:
    """Refuse (KnobError on knob "distributed") a distributed request without an initialised process group (the
    knobs distributed=True needs are checked by GenerateConfig.validate, from the strategy's spec)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise KnobError(
            "distributed=True needs an initialised torch.distributed process group (launch with "
            "`python -m torch.distributed.run --nproc-per-node N ...` and call "
            "torch.distributed.init_process_group, or lopa_fast.distributed.init_from_env()); none is initialised",
            knob="distributed", value=True,
        )


def init_from_env(device: str | None = None) -> str:
    """Start the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) with a
    bounded timeout (LOPA_FAST_DIST_TIMEOUT_S seconds, default DEFAULT_TIMEOUT_S). NCCL when `device` is CUDA
    (or None and CUDA is available): this rank's device becomes cuda:LOCAL_RANK; else gloo on the CPU.
    Returns the device string the model must be loaded on. KnobError without torchrun's environment."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise KnobError(f"--distributed needs torchrun's environment ({', '.join(missing)} unset); launch with "
                        "`python -m torch.distributed.run --nproc-per-node N -m lopa_fast generate ... --distributed`",
                        knob="distributed", value=True)
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= 24 * 3600:
        raise KnobError(f"{TIMEOUT_ENV}={raw!r}; allowed: seconds in (0, 86400]", knob=TIMEOUT_ENV, value=raw)
    cuda = device.startswith("cuda") if device is not None else torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = device or "cpu"
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # rendezvous failure / timeout: one clear error, not a backend traceback
            raise DistributedError(f"distributed decoding: could not start the process group: "
                                   f"{' '.join(str(e).split())[:300]}") from e
    return device

class Comm:
    """The collectives of one request on `group`, each counted. Bytes are logical payload traffic: an
    all_gather of c bytes per rank delivers world * (world - 1) * c bytes, a broadcast of b bytes
    (world - 1) * b (whatever tree or ring the backend uses underneath)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.calls = {"all_gather": 0, "broadcast": 0, "all_gather_object": 0}
        self.bytes = {"stats": 0, "kv": 0, "setup": 0}  # delivered bytes, all ranks together

    def _run(self, what: str, fn, round_: int):
        try:
            return fn()
        except Exception as e:  # a dead peer (connection closed) or the group's timeout
            raise DistributedError(
                f"distributed decoding: {what} failed in round {round_} on rank {self.rank} of {self.world} "
                f"(a peer died or timed out): {' '.join(str(e).split())[:300]}", round=round_,
            ) from e

    def all_gather(self, t: torch.Tensor, kind: str, round_: int) -> torch.Tensor:
        """[world, *t.shape]: every rank's t."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._run("all_gather", lambda: dist.all_gather(parts, t, group=self.group), round_)
        self.calls["all_gather"] += 1
        self.bytes[kind] += self.world * (self.world - 1) * t.numel() * t.element_size()
        return torch.stack(parts)

    def broadcast(self, t: torch.Tensor, src: int, kind: str, round_: int) -> None:
        self._run("broadcast", lambda: dist.broadcast(t, src=src, group=self.group), round_)
        self.calls["broadcast"] += 1
        self.bytes[kind] += (self.world - 1) * t.numel() * t.element_size()

    def all_gather_object(self, obj, round_: int) -> list:
        out = [None] * self.world
        self._run("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group), round_)
        self.calls["all_gather_object"] += 1
        return out


_DIGEST_CHUNK = 1 << 24  # 32-bit words per step of `_tensor_digest` (its int64 temporaries: 3 x 128 MiB at most)


def _tensor_digest(t: torch.Tensor) -> tuple[int, int]:
    """Two 63-bit sums over every bit of `t`, computed where it lives (no host copy): its bytes as 32-bit words w_i,
    sum(w_i) and sum(w_i * m_i) with position weights m_i = (i * 2654435761 + 1) mod 2**31 (a moved, swapped or
    changed word changes the second), in int64 arithmetic."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    w = b.view(torch.int32)
    plain, weighted = 0, 0
    for start in range(0, w.numel(), _DIGEST_CHUNK):
        part = w[start:start + _DIGEST_CHUNK].to(torch.int64)
        idx = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64)
        plain += int(part.sum())
        weighted += int((part * ((idx * 2654435761 + 1) % 2**31)).sum())
    return plain & (2**63 - 1), weighted & (2**63 - 1)


def weights_fingerprint(model) -> int:
    """A crc32 of the model's weights as decoded: every parameter's and buffer's name, shape and dtype, and a digest
    of all its bits (`_tensor_digest`, on its device). Computed once per state of the weights: cached on the model
    under the tensors' storage and version counters (an in-place change, a LoRA merge, `.to()`, computes it anew).
    Before issue 36 only 4,096 values at each end of three parameters were read: a LoRA-like change to the q / v / o
    projections on one rank passed the check and its answers were wrong."""
    tensors = [(k, v) for k, v in model.named_parameters()]
    tensors += [(k, v) for k, v in model.named_buffers() if v.is_floating_point()]
    key = tuple((k, v.data_ptr(), v._version, tuple(v.shape), str(v.dtype)) for k, v in tensors)
    cached = getattr(model, "_lopa_fast_weights_fingerprint", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    crc = zlib.crc32(repr([(k, tuple(v.shape), str(v.dtype)) for k, v in tensors]).encode())
    with torch.no_grad():
        for _, v in tensors:
            crc = zlib.crc32(repr(_tensor_digest(v)).encode(), crc)
    try:
        model._lopa_fast_weights_fingerprint = (key, crc)
    except AttributeError:
        pass
    return crc


def request_fingerprint(model, prompt: torch.Tensor, cfg) -> int:
    """A crc32 of the request (config, prompt ids, model geometry, dtype, weights: `weights_fingerprint`): every
    rank must decode the same one."""
    c = model.config
    geo = (c.vocab_size, c.num_layers, c.num_kv_heads, c.head_dim, str(model.dtype))
    return zlib.crc32(repr((cfg, prompt.tolist(), geo)).encode(), weights_fingerprint(model))
