// head_confidence: the LM head (hidden @ weight^T) and the per-row confidence statistics fused; the [R, V]
// logits never reach global memory.
// Semantics: lopa_fast.reference.ops.head_confidence = lopa_fast.ops.confidence of F.linear(hidden, weight)
// (each logit accumulated in fp32 and rounded to the storage dtype, as F.linear returns it), plus finite[r]:
// every raw logit of row r is finite (checked before the suppressed id is set to -inf).
//
//   hidden [R, H] (row stride ldh), weight [V, H] (row stride ldw), last dims contiguous -> token int64 [R],
//   p_max, margin, neg_entropy, lse fp32 [R], finite uint8 [R]; suppress (-1 = none); argmax ties -> lowest index.
//
// Grid (row tiles of kRows rows, S vocabulary splits), kThreads threads: a CTA walks its split in tiles of
// kThreads columns (one column per thread) and, per tile, the hidden dimension in kK-wide steps staged in shared
// memory (the weight tile read coalesced along H), each thread accumulating its column's kRows logits in a fixed
// order. SIMT fp32 (no tensor cores yet: this is the parity path; see docs/architecture.md). Four launches, no
// atomics, a fixed merge order (deterministic):
//   stats     per (row tile, split): online max / first arg-max / second max / sum exp / non-finite count per
//             row; the CTA's threads merged by a shared-memory tree (a fixed order) -> ws [R, S, 6]; with the
//             entropy, each logit also to an [R, V] scratch in T (exactly the value folded)
//   merge     per row: the S splits in order -> token, p_max, margin, lse, finite
//   entropy   (entropy only) the scratch read back in the same tiles (the same logits, bit for bit): sum
//             p log(p + eps) with the final lse -> ws_ent [R, S]. The eps inside the log needs the final lse, so
//             the logits are looked at twice; reading R x V x 2 B back is ~1/20 of recomputing them from the
//             head weight (Dream-7B: 49 MB against 1.09 GB at a LoPA k = 4 round's 160 rows)
//   finalize  per row: neg_entropy = the splits' sums in order
#include "vocab_stats.cuh"

namespace lopa {
namespace hc {

constexpr int kThreads = LOPA_HC_THREADS;
constexpr int kRows = LOPA_HC_ROWS;
constexpr int kK = 32;  // hidden elements per shared-memory step
static_assert(kRows * kK == kThreads, "one hidden-tile element per thread");
constexpr int kWsWords = vocab::kWords + 1;  // a split's Stats, then its non-finite count (int bits)

struct State : vocab::Stats {
  int bad;  // non-finite raw logits seen
};

LOPA_INLINE State identity() { return {vocab::identity(), 0}; }

// One logit at a time (a thread owns one column per tile), so the sum of exp is rescaled per element.
LOPA_INLINE void push(State& st, float x, int j) {
  vocab::push_top2(st, x, j);
  if (x > st.m) {
    st.s = (st.m == LOPA_NEG_INF ? 0.f : st.s * expf(st.m - x)) + 1.f;
    st.m = x;
  } else if (st.m != LOPA_NEG_INF) {
    st.s += expf(x - st.m);
  }
}

LOPA_INLINE State merge(const State& a, const State& b) { return {vocab::merge(a, b), a.bad + b.bad}; }

LOPA_INLINE bool finite(float x) { return fabsf(x) <= 3.402823466e38f; }  // false for NaN and +-inf

// out[r] = the CTA's kThreads values v[r] (one per thread) folded by op in a shared-memory tree: a fixed order,
// so deterministic. red: kThreads scratch. Every thread of the CTA must call it (barriers).
template <typename S, typename Op>
LOPA_INLINE void tree_rows(S* red, S* out, const S* v, Op op) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    red[tid] = v[r];
    __syncthreads();
    for (int o = kThreads / 2; o > 0; o >>= 1) {
      if (tid < o) red[tid] = op(red[tid], red[tid + o]);
      __syncthreads();
    }
    if (tid == 0) out[r] = red[0];
    __syncthreads();
  }
}

// The logits of rows [row0, row0 + kRows) x column c0 + threadIdx.x, in fp32 after rounding to T (columns past
// `end` and rows past R read zeros). Every thread of the CTA must call it (barriers).
template <typename T>
LOPA_INLINE void logits_tile(const T* __restrict__ hid, long long ldh, const T* __restrict__ w, long long ldw, int R,
                             int H, int row0, int c0, int end, float (*hs)[kK], float (*ws)[kK + 1],
                             float* out) {
  const int tid = threadIdx.x;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  for (int h0 = 0; h0 < H; h0 += kK) {
    {  // the hidden tile: one element per thread
      const int r = tid / kK, k = tid % kK;
      hs[r][k] = (row0 + r < R && h0 + k < H) ? to_float(hid[(long long)(row0 + r) * ldh + h0 + k]) : 0.f;
    }
    for (int e = tid; e < kThreads * kK; e += kThreads) {  // the weight tile, consecutive threads along H
      const int c = e / kK, k = e % kK;
      ws[c][k] = (c0 + c < end && h0 + k < H) ? to_float(w[(long long)(c0 + c) * ldw + h0 + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < kK; ++k) {
      const float wv = ws[tid][k];
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] = fmaf(hs[r][k], wv, acc[r]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) out[r] = to_float(From<T>::cvt(acc[r]));
}

struct Tile {
  int row0, split, S, tid, begin, end;
};

// this block's rows [row0, row0 + kRows), its vocabulary split of S and the split's columns [begin, end)
LOPA_INLINE Tile tile(int V, int chunk) {
  const int split = blockIdx.y, begin = split * chunk;
  const int end = begin + chunk < V ? begin + chunk : V;
  return {(int)blockIdx.x * kRows, split, (int)gridDim.y, (int)threadIdx.x, begin, end};
}

template <typename T>
LOPA_INLINE void stats(const T* __restrict__ hid, long long ldh, const T* __restrict__ w, long long ldw, int R, int V,
                       int H, int chunk, int suppress, float* __restrict__ ws_state, T* __restrict__ logits) {
  __shared__ float hs[kRows][kK];
  __shared__ float wt[kThreads][kK + 1];
  __shared__ State red[kThreads];
  __shared__ State row_state[kRows];
  const auto [row0, split, S, tid, begin, end] = tile(V, chunk);
  State st[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) st[r] = identity();
  for (int c0 = begin; c0 < end; c0 += kThreads) {
    float x[kRows];
    logits_tile<T>(hid, ldh, w, ldw, R, H, row0, c0, end, hs, wt, x);
    const int j = c0 + tid;
    if (j < end) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (logits != nullptr && row0 + r < R) logits[(long long)(row0 + r) * V + j] = From<T>::cvt(x[r]);  // exact
        st[r].bad += finite(x[r]) ? 0 : 1;
        push(st[r], j == suppress ? LOPA_NEG_INF : x[r], j);
      }
    }
  }
  tree_rows(red, row_state, st, merge);
  if (tid < kRows && row0 + tid < R) {
    const State m = row_state[tid];
    float* o = ws_state + ((long long)(row0 + tid) * S + split) * kWsWords;
    vocab::store(o, m);
    o[vocab::kWords] = __int_as_float(m.bad);
  }
}

LOPA_INLINE void merge_splits(const float* __restrict__ ws_state, int R, int S, long long* __restrict__ token,
                              float* __restrict__ p_max, float* __restrict__ margin, float* __restrict__ lse,
                              unsigned char* __restrict__ fin) {
  const int row = blockIdx.x * kThreads + threadIdx.x;
  if (row >= R) return;
  vocab::Stats st = vocab::identity();
  int bad = 0;
  for (int s2 = 0; s2 < S; ++s2) {
    const float* p = ws_state + ((long long)row * S + s2) * kWsWords;
    st = vocab::merge(st, vocab::load(p));
    bad += __float_as_int(p[vocab::kWords]);
  }
  vocab::write_row(st, row, token, p_max, margin, lse);
  fin[row] = bad == 0 ? 1 : 0;
}

template <typename T>
LOPA_INLINE void entropy(const T* __restrict__ logits, int R, int V, int chunk, int suppress, float eps,
                         const float* __restrict__ lse, float* __restrict__ ws_ent) {
  __shared__ float red[kThreads];
  __shared__ float row_acc[kRows];
  const auto [row0, split, S, tid, begin, end] = tile(V, chunk);
  float l[kRows], acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    l[r] = row0 + r < R ? lse[row0 + r] : 0.f;
    acc[r] = 0.f;
  }
  for (int j = begin + tid; j < end; j += kThreads) {  // a thread's columns in the stats pass's order
    if (j == suppress) continue;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float x = row0 + r < R ? to_float(logits[(long long)(row0 + r) * V + j]) : 0.f;
      const float p = expf(x - l[r]);
      acc[r] += p * logf(p + eps);
    }
  }
  tree_rows(red, row_acc, acc, [](float a, float b) { return a + b; });
  if (tid < kRows && row0 + tid < R) ws_ent[(long long)(row0 + tid) * S + split] = row_acc[tid];
}

LOPA_INLINE void finalize(const float* __restrict__ ws_ent, int R, int S, float* __restrict__ neg_entropy) {
  const int row = blockIdx.x * kThreads + threadIdx.x;
  if (row >= R) return;
  neg_entropy[row] = vocab::sum_splits(ws_ent + (long long)row * S, S);
}

}  // namespace hc
}  // namespace lopa

#define LOPA_HC_ENTRY(TNAME, T)                                                                                  \
  extern "C" __global__ void __launch_bounds__(lopa::hc::kThreads) head_confidence_stats_##TNAME(               \
      const T* hid, long long ldh, const T* w, long long ldw, int R, int V, int H, int chunk, int suppress,     \
      float* ws_state, T* logits) {                                                                              \
    lopa::hc::stats<T>(hid, ldh, w, ldw, R, V, H, chunk, suppress, ws_state, logits);                           \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(lopa::hc::kThreads) head_confidence_entropy_##TNAME(             \
      const T* logits, int R, int V, int chunk, int suppress, float eps, const float* lse, float* ws_ent) {      \
    lopa::hc::entropy<T>(logits, R, V, chunk, suppress, eps, lse, ws_ent);                                      \
  }

LOPA_HC_ENTRY(f32, float)
LOPA_HC_ENTRY(bf16, lopa::bf16)
LOPA_HC_ENTRY(f16, lopa::f16)

extern "C" __global__ void __launch_bounds__(lopa::hc::kThreads)
    head_confidence_merge(const float* ws_state, int R, int S, long long* token, float* p_max, float* margin,
                          float* lse, unsigned char* fin) {
  lopa::hc::merge_splits(ws_state, R, S, token, p_max, margin, lse, fin);
}

extern "C" __global__ void __launch_bounds__(lopa::hc::kThreads)
    head_confidence_finalize(const float* ws_ent, int R, int S, float* neg_entropy) {
  lopa::hc::finalize(ws_ent, R, S, neg_entropy);
}
