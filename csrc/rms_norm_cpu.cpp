// rms_norm (and the residual add before it) on CPU, float32, one pass a row: s = x + residual (one rounding, bitwise
// torch's add), then weight * (s * rsqrt(mean(s^2) + eps)) with torch's roundings in torch's order (rsqrt as
// 1 / sqrt, both correctly rounded, as torch's vectorised rsqrt; no FMA: -ffp-contract=off). The one difference
// from the torch formula is mean(s^2)'s summation order (accumulated here in double, then rounded to float once;
// torch sums float vectors): the mean can differ in its last bit, so the output is within ~2 ulp, not bitwise
// (tests/test_rms_norm.py). Replaces the torch backend's 7-8 ops a norm (~17 us on a tiny CPU layer).
#include <cmath>

#include "rms_norm.h"

namespace lopa_fast {

void rms_norm_cpu(const RmsNormArgs& a) {
  const int64_t H = a.H;
  const float eps = static_cast<float>(a.eps);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = a.x + r * H;
    const float* s = x;
    if (a.residual != nullptr) {
      const float* res = a.residual + r * H;
      float* sum = a.sum + r * H;
      for (int64_t j = 0; j < H; ++j) sum[j] = x[j] + res[j];
      s = sum;
    }
    double acc = 0.0;
    for (int64_t j = 0; j < H; ++j) {
      const float sq = s[j] * s[j];  // x.pow(2) in float
      acc += sq;
    }
    const float mean = static_cast<float>(acc / static_cast<double>(H));
    const float inv = 1.0f / std::sqrt(mean + eps);
    float* out = a.out + r * H;
    for (int64_t j = 0; j < H; ++j) {
      const float t = s[j] * inv;
      out[j] = a.weight[j] * t;
    }
  }
}

}  // namespace lopa_fast
