// confidence: per-row vocabulary statistics of softmax(logits) in fp32.
// Semantics: lopa_fast.reference.ops.confidence (the softmax formula of lopa_fast.sampling.softmax_stats; here
// p = exp(x - lse), which stays within the tests' tolerance rule of it).
//
//   logits [N, V] (row stride in elements, last dim contiguous) -> token int64 [N], p_max, margin,
//   neg_entropy, lse fp32 [N]; suppress (-1 = none) is treated as logit -inf; argmax ties -> lowest index.
//
// One CTA of 256 threads per row (or per (row, V split) when rows are few: see split_stats), two passes over
// the row in 16-byte chunks (the vocabulary is never held whole: a 152k-wide row in one tile is what
// spilled in the Triton sweep):
//   pass 1: online max / sum-exp, top-1 (value, index) and top-2 value; block merge -> lse, p_max, margin
//   pass 2: sum_v p_v * log(p_v + eps) with the final lse (exact upstream formula, eps inside the log).
// Bytes: 2 * N * V * sizeof(T) read (pass 2 mostly from L2: 132 rows in flight x 304 KB at V=152k bf16).
#include "vocab_stats.cuh"

namespace lopa {
namespace conf {

constexpr int kThreads = LOPA_CONF_THREADS;
constexpr int kWarps = kThreads / 32;
using State = vocab::Stats;

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

LOPA_INLINE State shfl_xor(const State& a, int o) {
  State b;
  b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
  b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
  b.t1 = __shfl_xor_sync(0xffffffffu, a.t1, o);
  b.t2 = __shfl_xor_sync(0xffffffffu, a.t2, o);
  b.i1 = __shfl_xor_sync(0xffffffffu, a.i1, o);
  return b;
}

// Block-wide pass 1 over columns [begin, end) of one row: the merged State (valid in every thread).
template <typename T>
LOPA_INLINE State scan_stats(const T* __restrict__ x, int begin, int end, int suppress, int vec) {
  constexpr int E = Vec<T>::N;
  __shared__ State warp_state[kWarps];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int v_vec = vec ? begin + ((end - begin) / E) * E : begin;  // vectorised head; scalar tail
  State st = vocab::identity();
  for (int c = begin + tid * E; c < v_vec; c += kThreads * E) {
    float f[E];
    load_vec(x + c, f);
    if (suppress >= c && suppress < c + E) f[suppress - c] = LOPA_NEG_INF;
#pragma unroll
    for (int e = 0; e < E; ++e) vocab::push_top2(st, f[e], c + e);
    add_exp(st, f, E);
  }
  for (int j = v_vec + tid; j < end; j += kThreads) {
    float f = j == suppress ? LOPA_NEG_INF : to_float(x[j]);
    vocab::push_top2(st, f, j);
    add_exp(st, &f, 1);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) st = vocab::merge(st, shfl_xor(st, o));
  if (lane == 0) warp_state[warp] = st;
  __syncthreads();
  st = lane < kWarps ? warp_state[lane] : vocab::identity();
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) st = vocab::merge(st, shfl_xor(st, o));
  __syncthreads();  // warp_state may be reused by the caller's next scan
  return st;
}

// Block-wide pass 2 over [begin, end): sum_v p_v * log(p_v + eps) with p_v = exp(x_v - l) (valid in thread 0).
template <typename T>
LOPA_INLINE float scan_entropy(const T* __restrict__ x, int begin, int end, int suppress, int vec, float l,
                               float eps) {
  constexpr int E = Vec<T>::N;
  __shared__ float warp_acc[kWarps];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int v_vec = vec ? begin + ((end - begin) / E) * E : begin;
  float acc = 0.f;
  for (int c = begin + tid * E; c < v_vec; c += kThreads * E) {
    float f[E];
    load_vec(x + c, f);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float p = (c + e == suppress) ? 0.f : expf(f[e] - l);
      acc += p * logf(p + eps);
    }
  }
  for (int j = v_vec + tid; j < end; j += kThreads) {
    const float p = j == suppress ? 0.f : expf(to_float(x[j]) - l);
    acc += p * logf(p + eps);
  }
  acc = warp_sum(acc);
  if (lane == 0) warp_acc[warp] = acc;
  __syncthreads();
  acc = lane < kWarps ? warp_acc[lane] : 0.f;
  acc = warp_sum(acc);
  __syncthreads();
  return acc;
}

// One CTA per row: both passes over the whole row (enough rows to fill the GPU).
template <typename T>
LOPA_INLINE void row_stats(const T* __restrict__ logits, long long row_stride, int N, int V, int suppress, float eps,
                           int vec, long long* __restrict__ token, float* __restrict__ p_max,
                           float* __restrict__ margin, float* __restrict__ neg_entropy, float* __restrict__ lse) {
  const int row = blockIdx.x;
  if (row >= N) return;
  const T* x = logits + (long long)row * row_stride;
  const State st = scan_stats(x, 0, V, suppress, vec);
  if (threadIdx.x == 0) vocab::write_row(st, row, token, p_max, margin, lse);
  const float acc = scan_entropy(x, 0, V, suppress, vec, vocab::lse_of(st), eps);
  if (threadIdx.x == 0) neg_entropy[row] = acc;
}

// Split-V path for few rows (a 32-row D2F round would use 32 of 132 SMs): grid (N, S), chunk = columns per
// split (a multiple of 8). Three launches, no atomics, fixed merge order (deterministic):
//   split_stats:   State of (row, split) -> ws_state [N, S, 5] (m, s, t1, t2 as floats, i1 as int bits)
//   split_entropy: every CTA merges its row's S states in split order (-> lse), writes the row's stats once
//                  (split 0), and its chunk's entropy sum -> ws_ent [N, S]
//   finalize:      neg_entropy[row] = sum over splits in order (one warp per row)
template <typename T>
LOPA_INLINE void split_stats(const T* __restrict__ logits, long long row_stride, int N, int V, int chunk,
                             int suppress, int vec, float* __restrict__ ws_state) {
  const int row = blockIdx.x, split = blockIdx.y, S = gridDim.y;
  if (row >= N) return;
  const int begin = split * chunk, end = begin + chunk < V ? begin + chunk : V;
  const State st = scan_stats(logits + (long long)row * row_stride, begin, end, suppress, vec);
  if (threadIdx.x == 0) vocab::store(ws_state + ((long long)row * S + split) * vocab::kWords, st);
}

template <typename T>
LOPA_INLINE void split_entropy(const T* __restrict__ logits, long long row_stride, int N, int V, int chunk,
                               int suppress, float eps, int vec, const float* __restrict__ ws_state,
                               float* __restrict__ ws_ent, long long* __restrict__ token, float* __restrict__ p_max,
                               float* __restrict__ margin, float* __restrict__ lse) {
  __shared__ float row_lse;
  const int row = blockIdx.x, split = blockIdx.y, S = gridDim.y;
  if (row >= N) return;
  if (threadIdx.x == 0) {
    State st = vocab::identity();
    for (int s2 = 0; s2 < S; ++s2)
      st = vocab::merge(st, vocab::load(ws_state + ((long long)row * S + s2) * vocab::kWords));
    row_lse = vocab::lse_of(st);
    if (split == 0) vocab::write_row(st, row, token, p_max, margin, lse);
  }
  __syncthreads();
  const int begin = split * chunk, end = begin + chunk < V ? begin + chunk : V;
  const float acc = scan_entropy(logits + (long long)row * row_stride, begin, end, suppress, vec, row_lse, eps);
  if (threadIdx.x == 0) ws_ent[(long long)row * S + split] = acc;
}

LOPA_INLINE void split_finalize(const float* __restrict__ ws_ent, int N, int S, float* __restrict__ neg_entropy) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  if (lane == 0) neg_entropy[row] = vocab::sum_splits(ws_ent + (long long)row * S, S);
}

}  // namespace conf
}  // namespace lopa

#define LOPA_CONF_ENTRY(TNAME, T)                                                                                \
  extern "C" __global__ void __launch_bounds__(lopa::conf::kThreads) confidence_##TNAME(                        \
      const T* logits, long long row_stride, int N, int V, int suppress, float eps, int vec, long long* token,  \
      float* p_max, float* margin, float* neg_entropy, float* lse) {                                             \
    lopa::conf::row_stats<T>(logits, row_stride, N, V, suppress, eps, vec, token, p_max, margin, neg_entropy,  \
                             lse);                                                                               \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(lopa::conf::kThreads) confidence_split_stats_##TNAME(            \
      const T* logits, long long row_stride, int N, int V, int chunk, int suppress, int vec, float* ws_state) {  \
    lopa::conf::split_stats<T>(logits, row_stride, N, V, chunk, suppress, vec, ws_state);                       \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(lopa::conf::kThreads) confidence_split_entropy_##TNAME(          \
      const T* logits, long long row_stride, int N, int V, int chunk, int suppress, float eps, int vec,         \
      const float* ws_state, float* ws_ent, long long* token, float* p_max, float* margin, float* lse) {         \
    lopa::conf::split_entropy<T>(logits, row_stride, N, V, chunk, suppress, eps, vec, ws_state, ws_ent, token,  \
                                 p_max, margin, lse);                                                            \
  }

LOPA_CONF_ENTRY(f32, float)
LOPA_CONF_ENTRY(bf16, lopa::bf16)
LOPA_CONF_ENTRY(f16, lopa::f16)

extern "C" __global__ void __launch_bounds__(lopa::conf::kThreads)
    confidence_split_finalize(const float* ws_ent, int N, int S, float* neg_entropy) {
  lopa::conf::split_finalize(ws_ent, N, S, neg_entropy);
}
