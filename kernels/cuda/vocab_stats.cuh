// Online vocabulary statistics shared by confidence.cu and head_confidence.cu: a row's running softmax
// normaliser and top-2, merged across threads and vocabulary splits in a fixed order (deterministic).
#pragma once
#include "common.cuh"

namespace lopa {
namespace vocab {

constexpr int kNoIndex = 0x7fffffff;

struct Stats {
  float m, s;    // running max and sum of exp(x - m)
  float t1, t2;  // top-1 and top-2 values (multiset)
  int i1;        // index of top-1 (lowest on ties)
};
constexpr int kWords = LOPA_VOCAB_WS_WORDS;  // floats per Stats in a split workspace: m, s, t1, t2, i1 (int bits)
static_assert(kWords == 5, "store / load below move exactly the five fields of Stats");

LOPA_INLINE Stats identity() {
  Stats st;
  st.m = st.t1 = st.t2 = LOPA_NEG_INF;
  st.s = 0.f;
  st.i1 = kNoIndex;
  return st;
}

// The top-2 part of adding logit x of vocabulary id j (the sum of exp is each kernel's own loop).
LOPA_INLINE void push_top2(Stats& st, float x, int j) {
  if (x > st.t1 || (x == st.t1 && j < st.i1)) {
    st.t2 = st.t1;
    st.t1 = x;
    st.i1 = j;
  } else if (x > st.t2) {
    st.t2 = x;
  }
}

LOPA_INLINE Stats merge(const Stats& a, const Stats& b) {
  Stats r;
  r.m = fmaxf(a.m, b.m);
  r.s = r.m == LOPA_NEG_INF ? 0.f
                            : (a.m == LOPA_NEG_INF ? 0.f : a.s * expf(a.m - r.m)) +
                                  (b.m == LOPA_NEG_INF ? 0.f : b.s * expf(b.m - r.m));
  const bool b_first = b.t1 > a.t1 || (b.t1 == a.t1 && b.i1 < a.i1);
  const Stats& hi = b_first ? b : a;
  const Stats& lo = b_first ? a : b;
  r.t1 = hi.t1;
  r.i1 = hi.i1;
  r.t2 = fmaxf(hi.t2, lo.t1);
  return r;
}

LOPA_INLINE void store(float* w, const Stats& st) {
  w[0] = st.m; w[1] = st.s; w[2] = st.t1; w[3] = st.t2; w[4] = __int_as_float(st.i1);
}

LOPA_INLINE Stats load(const float* w) {
  Stats st;
  st.m = w[0]; st.s = w[1]; st.t1 = w[2]; st.t2 = w[3]; st.i1 = __float_as_int(w[4]);
  return st;
}

LOPA_INLINE float lse_of(const Stats& st) { return st.m + logf(st.s); }  // all -inf: m = -inf, s = 0 -> -inf

// token, p_max, margin (p_top1 - p_top2) and lse of one row from its final Stats.
LOPA_INLINE void write_row(const Stats& st, int row, long long* token, float* p_max, float* margin, float* lse) {
  const float l = lse_of(st);
  const float p1 = expf(st.t1 - l), p2 = expf(st.t2 - l);
  token[row] = st.i1 == kNoIndex ? 0 : st.i1;
  p_max[row] = p1;
  margin[row] = p1 - p2;
  lse[row] = l;
}

// sum of a row's S per-split partials, in split order (deterministic)
LOPA_INLINE float sum_splits(const float* __restrict__ ws_row, int S) {
  float acc = 0.f;
  for (int s2 = 0; s2 < S; ++s2) acc += ws_row[s2];
  return acc;
}

}  // namespace vocab
}  // namespace lopa
