// rms_norm / add_rms_norm's CPU kernel (float32). See lopa_fast/reference/ops.py::rms_norm / add_rms_norm.
#pragma once
#include <cstdint>

namespace lopa_fast {

struct RmsNormArgs {
  int64_t rows, H;
  double eps;
  const float* x;         // [rows, H] contiguous
  const float* residual;  // [rows, H] or nullptr (rms_norm)
  const float* weight;    // [H]
  float* out;             // [rows, H]: the normed rows
  float* sum;             // [rows, H]: x + residual (add_rms_norm), or nullptr
};

void rms_norm_cpu(const RmsNormArgs& a);

}  // namespace lopa_fast
