// first_nonfinite on CPU: one read of the real logits rows, no temporary, stopping at a row's first bad value. The
// same answer as lopa_fast/reference/ops.py::first_nonfinite (a value is NaN / +-inf, or at T > 0 overflows when
// divided by T in float32; the smallest flat row among the bad real rows, else -1): exact by construction
// (tests/test_first_nonfinite.py). Replaces ~7 tensor ops a round (~50 us on a tiny CPU round).
#include <cmath>

#include "first_nonfinite.h"

namespace lopa_fast {

void first_nonfinite_cpu(const GuardArgs& a) {
  const int64_t n_real = a.n_real_ptr != nullptr ? *a.n_real_ptr : a.n_real;
  const float t = a.temperature_ptr != nullptr ? static_cast<float>(*a.temperature_ptr) : a.temperature;
  int64_t first = a.none;
  for (int64_t r = 0; r < a.R && r < n_real; ++r) {
    if (a.rows[r] >= first) continue;  // cannot lower the answer
    const float* x = a.logits + r * a.row_stride;
    bool bad = false;
    for (int64_t j = 0; j < a.V && !bad; ++j) {
      bad = !std::isfinite(x[j]) || (a.sampling && !std::isfinite(x[j] / t));
    }
    if (bad) first = a.rows[r];
  }
  *a.out = first < a.none ? first : -1;
}

}  // namespace lopa_fast
