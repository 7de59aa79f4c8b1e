// rope's CPU kernel (float32): rotate-half RoPE of q and k, read through their strides (slices of a merged q/k/v
// projection), written contiguous. See lopa_fast/reference/ops.py::rope.
#pragma once
#include <cstdint>

namespace lopa_fast {

struct RopeArgs {
  int64_t B, n, Hq, Hkv, D;
  int64_t q_sb, q_sn, q_sh;  // q's strides (elements) over B, n, heads; its last dim is contiguous
  int64_t k_sb, k_sn, k_sh;
  int64_t cs_sb;             // cos / sin: [n, D] (0) or [B, n, D] (n * D): the stride over B
  const float* q;
  const float* k;
  const float* cos;
  const float* sin;
  float* q_out;  // [B, n, Hq, D] contiguous
  float* k_out;  // [B, n, Hkv, D] contiguous
};

void rope_cpu(const RopeArgs& a);

}  // namespace lopa_fast
