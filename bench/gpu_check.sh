#!/usr/bin/env bash
# The one prepared GPU check (docs/toolchain.md section 7): install without network, then, in this order,
#   1. round latency: eager vs CUDA-graph-captured round of a random Dream-7B-shaped bf16 model, k = 1, 2, 4, 8
#      (window 32, prefix 1024) beside the weight-streaming floor (bench/bench_round_captured.py --stage round),
#      then measured vs projected: those round times next to the CPU-counted H200 projection of the same round
#      (bench/projection_check.py over bench/results/real_shapes_dream7b.json) and the per-launch costs they imply;
#   2. generate(backend="fast", compile=True) vs backend="reference" token parity (tiny fp32: exact; bf16: rate;
#      LoPA, D2F and APD with its fused head);
#      then batched generate vs sequential (request-rounds per second, B = 1..16 for d2f / LoPA, B = 1 and 16 for
#      vanilla, threshold and APD (a 0.5B-shaped verifier), whose steps batch through their drivers:
#      bench_round_captured --stage batch; 55 s, 5 s of them given to the Triton parity stage);
#   3. the `gpu` tests (device cache_len under CUDA-graph capture included) and the kernel microbenchmarks (the
#      fused add + norm + GEMM + SwiGLU / RoPE beside the unfused ops among them: bench_ops' norm_linear rows).
# Every stage runs under its own `timeout`, so one hang cannot eat the budget (the caps sum to 435 s + the 45 s
# install: ~8 minutes on one H200).
# Full logs and JSON to $OUT, a short table last on stdout. Run from the repo root: bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
export OUT
mkdir -p "$OUT"
: >"$OUT/summary.txt"
timeout 45 pip install --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || echo "install failed (see install.log)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, record the exit code
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$t" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? ${SECONDS}s-total $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}

# --- 1. round latency first (the headline numbers), 2. compile=True token parity
step round_captured 140 python bench/bench_round_captured.py --stage round --out "$OUT"
step projection 10 python bench/projection_check.py --out "$OUT"
step parity_compiled 55 python bench/bench_round_captured.py --stage parity --out "$OUT"
step batch 55 python bench/bench_round_captured.py --stage batch --out "$OUT"

# --- CUDA kernels (kernels/cuda, lopa_fast/ops/cuda/): parity (the ops' `gpu` tests) + compile checks,
# then benchmarks
step cuda_tests 45 python -m pytest tests/test_branch_attention.py tests/test_confidence.py \
  tests/test_cuda_graph_capture.py tests/test_cuda_compile.py tests/test_cuda_loader.py -q -k "cuda or nvrtc or nvcc"
step cuda_bench 40 python -m pytest bench/bench_cuda.py -m bench -q --benchmark-group-by=param:shape \
  --benchmark-columns=median,iqr,rounds --benchmark-json="$OUT/bench_cuda.json"

# --- Triton kernels (kernels/triton): parity on the GPU (bf16 included), then microbenchmarks vs
# torch/SDPA/Flex
step triton_tests 50 python -m pytest tests/test_branch_attention.py tests/test_confidence.py tests/test_norm_linear.py \
  tests/test_first_bad.py tests/test_commit_round.py \
  tests/test_triton_compile.py -q
step triton_bench 40 python -m pytest bench/bench_ops.py -m bench -q --benchmark-columns=median,iqr,rounds \
  --benchmark-json="$OUT/bench_ops.json"

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
python bench/bench_round_captured.py --stage table --out "$OUT" || tail -n 20 "$OUT/round_captured.log"
tail -n 8 "$OUT/projection.log"
