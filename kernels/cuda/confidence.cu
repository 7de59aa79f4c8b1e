// confidence: per-row vocabulary statistics of softmax(logits) in fp32.
// Semantics: lopa_fast.reference.ops.confidence.
//
//   logits [N, V] (row stride in elements, last dim contiguous) -> token int64 [N], p_max, margin,
//   neg_entropy, lse fp32 [N]; suppress (-1 = none) is treated as logit -inf; argmax ties -> lowest index.
//
// One CTA of 256 threads per row, two passes over the row in 16-byte chunks (the vocabulary is never
// held whole: a 152k-wide row in one tile is what spilled in the Triton sweep):
//   pass 1: online max / sum-exp, top-1 (value, index) and top-2 value; block merge -> lse, p_max, margin
//   pass 2: sum_v p_v * log(p_v + eps) with the final lse (exact upstream formula, eps inside the log).
// Bytes: 2 * N * V * sizeof(T) read (pass 2 mostly from L2: 132 rows in flight x 304 KB at V=152k bf16).
#include "common.cuh"

namespace lopa {
namespace conf {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kNoIndex = 0x7fffffff;

struct State {
  float m, s;   // running max and sum of exp(x - m)
  float t1, t2;  // top-1 and top-2 values (multiset)
  int i1;       // index of top-1 (lowest on ties)
};

LOPA_INLINE State identity() {
  State st;
  st.m = LOPA_NEG_INF;
  st.s = 0.f;
  st.t1 = LOPA_NEG_INF;
  st.t2 = LOPA_NEG_INF;
  st.i1 = kNoIndex;
  return st;
}

LOPA_INLINE void push(State& st, float x, int j) {
  if (x > st.t1 || (x == st.t1 && j < st.i1)) {
    st.t2 = st.t1;
    st.t1 = x;
    st.i1 = j;
  } else if (x > st.t2) {
    st.t2 = x;
  }
}

LOPA_INLINE void add_exp(State& st, const float* x, int cnt) {
  float cm = LOPA_NEG_INF;
  for (int e = 0; e < cnt; ++e) cm = fmaxf(cm, x[e]);
  if (cm > st.m) {  // one rescale per chunk, not per element
    st.s = st.m == LOPA_NEG_INF ? 0.f : st.s * expf(st.m - cm);
    st.m = cm;
  }
  if (st.m == LOPA_NEG_INF) return;  // everything so far is -inf: contributes 0
  for (int e = 0; e < cnt; ++e) st.s += expf(x[e] - st.m);
}

LOPA_INLINE State merge(const State& a, const State& b) {
  State r;
  r.m = fmaxf(a.m, b.m);
  r.s = r.m == LOPA_NEG_INF ? 0.f
                            : (a.m == LOPA_NEG_INF ? 0.f : a.s * expf(a.m - r.m)) +
                                  (b.m == LOPA_NEG_INF ? 0.f : b.s * expf(b.m - r.m));
  const bool b_first = b.t1 > a.t1 || (b.t1 == a.t1 && b.i1 < a.i1);
  const State& hi = b_first ? b : a;
  const State& lo = b_first ? a : b;
  r.t1 = hi.t1;
  r.i1 = hi.i1;
  r.t2 = fmaxf(hi.t2, lo.t1);
  return r;
}

LOPA_INLINE State shfl_xor(const State& a, int o) {
  State b;
  b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
  b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
  b.t1 = __shfl_xor_sync(0xffffffffu, a.t1, o);
  b.t2 = __shfl_xor_sync(0xffffffffu, a.t2, o);
  b.i1 = __shfl_xor_sync(0xffffffffu, a.i1, o);
  return b;
}

template <typename T>
LOPA_INLINE void row_stats(const T* __restrict__ logits, long long row_stride, int N, int V, int suppress, float eps,
                           int vec, long long* __restrict__ token, float* __restrict__ p_max,
                           float* __restrict__ margin, float* __restrict__ neg_entropy, float* __restrict__ lse) {
  constexpr int E = Vec<T>::N;
  __shared__ State warp_state[kWarps];
  __shared__ float warp_sum_s[kWarps];
  __shared__ float row_lse;
  const int row = blockIdx.x;
  if (row >= N) return;
  const T* x = logits + (long long)row * row_stride;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int v_vec = vec ? (V / E) * E : 0;  // vectorised head; scalar tail (and unaligned rows)

  State st = identity();
  for (int c = tid * E; c < v_vec; c += kThreads * E) {
    float f[E];
    load_vec(x + c, f);
    if (suppress >= c && suppress < c + E) f[suppress - c] = LOPA_NEG_INF;
#pragma unroll
    for (int e = 0; e < E; ++e) push(st, f[e], c + e);
    add_exp(st, f, E);
  }
  for (int j = v_vec + tid; j < V; j += kThreads) {
    float f = j == suppress ? LOPA_NEG_INF : to_float(x[j]);
    push(st, f, j);
    add_exp(st, &f, 1);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_xor(st, o));
  if (lane == 0) warp_state[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kWarps ? warp_state[lane] : identity();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_xor(st, o));
    if (lane == 0) {
      const float l = st.m + logf(st.s);
      row_lse = l;
      const float p1 = expf(st.t1 - l), p2 = expf(st.t2 - l);
      token[row] = st.i1 == kNoIndex ? 0 : st.i1;
      p_max[row] = p1;
      margin[row] = p1 - p2;
      lse[row] = l;
    }
  }
  __syncthreads();
  const float l = row_lse;

  float acc = 0.f;
  for (int c = tid * E; c < v_vec; c += kThreads * E) {
    float f[E];
    load_vec(x + c, f);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float p = (c + e == suppress) ? 0.f : expf(f[e] - l);
      acc += p * logf(p + eps);
    }
  }
  for (int j = v_vec + tid; j < V; j += kThreads) {
    const float p = j == suppress ? 0.f : expf(to_float(x[j]) - l);
    acc += p * logf(p + eps);
  }
  acc = warp_sum(acc);
  if (lane == 0) warp_sum_s[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kWarps ? warp_sum_s[lane] : 0.f;
    acc = warp_sum(acc);
    if (lane == 0) neg_entropy[row] = acc;
  }
}

}  // namespace conf
}  // namespace lopa

#define LOPA_CONF_ENTRY(TNAME, T)                                                                                \
  extern "C" __global__ void __launch_bounds__(lopa::conf::kThreads) confidence_##TNAME(                        \
      const T* logits, long long row_stride, int N, int V, int suppress, float eps, int vec, long long* token,  \
      float* p_max, float* margin, float* neg_entropy, float* lse) {                                             \
    lopa::conf::row_stats<T>(logits, row_stride, N, V, suppress, eps, vec, token, p_max, margin, neg_entropy,  \
                             lse);                                                                               \
  }

LOPA_CONF_ENTRY(f32, float)
LOPA_CONF_ENTRY(bf16, lopa::bf16)
LOPA_CONF_ENTRY(f16, lopa::f16)
