#!/usr/bin/env bash
# The one prepared GPU check (docs/toolchain.md section 7): install without network, run the `gpu`
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

# --- CUDA kernels (kernels/cuda, lopa_fast/ops/cuda/): parity (the ops' `gpu` tests) + compile checks, then benchmarks
step cuda_tests 300 python -m pytest tests/test_branch_attention.py tests/test_confidence.py tests/test_select_round.py \
  tests/test_cuda_graph_capture.py tests/test_cuda_compile.py tests/test_cuda_loader.py -q -k "cuda or nvrtc or nvcc"
step cuda_bench 300 python -m pytest bench/bench_cuda.py -m bench -k "not cpp" -q --benchmark-group-by=param:shape \
  --benchmark-columns=median,iqr,rounds --benchmark-json="$OUT/bench_cuda.json"

# --- Triton kernels (kernels/triton): parity on the GPU (bf16 included), then microbenchmarks vs torch/SDPA/Flex
step triton_tests 300 python -m pytest tests/test_branch_attention.py tests/test_confidence.py \
  tests/test_select_round.py tests/test_triton_compile.py -q
step triton_bench 400 python -m pytest bench/bench_ops.py -m bench -q --benchmark-columns=median,iqr,rounds \
  --benchmark-json="$OUT/bench_ops.json"

# --- fast decoder: round latency of a random Dream-7B-shaped bf16 model vs the ~3.3 ms floor (issue 4)
step round_gpu 500 python -m pytest bench/bench_round_gpu.py -m "bench and gpu" -q -s

echo "=== summary"
cat "$OUT/summary.txt"
tail -n 5 "$OUT/cuda_tests.log"
grep -E "^(Name|test_bench|-+ benchmark)" "$OUT/cuda_bench.log" | head -40
tail -n 3 "$OUT/triton_tests.log"
python - "$OUT/bench_ops.json" <<'PY' || true
import json, sys
rows = json.load(open(sys.argv[1]))["benchmarks"]
print(f"{'benchmark':<72} {'us':>9} {'GB/s':>8} {'TFLOP/s':>8}")
for b in rows:
    e = b["extra_info"]
    print(f"{b['name']:<72} {e.get('us_event', 0):>9.1f} {e.get('gbps', 0):>8.0f} {e.get('tflops', 0):>8.1f}")
PY
grep -A 14 "^{.gpu" "$OUT/round_gpu.log" || true
