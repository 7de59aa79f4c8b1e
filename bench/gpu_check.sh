#!/usr/bin/env bash
# The one prepared GPU check (TOOLCHAIN.md, "The GPU machine"): install without network, run the `gpu`
# tests and the microbenchmarks, full logs and JSON to $OUT, a short summary last on stdout.
# Run from the repo root on the device machine: bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || echo "install failed (see install.log)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, record the exit code
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/summary.txt"
}

# --- CUDA kernels (kernels/cuda, lopa_fast/ops/_cuda.py): parity + compile checks, then benchmarks
step cuda_tests 300 python -m pytest tests/test_cuda_gpu.py tests/test_cuda_compile.py tests/test_cuda_loader.py -q
step cuda_bench 300 python -m pytest bench/bench_cuda.py -m bench -q --benchmark-group-by=param:shape \
  --benchmark-columns=median,iqr,rounds --benchmark-json="$OUT/bench_cuda.json"

echo "=== summary"
cat "$OUT/summary.txt"
tail -n 5 "$OUT/cuda_tests.log"
grep -E "^(Name|test_bench|-+ benchmark)" "$OUT/cuda_bench.log" | head -40
