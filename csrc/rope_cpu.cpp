// rope on CPU (float32): out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]), the same
// three roundings in the same order as the torch formula (two products, then their sum; -ffp-contract=off: no fused
// multiply-add), so every element is bitwise lopa_fast/reference/ops.py::rope's (tests/test_rope.py). One pass over
// q and k instead of the torch backend's slice / gather / two products / sum / split / copy (~25 us a layer on a
// tiny CPU forward).
#include "rope.h"

namespace lopa_fast {

namespace {

// one head: x [D] -> out [D] at the row's cos / sin [D]
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) {  // first half: x * cos + (-x[d + h]) * sin
    const float t1 = x[d] * c[d];
    const float t2 = -x[d + h] * s[d];
    out[d] = t1 + t2;
  }
  for (int64_t d = h; d < D; ++d) {  // second half: x * cos + x[d - h] * sin
    const float t1 = x[d] * c[d];
    const float t2 = x[d - h] * s[d];
    out[d] = t1 + t2;
  }
}

}  // namespace

void rope_cpu(const RopeArgs& a) {
  const int64_t D = a.D;
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t i = 0; i < a.n; ++i) {
      const float* c = a.cos + b * a.cs_sb + i * D;
      const float* s = a.sin + b * a.cs_sb + i * D;
      for (int64_t h = 0; h < a.Hq; ++h)
        rotate(a.q + b * a.q_sb + i * a.q_sn + h * a.q_sh, c, s, a.q_out + ((b * a.n + i) * a.Hq + h) * D, D);
      for (int64_t h = 0; h < a.Hkv; ++h)
        rotate(a.k + b * a.k_sb + i * a.k_sn + h * a.k_sh, c, s, a.k_out + ((b * a.n + i) * a.Hkv + h) * D, D);
    }
  }
}

}  // namespace lopa_fast
