// select_round: threshold accept, at-least-one fallback, top-n_look lookahead, branch score and winner for
// B branch windows of n positions in ONE CTA (no host round trip; inputs are a few KB, the launch is the cost).
// Semantics: lopa_fast.reference.ops.select_round.
//
//   value, conf [B, n] fp32 ; masked [B, n] u8 ; block_ids [B, n] int64 (-1 = not in an active block)
//   complete [B, nb] u8 ; ktab [n + 1] int32 = max(1, floor(c * topp)) ; creation_conf [B] fp32 | null
//   active [B] u8 | null  ->  accept [B, n] u8, look [B, n_look] int64, score [B] fp32, winner int64
//
// One warp per branch (warps loop over branches); lane owns positions lane, lane + 32, ... (n <= 1024, so a
// 32-bit mask per lane records the lookahead picks). The lowest-k mean ranks every masked position against
// the others from shared memory (n^2/32 compares per lane: 2048 at n = 256). The score is formed with
// explicitly rounded fp32 operations, in the reference's order, so equal inputs give bit-equal scores and
// the winner (argmax, earliest branch on ties) matches exactly.
#include "common.cuh"

namespace lopa {
namespace sel {

constexpr int kMaxWarps = LOPA_SEL_MAX_WARPS;
static_assert(LOPA_SEL_MAX_N <= 32 * 32, "the lookahead picks of a lane live in one 32-bit mask");

LOPA_INLINE void warp_argmax(float& v, int& i) {  // max value, earliest index on ties (i = big: none)
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (v2 > v || (v2 == v && i2 < i)) {
      v = v2;
      i = i2;
    }
  }
}

LOPA_INLINE bool hit(float v, float tau, int cmp) {
  return cmp == LOPA_CMP_GT ? v > tau : (cmp == LOPA_CMP_GE ? v >= tau : v <= tau);
}

LOPA_INLINE void run(const float* __restrict__ value, const float* __restrict__ conf,
                     const unsigned char* __restrict__ masked, const long long* __restrict__ block_ids,
                     const unsigned char* __restrict__ complete, const int* __restrict__ ktab,
                     const float* __restrict__ creation_conf, const unsigned char* __restrict__ active,
                     unsigned char* __restrict__ accept, long long* __restrict__ look, float* __restrict__ score,
                     long long* __restrict__ winner, int B, int n, int nb, int n_look, int cmp, float tau,
                     float alpha, float one_minus_alpha) {
  constexpr int kBig = 0x7fffffff;
  const float kInf = __int_as_float(0x7f800000);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  LOPA_DYNAMIC_SMEM(smem);
  float* cs = reinterpret_cast<float*>(smem) + warp * n;  // this warp's conf row, +inf where not masked

  for (int b = warp; b < B; b += n_warps) {
    const long long row = (long long)b * n;
    // 1. threshold accept
    for (int i = lane; i < n; i += 32) {
      const bool m = masked[row + i] != 0;
      accept[row + i] = (m && block_ids[row + i] >= 0 && hit(value[row + i], tau, cmp)) ? 1 : 0;
      cs[i] = m ? conf[row + i] : kInf;  // conf is never read at unmasked positions (may be NaN)
    }
    __syncwarp();
    // 2. fallback: a complete block with masked positions and no accept takes its earliest arg-max of conf
    for (int j = 0; j < nb; ++j) {
      float best = LOPA_NEG_INF;
      int first = kBig;
      bool any_masked = false, any_accept = false;
      for (int i = lane; i < n; i += 32) {
        if (masked[row + i] == 0 || block_ids[row + i] != j) continue;
        any_masked = true;
        any_accept = any_accept || accept[row + i] != 0;
        if (cs[i] > best || first == kBig) {
          best = cs[i];
          first = i;
        }
      }
      const unsigned m_any = __ballot_sync(0xffffffffu, any_masked);
      const unsigned a_any = __ballot_sync(0xffffffffu, any_accept);
      warp_argmax(best, first);
      if (lane == 0 && complete[(long long)b * nb + j] != 0 && m_any != 0u && a_any == 0u) accept[row + first] = 1;
      __syncwarp();
    }
    // 3. lookahead: n_look rounds of "earliest arg-max of conf over candidates not yet picked"
    unsigned picked = 0u;  // bit k: position lane + 32k
    for (int t = 0; t < n_look; ++t) {
      float best = LOPA_NEG_INF;
      int first = kBig;
      for (int i = lane, k = 0; i < n; i += 32, ++k) {
        const bool cand = masked[row + i] != 0 && block_ids[row + i] >= 0 && accept[row + i] == 0;
        if (!cand || (picked >> k & 1u)) continue;
        if (cs[i] > best || first == kBig) {
          best = cs[i];
          first = i;
        }
      }
      warp_argmax(best, first);
      if (first != kBig && first % 32 == lane) picked |= 1u << (first / 32);
      if (lane == 0) look[(long long)b * n_look + t] = first == kBig ? -1 : first;
    }
    // 4. future score: mean of the k = ktab[m] lowest conf values over the m masked positions
    int m_local = 0;
    for (int i = lane; i < n; i += 32) m_local += masked[row + i] != 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m_local += __shfl_xor_sync(0xffffffffu, m_local, o);
    const int k = ktab[m_local];
    float part = 0.f;
    for (int i = lane; i < n; i += 32) {
      if (masked[row + i] == 0) continue;
      const float c = cs[i];
      int rank = 0;  // position of i in the ascending stable order of the masked values
      for (int j2 = 0; j2 < n; ++j2) rank += (cs[j2] < c || (cs[j2] == c && j2 < i)) ? 1 : 0;
      if (rank < k) part += c;
    }
    part = warp_sum(part);
    if (lane == 0) {
      const float future = m_local > 0 ? __fdiv_rn(part, (float)k) : 1.f;
      const float cc = creation_conf ? creation_conf[b] : 1.f;
      score[b] = __fadd_rn(__fmul_rn(alpha, cc), __fmul_rn(one_minus_alpha, future));
    }
    __syncwarp();
  }
  __syncthreads();  // every branch's score is written (global writes are visible within the block)
  // 5. winner: arg-max over active branches, earliest on ties; -1 if none is active
  if (warp == 0) {
    float best = LOPA_NEG_INF;
    int first = kBig;
    for (int b = lane; b < B; b += 32) {
      if (active && active[b] == 0) continue;
      const float s = score[b];
      if (s > best || first == kBig) {
        best = s;
        first = b;
      }
    }
    warp_argmax(best, first);
    if (lane == 0) *winner = first == kBig ? -1 : first;
  }
}

}  // namespace sel
}  // namespace lopa

extern "C" __global__ void __launch_bounds__(32 * lopa::sel::kMaxWarps, 1)  // min 1 CTA/SM: without it ptxas capped at 32 regs and spilled
    select_round_f32(const float* value, const float* conf, const unsigned char* masked, const long long* block_ids,
                     const unsigned char* complete, const int* ktab, const float* creation_conf,
                     const unsigned char* active, unsigned char* accept, long long* look, float* score,
                     long long* winner, int B, int n, int nb, int n_look, int cmp, float tau, float alpha,
                     float one_minus_alpha) {
  lopa::sel::run(value, conf, masked, block_ids, complete, ktab, creation_conf, active, accept, look, score, winner,
                 B, n, nb, n_look, cmp, tau, alpha, one_minus_alpha);
}
