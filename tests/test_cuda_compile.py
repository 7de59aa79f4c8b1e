"""CUDA kernels compile for sm_90 without a GPU.

1. nvcc: `nvcc -arch=sm_90 -cubin -Xptxas -v --Werror all-warnings -Xptxas -warn-spills` on every .cu of
   kernels/cuda (any warning or register spill fails); skipped when nvcc is absent.
2. NVRTC: the exact source text, headers and options the runtime loader (lopa_fast.ops.cuda.source) compiles
   with, through the same function; skipped when cupy + nvidia-cuda-nvrtc are not installed.

`python tests/test_cuda_compile.py` rewrites bench/results/cuda_resources.md (registers, smem, spills).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lopa_fast.ops.cuda import launch, source
from lopa_fast.ops.cuda.constants import OPS, define_flags

CU_FILES = sorted(source.KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")
NVCC_FLAGS = ["-arch=sm_90", "-cubin", "-Xptxas", "-v", "--Werror", "all-warnings", "-Xptxas", "-warn-spills"]


def nvcc_compile(cu: Path, out: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    cmd = [NVCC, *NVCC_FLAGS, *define_flags(), f"-I{source.KERNEL_DIR}", "-o", str(out), str(cu)]
    return subprocess.run(cmd, capture_output=True, text=True), cmd


def parse_ptxas(log: str) -> dict[str, dict]:
    """{entry: {regs, smem, stack, spill_st, spill_ld}} from ptxas -v output."""
    res: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = res.setdefault(m.group(1), {"regs": None, "smem": 0, "stack": 0, "spill_st": 0, "spill_ld": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_st"], cur["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return res


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_nvcc_sm90_no_warnings_no_spills(cu, tmp_path):
    r, cmd = nvcc_compile(cu, tmp_path / (cu.stem + ".cubin"))
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    res = parse_ptxas(r.stderr + r.stdout)
    op = cu.stem
    assert set(source.entry_names(op)) <= set(res), "an entry point the loader launches is missing"
    for name, info in res.items():
        assert info["spill_st"] == info["spill_ld"] == info["stack"] == 0, (name, info)


def _nvrtc_ok() -> str | None:
    try:
        source.nvrtc().getVersion()
    except Exception as e:  # noqa: BLE001 - ImportError or a missing libnvrtc
        return f"cupy + nvidia-cuda-nvrtc not usable: {type(e).__name__}: {e}"
    return None


@pytest.mark.skipif(_nvrtc_ok() is not None, reason=str(_nvrtc_ok()))
@pytest.mark.parametrize("op", OPS)
def test_nvrtc_compiles_the_loader_source(op):
    """The loader's own compile function, source and options, for sm_90 (no device needed)."""
    src, headers = source.kernel_source(op)
    assert "#include <" not in src + "".join(headers.values()), "NVRTC has no system include path here"
    cubin = source.compile_cubin(op, 90)
    assert cubin[:4] == b"\x7fELF"
    for name in source.entry_names(op):
        assert name.encode() in cubin, f"entry {name} missing from the cubin"


def write_resources(path: Path) -> None:
    nvcc_version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    lines = [
        "# CUDA kernel resources (sm_90, ptxas)",
        "",
        f"Command: `nvcc {' '.join(NVCC_FLAGS)} <-D defines of lopa_fast.ops.cuda.constants> "
        f"-I kernels/cuda <file>.cu` ({nvcc_version}).",
        "Written by `python tests/test_cuda_compile.py`. Threads per CTA: branch_attention partial/combine 128,",
        "confidence 256. smem = static shared memory; branch_attention_(pooled_)partial also take dynamic shared memory",
        "(column `dyn smem`, from lopa_fast.ops.launch.attention_smem_bytes).",
        "",
        "| entry | regs | smem (B) | dyn smem (B) | stack (B) | spill st/ld (B) |",
        "|---|---|---|---|---|---|",
    ]
    import tempfile  # noqa: PLC0415

    import torch  # noqa: PLC0415

    dts = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    with tempfile.TemporaryDirectory() as tmp:
        for cu in CU_FILES:
            r, cmd = nvcc_compile(cu, Path(tmp) / "k.cubin")
            if r.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
            for name, i in sorted(parse_ptxas(r.stderr + r.stdout).items()):
                m = re.match(r"branch_attention_(?:pooled_)?partial_(\w+)_d(\d+)$", name)
                dyn = launch.attention_smem_bytes(dts[m.group(1)], int(m.group(2))) if m else 0
                lines.append(f"| {name} | {i['regs']} | {i['smem']} | {dyn} | {i['stack']} | "
                             f"{i['spill_st']}/{i['spill_ld']} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if NVCC is None:
        sys.exit("nvcc not on PATH")
    out = Path(__file__).resolve().parents[1] / "bench" / "results" / "cuda_resources.md"
    write_resources(out)
    print(out.read_text())
