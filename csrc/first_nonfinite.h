// first_nonfinite's CPU kernel (float32 logits): the D2F / LoPA round's numerics guard. See
// lopa_fast/reference/ops.py::first_nonfinite.
#pragma once
#include <cstdint>

namespace lopa_fast {

struct GuardArgs {
  int64_t R, V, row_stride;    // logits rows [R, V], row r at logits + r * row_stride (its V values contiguous)
  int64_t n_real;              // the real rows: r < n_real (read from n_real_ptr when that is set)
  int64_t none;                // the "no bad row" value (> every flat row)
  const float* logits;
  const int64_t* rows;         // [R]: each row's flat window row
  const int64_t* n_real_ptr;   // 0-d long, or nullptr
  bool sampling;               // T > 0: also refuse a finite logit that overflows when divided by T
  float temperature;           // T as float (torch divides a float32 tensor by T in float32)
  const double* temperature_ptr;  // 0-d float64 knob, or nullptr (then `temperature`)
  int64_t* out;                // 0-d long: the first bad row's flat row, or -1
};

void first_nonfinite_cpu(const GuardArgs& a);

}  // namespace lopa_fast
