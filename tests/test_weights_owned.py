"""Issue 28, finding 4: a model loaded on the CPU owns its weights. Before, a float32 checkpoint loaded in float32
stayed a view of the safetensors file's memory map: `cp` over model.safetensors under a running server changed
the loaded model (logits moved by 13.6), truncating the file killed the process with SIGBUS. Also
models.loading.total_memory through psutil (plus the cgroup limit psutil does not read)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.models.loading import total_memory

IDS = torch.tensor([2, 5, 9, 11, 17, 23, 4, 8])


def _copy_model(dst):
    shutil.copytree(model_dir(), dst)
    return dst


def _logits(model):
    with torch.no_grad():
        return model(IDS[None]).float() if not hasattr(model, "logits") else model.logits(IDS[None]).float()


def test_overwriting_the_checkpoint_does_not_change_a_loaded_model(tmp_path):
    a = _copy_model(tmp_path / "a")
    model = lopa_fast.load_model(a, dtype=torch.float32)  # the file's own dtype: no cast that would copy
    before = _logits(model)
    other = lopa_fast.load_model(a, dtype=torch.float32)  # a different checkpoint of the same shapes
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    b = tmp_path / "b"
    lopa_fast.models.loading.save_checkpoint(other, b, {})
    shutil.copyfile(b / "model.safetensors", a / "model.safetensors")  # what `cp` does: the same inode, rewritten
    assert torch.equal(_logits(model), before)
    fresh = lopa_fast.load_model(a, dtype=torch.float32)
    assert not torch.equal(_logits(fresh), before)  # the file did change


TRUNCATE = r"""
import os, sys, torch, lopa_fast
model = lopa_fast.load_model(sys.argv[1], dtype=torch.float32)
os.truncate(os.path.join(sys.argv[1], "model.safetensors"), 0)
with torch.no_grad():
    out = model(torch.tensor([[2, 5, 9, 11]]))
print("ok", float(out.float().abs().sum()) > 0)
"""


def test_truncating_the_checkpoint_does_not_kill_the_process(tmp_path):
    a = _copy_model(tmp_path / "a")
    r = subprocess.run([sys.executable, "-c", TRUNCATE, str(a)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok True", (r.returncode, r.stderr[-2000:])


def test_total_memory_uses_psutil_and_the_cgroup_limit(monkeypatch):
    import psutil

    total, avail = total_memory("cpu")
    vm = psutil.virtual_memory()
    assert 0 < avail <= total <= vm.total
    limit = "/sys/fs/cgroup/memory.max"
    if os.path.isfile(limit) and open(limit).read().strip().isdigit():
        assert total == min(vm.total, int(open(limit).read().strip()))
