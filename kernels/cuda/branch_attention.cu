// branch_attention: B branch windows attend to one shared committed prefix plus their own window.
// Semantics: lopa_fast.reference.ops.branch_attention (fp32 accumulate, natural-log lse).
//
//   q       [B, n, Hq, D]    (last dim contiguous; strides in elements)
//   k/v     prefix [Lmax, Hkv, D] rows [0, cache_len) ; window [B, n, Hkv, D]
//   cache_len_dev: null (cache_len is the prefix length) or a device int64 holding it (cache_len is then Lmax and
//           the splits cover Lmax, so a captured CUDA graph replays any prefix length)
//   cache_index: null, or [B] int64 (POOLED form): k/v prefix is then a pool [S, Lmax, Hkv, D] (slot stride
//           kc_ss), cache_len_dev the [S] slot lengths and cache_len Lmax; branch b reads slot cache_index[b]
//   win_lens [B] int64 or null ; block_ids [B, n] int64 or null ; mode LOPA_MODE_{FULL,BLOCK_CAUSAL,CAUSAL}
//
// Two launches (the host side is lopa_fast/ops/cuda/launch.py; tile sizes and mode codes arrive as -D defines
// from lopa_fast/ops/cuda/constants.py and lopa_fast/reference/attention_modes.py):
//  1. branch_attention_partial: grid (x tiles, Hkv, S + 1). For z < S the CTA takes R query rows from
//     the rows of ALL branches of kv head h (row = ((b*n + i)*G + g), G = Hq/Hkv), so one prefix K/V
//     tile brought into shared memory serves up to R (branch, position, head-in-group) queries; the
//     prefix is cut into S splits along its length (flash-decoding) to fill the machine. z == S is the
//     window part: R rows of ONE branch against that branch's window keys under the mask. Each CTA
//     writes its normalised partial output and its log-sum-exp to an fp32 workspace.
//     bf16/fp16: tensor cores, R = 64 rows x 64-key tiles (attn::mma); fp32: SIMT, R = 32 x 32 (attn).
//     Pooled form: a prefix CTA takes rows of ONE branch (its slot's K/V base and length), and the host sizes the
//     splits as for B = 1, so every row is bitwise the single-request call on its slot whatever shares the call.
//  2. branch_attention_combine: merges the S + 1 partials of every row by log-sum-exp, writes o in T.
//
// Bytes per call (Dream-7B, B=3, n=32, L=2048, bf16): prefix K+V 4 MiB read once per 64-row tile
// (from L2 after the first), window 0.2 MiB, workspace (S+1)*B*n*Hq*D*4 written and read back.
// FLOPs: 4 * B*n*Hq * (L + n) * D (QK^T and PV) = 2.9 GFLOP at that shape.
#include "common.cuh"

namespace lopa {
namespace attn {

constexpr int kWarps = LOPA_ATTN_WARPS;
constexpr int kRowsPerWarp = LOPA_ATTN_ROWS_PER_WARP;
constexpr int kRows = kWarps * kRowsPerWarp;  // query rows per CTA
constexpr int kKeys = LOPA_ATTN_KEYS;          // keys per tile: one per lane in Q*K^T
static_assert(kKeys == 32, "the SIMT kernel gives each lane one key of a tile");
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared memory: Q (fp32, pre-scaled), a K tile padded by 16 bytes per key (the 16-byte reads of 8
// consecutive lanes then hit 8 different bank groups), a V tile, and the per-warp probabilities.
template <typename T, int D> struct Smem {
  static constexpr int kKStride = D + Vec<T>::N;
  static constexpr int kQBytes = kRows * D * 4;
  static constexpr int kKBytes = kKeys * kKStride * (int)sizeof(T);
  static constexpr int kVBytes = kKeys * D * (int)sizeof(T);
  static constexpr int kPBytes = kWarps * kRowsPerWarp * kKeys * 4;
  static constexpr int kBytes = kQBytes + kKBytes + kVBytes + kPBytes;
};

// Copies keys [k0, k0 + 32) of one head into shared memory (zeros past n_keys), 16 bytes per thread-step.
template <typename T, int D>
LOPA_INLINE void load_kv_tile(const T* __restrict__ k, const T* __restrict__ v, long long key_stride, int k0,
                              int n_keys, T* ks, T* vs) {
  constexpr int E = Vec<T>::N, C = D / E;
  for (int idx = threadIdx.x; idx < kKeys * C; idx += kThreads) {
    const int j = idx / C, c = (idx % C) * E;
    uint4 kv = {0u, 0u, 0u, 0u}, vv = {0u, 0u, 0u, 0u};
    if (k0 + j < n_keys) {
      const long long off = (long long)(k0 + j) * key_stride + c;
      kv = *vptr<const uint4>(k + off);
      vv = *vptr<const uint4>(v + off);
    }
    *vptr<uint4>(ks + j * Smem<T, D>::kKStride + c) = kv;
    *vptr<uint4>(vs + j * D + c) = vv;
  }
}

// The arguments of branch_attention_partial (the entry points pack them; both kernel variants read them).
template <typename T> struct Args {
  const T *q, *k_cache, *v_cache, *k_win, *v_win;
  const long long *win_lens, *block_ids;
  const long long* cache_len_dev;  // null: cache_len is the prefix length; else the device length, cache_len Lmax
  float *ws_o, *ws_lse;
  int B, n, Hq, Hkv, cache_len, n_splits, split_len, mode;
  float scale;
  long long q_sb, q_si, q_sh, kc_sl, kc_sh, kw_sb, kw_si, kw_sh;
  const long long* cache_index;  // null, or [B] pool slots (cache_len_dev then holds one length per slot)
  long long kc_ss;               // pool slot stride (elements)
};

// The query rows [row_begin, row_end) and keys of one CTA: grid (x row tiles, y kv head, z split); z == n_splits
// is the window part (rows of ONE branch against its window keys), z < n_splits a slice of the shared prefix.
template <typename T> struct Plan {
  bool window, block_causal, causal;  // the masks apply to the window part only
  int b_win, row_begin, row_end, n_keys;
  const T *kb, *vb;
  long long key_stride;
};

// Fills `p` for this CTA (`rows` query rows per CTA); false when the CTA has no work. POOLED (a separate entry
// point, so the shared-prefix kernels compile exactly as before): prefix CTAs take the rows of ONE branch, tiled
// as for that branch alone, on its pool slot cache_index[b] (K/V base and length cache_len_dev[slot]).
template <typename T, bool POOLED>
LOPA_INLINE bool plan_cta(const Args<T>& a, int rows, Plan<T>& p) {
  const int h = blockIdx.y, split = blockIdx.z;
  const int rows_per_branch = a.n * (a.Hq / a.Hkv), tiles_per_branch = (rows_per_branch + rows - 1) / rows;
  p.window = split == a.n_splits;
  p.block_causal = p.window && a.mode == LOPA_MODE_BLOCK_CAUSAL;
  p.causal = p.window && a.mode == LOPA_MODE_CAUSAL;
  p.b_win = 0;
  if (p.window) {
    if ((int)blockIdx.x >= a.B * tiles_per_branch) return false;
    p.b_win = blockIdx.x / tiles_per_branch;
    p.row_begin = p.b_win * rows_per_branch + (blockIdx.x % tiles_per_branch) * rows;
    p.row_end = (p.b_win + 1) * rows_per_branch;
    const int len = a.win_lens ? (int)a.win_lens[p.b_win] : a.n;
    p.n_keys = len < a.n ? (len > 0 ? len : 0) : a.n;  // as the reference: keys j < min(len, n)
    p.kb = a.k_win + p.b_win * a.kw_sb + h * a.kw_sh;
    p.vb = a.v_win + p.b_win * a.kw_sb + h * a.kw_sh;
    p.key_stride = a.kw_si;
  } else if (POOLED) {
    if ((int)blockIdx.x >= a.B * tiles_per_branch) return false;
    const int b = blockIdx.x / tiles_per_branch;
    p.row_begin = b * rows_per_branch + (blockIdx.x % tiles_per_branch) * rows;
    p.row_end = (b + 1) * rows_per_branch;
    const long long slot = a.cache_index[b];
    const long long d = a.cache_len_dev[slot];  // splits were sized for Lmax = a.cache_len; those past d are empty
    const int cl = d < 0 ? 0 : (d < a.cache_len ? (int)d : a.cache_len);
    const int key_begin = split * a.split_len, left = cl - key_begin;
    p.n_keys = left < a.split_len ? (left > 0 ? left : 0) : a.split_len;  // 0 keys: l = 0, lse = -inf (weight 0)
    p.kb = a.k_cache + slot * a.kc_ss + key_begin * a.kc_sl + h * a.kc_sh;
    p.vb = a.v_cache + slot * a.kc_ss + key_begin * a.kc_sl + h * a.kc_sh;
    p.key_stride = a.kc_sl;
  } else {
    p.row_begin = blockIdx.x * rows;
    p.row_end = a.B * rows_per_branch;
    if (p.row_begin >= p.row_end) return false;
    const int key_begin = split * a.split_len;
    int cl = a.cache_len;
    if (a.cache_len_dev) {  // graph-safe: splits were sized for Lmax = a.cache_len; those past the length are empty
      const long long d = *a.cache_len_dev;
      cl = d < 0 ? 0 : (d < a.cache_len ? (int)d : a.cache_len);
    }
    const int left = cl - key_begin;
    p.n_keys = left < a.split_len ? (left > 0 ? left : 0) : a.split_len;  // 0 keys: l = 0, lse = -inf (weight 0)
    p.kb = a.k_cache + key_begin * a.kc_sl + h * a.kc_sh;
    p.vb = a.v_cache + key_begin * a.kc_sl + h * a.kc_sh;
    p.key_stride = a.kc_sl;
  }
  return true;
}

// Block id of window position i of the plan's branch (block ids fit in 32 bits: a window holds a few hundred).
template <typename T>
LOPA_INLINE int block_of(const Args<T>& a, const Plan<T>& p, int i) {
  return (int)a.block_ids[(long long)p.b_win * a.n + i];
}

template <typename T, int D, bool POOLED>
LOPA_INLINE void partial(const Args<T>& a) {
  constexpr int E = Vec<T>::N, DPL = D / 32;
  using S = Smem<T, D>;
  Plan<T> pl;
  if (!plan_cta<T, POOLED>(a, kRows, pl)) return;
  const int G = a.Hq / a.Hkv, h = blockIdx.y, split = blockIdx.z, n = a.n, Hq = a.Hq;
  const int row_begin = pl.row_begin, row_end = pl.row_end, n_keys = pl.n_keys;

  LOPA_DYNAMIC_SMEM(smem);
  float* qs = reinterpret_cast<float*>(smem);
  T* ks = reinterpret_cast<T*>(smem + S::kQBytes);
  T* vs = reinterpret_cast<T*>(smem + S::kQBytes + S::kKBytes);
  float* ps = reinterpret_cast<float*>(smem + S::kQBytes + S::kKBytes + S::kVBytes);

  // Q rows, scaled by scale*log2(e) so the softmax runs on exp2.
  const float qscale = a.scale * kLog2e;
  for (int idx = threadIdx.x; idx < kRows * (D / E); idx += kThreads) {
    const int r = idx / (D / E), c = (idx % (D / E)) * E, row = row_begin + r;
    float f[E];
    if (row < row_end) {
      const int bi = row / G, g = row % G;
      load_vec(a.q + (long long)(bi / n) * a.q_sb + (long long)(bi % n) * a.q_si + (long long)(h * G + g) * a.q_sh + c,
               f);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) qs[r * D + c + e] = f[e] * qscale;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Window position of each of this warp's rows (for the causal / block-causal masks).
  int qi[kRowsPerWarp];
  int qblock[kRowsPerWarp];  // block ids fit in 32 bits (a window holds at most a few hundred positions)
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = row_begin + warp * kRowsPerWarp + r;
    qi[r] = row < row_end ? (row / G) % n : 0;
    qblock[r] = pl.block_causal ? block_of(a, pl, qi[r]) : 0;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = LOPA_NEG_INF;
    l[r] = 0.f;
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[r][d] = 0.f;
  }
  float* pw = ps + warp * kRowsPerWarp * kKeys;

  for (int k0 = 0; k0 < n_keys; k0 += kKeys) {
    __syncthreads();  // Q written / previous tile fully consumed
    load_kv_tile<T, D>(pl.kb, pl.vb, pl.key_stride, k0, n_keys, ks, vs);
    __syncthreads();

    // S = Q K^T: lane owns key k0 + lane, the warp's 8 rows come from shared memory as broadcasts.
    float s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.f;
    const T* krow = ks + lane * S::kKStride;
#pragma unroll 4
    for (int c = 0; c < D; c += E) {
      float kf[E];
      load_vec(krow + c, kf);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float* qr = qs + (warp * kRowsPerWarp + r) * D + c;
#pragma unroll
        for (int e = 0; e < E; e += 4) {
          const float4 qv = *vptr<const float4>(qr + e);
          s[r] += qv.x * kf[e] + qv.y * kf[e + 1] + qv.z * kf[e + 2] + qv.w * kf[e + 3];
        }
      }
    }

    const int key = k0 + lane;
    int kblock = 0;
    if (pl.block_causal && key < n_keys) kblock = block_of(a, pl, key);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      bool vis = key < n_keys;
      if (pl.causal) vis = vis && key <= qi[r];
      if (pl.block_causal) vis = vis && kblock <= qblock[r];
      const float x = vis ? s[r] : LOPA_NEG_INF;
      const float m_new = fmaxf(m[r], warp_max(x));
      float p = 0.f, alpha = 1.f;
      if (m_new != LOPA_NEG_INF) {  // warp-uniform: some key of this row is visible
        p = exp2f(x - m_new);
        alpha = exp2f(m[r] - m_new);
      }
      l[r] = l[r] * alpha + warp_sum(p);
      m[r] = m_new;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[r][d] *= alpha;
      pw[r * kKeys + lane] = p;
    }
    __syncwarp();

    // O += P V: lane owns output dims [lane*DPL, lane*DPL + DPL).
    const int kmax = n_keys - k0 < kKeys ? n_keys - k0 : kKeys;
    for (int j = 0; j < kmax; ++j) {
      float vf[DPL];
      LoadN<T, DPL>::run(vs + j * D + lane * DPL, vf);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float p = pw[r * kKeys + j];
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[r][d] += p * vf[d];
      }
    }
  }

  const long long rows_total = (long long)a.B * n * Hq;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = row_begin + warp * kRowsPerWarp + r;
    if (row >= row_end) continue;  // not `break`: keeps the loop unrolled and acc[][] in registers
    const int bi = row / G, g = row % G;
    const long long orow = (long long)bi * Hq + h * G + g;
    const bool any = l[r] > 0.f;
    const float inv = any ? 1.f / l[r] : 0.f;
    float* o = a.ws_o + ((long long)split * rows_total + orow) * D + lane * DPL;
#pragma unroll
    for (int d = 0; d < DPL; ++d) o[d] = acc[r][d] * inv;
    if (lane == 0) a.ws_lse[split * rows_total + orow] = any ? (m[r] + log2f(l[r])) * kLn2 : LOPA_NEG_INF;
  }
}

// Tensor-core variant for bf16/fp16 (mma.sync m16n8k16, fp32 accumulate), FlashAttention-2 style: each of
// the 4 warps owns 16 query rows (64 per CTA), a tile is 64 keys. S = Q K^T with Q fragments held in registers
// for the whole key loop, online softmax on the S fragments (a row lives in one quad of lanes), P re-packed
// to 16 bit in registers as the A operand of O += P V. K is staged row-major with 16 bytes of padding per key
// and V transposed ([D][keys + 8]), so every B-fragment read is one conflict-free 32-bit shared load.
namespace mma {
constexpr int kWarps = LOPA_MMA_WARPS;
constexpr int kRows = 16 * kWarps;  // one m16 row block per warp
constexpr int kKeys = LOPA_MMA_KEYS;
static_assert(kKeys % 16 == 0, "P V consumes keys in k16 steps");
constexpr int kThreads = 32 * kWarps;

template <int D> struct Smem {
  static constexpr int kKStride = D + 8;      // 16-bit elements per staged key row
  static constexpr int kVStride = kKeys + 8;  // 16-bit elements per staged (transposed) V row
  static constexpr int kKBytes = kKeys * kKStride * 2;
  static constexpr int kBytes = kKBytes + D * kVStride * 2;
};

LOPA_INLINE unsigned ld32(const unsigned short* p) { return *vptr<const unsigned>(p); }

template <typename T, int D, bool POOLED>
LOPA_INLINE void partial(const Args<T>& a) {
  using S = Smem<D>;
  constexpr int KS = D / 16, NTD = D / 8, NTK = kKeys / 8;
  Plan<T> pl;
  if (!plan_cta<T, POOLED>(a, kRows, pl)) return;
  const int G = a.Hq / a.Hkv, h = blockIdx.y, split = blockIdx.z, n = a.n, Hq = a.Hq;
  const int row_begin = pl.row_begin, row_end = pl.row_end, n_keys = pl.n_keys;

  LOPA_DYNAMIC_SMEM(smem);
  unsigned short* ks = reinterpret_cast<unsigned short*>(smem);
  unsigned short* vt = reinterpret_cast<unsigned short*>(smem + S::kKBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;

  // This thread's two rows (g and g + 8 of the warp's 16) and their Q fragments.
  bool valid[2];
  int qi[2], qblk[2];
  long long orow[2];
  unsigned qa[KS][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_begin + warp * 16 + g + 8 * r;
    valid[r] = row < row_end;
    const int bi = valid[r] ? row / G : 0, gg = valid[r] ? row % G : 0;
    qi[r] = bi % n;
    qblk[r] = (pl.block_causal && valid[r]) ? block_of(a, pl, qi[r]) : 0;
    orow[r] = (long long)bi * Hq + h * G + gg;
    const unsigned short* qp = reinterpret_cast<const unsigned short*>(
        a.q + (long long)(bi / n) * a.q_sb + (long long)(bi % n) * a.q_si + (long long)(h * G + gg) * a.q_sh);
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      qa[k][r] = valid[r] ? ld32(qp + k * 16 + 2 * t) : 0u;          // a0 / a1: cols 2t, 2t+1
      qa[k][2 + r] = valid[r] ? ld32(qp + k * 16 + 8 + 2 * t) : 0u;  // a2 / a3: cols 2t+8, 2t+9
    }
  }

  const float sl2 = a.scale * kLog2e;
  float m[2] = {LOPA_NEG_INF, LOPA_NEG_INF}, l[2] = {0.f, 0.f};
  float o[NTD][4];
#pragma unroll
  for (int d = 0; d < NTD; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

  for (int k0 = 0; k0 < n_keys; k0 += kKeys) {
    __syncthreads();  // previous tile fully consumed
    constexpr int C = D / 8;
    for (int idx = threadIdx.x; idx < kKeys * C; idx += kThreads) {
      const int j = idx / C, c = (idx % C) * 8;
      uint4 kv = {0u, 0u, 0u, 0u}, vv = {0u, 0u, 0u, 0u};
      if (k0 + j < n_keys) {
        const long long off = (long long)(k0 + j) * pl.key_stride + c;
        kv = *vptr<const uint4>(pl.kb + off);
        vv = *vptr<const uint4>(pl.vb + off);
      }
      *vptr<uint4>(ks + j * S::kKStride + c) = kv;
      const unsigned w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        vt[(c + 2 * e) * S::kVStride + j] = (unsigned short)(w[e] & 0xffffu);
        vt[(c + 2 * e + 1) * S::kVStride + j] = (unsigned short)(w[e] >> 16);
      }
    }
    __syncthreads();

    float sc[NTK][4];
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
      const unsigned short* kr = ks + (nt * 8 + g) * S::kKStride + 2 * t;
#pragma unroll
      for (int k = 0; k < KS; ++k) {
        const unsigned bk[2] = {ld32(kr + k * 16), ld32(kr + k * 16 + 8)};
        mma_16816<T>(sc[nt], qa[k], bk, sc[nt]);
      }
    }

    float mx[2] = {LOPA_NEG_INF, LOPA_NEG_INF};
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + nt * 8 + 2 * t + (e & 1), r = e >> 1;
        bool vis = key < n_keys;
        if (pl.causal) vis = vis && key <= qi[r];
        if (pl.block_causal && vis) vis = block_of(a, pl, key) <= qblk[r];
        sc[nt][e] = vis ? sc[nt][e] * sl2 : LOPA_NEG_INF;
        mx[r] = fmaxf(mx[r], sc[nt][e]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);
      const float alpha = m_new == LOPA_NEG_INF ? 1.f : exp2f(m[r] - m_new);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int d = 0; d < NTD; ++d) {
        o[d][2 * r] *= alpha;
        o[d][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float p = m[r] == LOPA_NEG_INF ? 0.f : exp2f(sc[nt][e] - m[r]);
        sc[nt][e] = p;
        l[r] += p;  // this thread's columns only; the quad is summed once at the end
      }
    }

#pragma unroll
    for (int j = 0; j < kKeys / 16; ++j) {
      const unsigned pa[4] = {pack2(sc[2 * j][0], sc[2 * j][1], T{}), pack2(sc[2 * j][2], sc[2 * j][3], T{}),
                              pack2(sc[2 * j + 1][0], sc[2 * j + 1][1], T{}),
                              pack2(sc[2 * j + 1][2], sc[2 * j + 1][3], T{})};
#pragma unroll
      for (int d = 0; d < NTD; ++d) {
        const unsigned short* vr = vt + (d * 8 + g) * S::kVStride + j * 16 + 2 * t;
        const unsigned bv[2] = {ld32(vr), ld32(vr + 8)};
        mma_16816<T>(o[d], pa, bv, o[d]);
      }
    }
  }

  const long long rows_total = (long long)a.B * n * Hq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    if (!valid[r]) continue;
    const bool any = l[r] > 0.f;
    const float inv = any ? 1.f / l[r] : 0.f;
    float* out = a.ws_o + ((long long)split * rows_total + orow[r]) * D + 2 * t;
#pragma unroll
    for (int d = 0; d < NTD; ++d) {
      float2 v2;
      v2.x = o[d][2 * r] * inv;
      v2.y = o[d][2 * r + 1] * inv;
      *vptr<float2>(out + d * 8) = v2;
    }
    if (t == 0) a.ws_lse[split * rows_total + orow[r]] = any ? (m[r] + log2f(l[r])) * kLn2 : LOPA_NEG_INF;
  }
}
}  // namespace mma

// One warp per output row: o = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s).
template <typename T, int D>
LOPA_INLINE void combine(const float* __restrict__ ws_o, const float* __restrict__ ws_lse, int n_parts,
                         long long rows, T* __restrict__ out, float* __restrict__ lse_out) {
  constexpr int DPL = D / 32;
  const long long row = (long long)blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float mx = LOPA_NEG_INF;
  for (int s = 0; s < n_parts; ++s) mx = fmaxf(mx, ws_lse[s * rows + row]);
  float o[DPL], wsum = 0.f;
#pragma unroll
  for (int d = 0; d < DPL; ++d) o[d] = 0.f;
  if (mx != LOPA_NEG_INF) {
    for (int s = 0; s < n_parts; ++s) {
      const float w = expf(ws_lse[s * rows + row] - mx);
      if (w == 0.f) continue;
      wsum += w;
      const float* src = ws_o + (s * rows + row) * D + lane * DPL;
#pragma unroll
      for (int d = 0; d < DPL; ++d) o[d] += w * src[d];
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
  for (int d = 0; d < DPL; ++d) out[row * D + lane * DPL + d] = From<T>::cvt(o[d] * inv);
  if (lse_out && lane == 0) lse_out[row] = wsum > 0.f ? mx + logf(wsum) : LOPA_NEG_INF;
}

}  // namespace attn
}  // namespace lopa

// fp32 (a testing dtype) runs the SIMT kernel; bf16/fp16 the tensor-core one. Host side (lopa_fast/ops/cuda/launch.py):
// rows per CTA attn::kRows / attn::mma::kRows, dynamic shared memory attn::Smem / attn::mma::Smem (the host's
// attention_smem_bytes; tests/test_cuda_loader.py checks the two agree).
#define LOPA_ATTN_PARTIAL(NAME, T, D, IMPL, BOUNDS, POOLED)                                                           \
  extern "C" __global__ void __launch_bounds__ BOUNDS NAME(                                                      \
      const T* q, const T* k_cache, const T* v_cache, const T* k_win, const T* v_win, const long long* win_lens, \
      const long long* block_ids, const long long* cache_len_dev, float* ws_o, float* ws_lse, int B, int n,    \
      int Hq, int Hkv, int cache_len, int n_splits, int split_len, int mode, float scale, long long q_sb,        \
      long long q_si, long long q_sh, long long kc_sl, long long kc_sh, long long kw_sb, long long kw_si,        \
      long long kw_sh, const long long* cache_index, long long kc_ss) {                                          \
    IMPL<T, D, POOLED>(lopa::attn::Args<T>{q, k_cache, v_cache, k_win, v_win, win_lens, block_ids, cache_len_dev, \
                                           ws_o, ws_lse, B, n, Hq, Hkv, cache_len, n_splits, split_len, mode,    \
                                           scale, q_sb, q_si, q_sh, kc_sl, kc_sh, kw_sb, kw_si, kw_sh,           \
                                           cache_index, kc_ss});                                                 \
  }

// Per (dtype, head dim): the shared-prefix partial, the pooled partial (`cache_index` non-null) and the combine.
// BOUNDS: the shared-prefix partial keeps __launch_bounds__(THREADS) (ptxas: 191 / 127 registers at D = 128 / 64,
// no spills; adding a minimum of 1 CTA/SM changes its allocation to 204 / 145). The pooled partial with the bare
// bound was held at 128 registers at D = 64 and spilled 40-44 B; with a minimum of 2 CTAs/SM it takes 204 / 145
// registers (fp32: 156 / 142) and spills nothing (bench/results/cuda_resources.md).
#define LOPA_ATTN_ENTRIES(TNAME, T, D, IMPL, THREADS)                                                          \
  LOPA_ATTN_PARTIAL(branch_attention_partial_##TNAME##_d##D, T, D, IMPL, (THREADS), false)                      \
  LOPA_ATTN_PARTIAL(branch_attention_pooled_partial_##TNAME##_d##D, T, D, IMPL, (THREADS, 2), true)                \
  extern "C" __global__ void __launch_bounds__(lopa::attn::kThreads) branch_attention_combine_##TNAME##_d##D(    \
      const float* ws_o, const float* ws_lse, int n_parts, long long rows, T* out, float* lse_out) {             \
    lopa::attn::combine<T, D>(ws_o, ws_lse, n_parts, rows, out, lse_out);                                        \
  }

LOPA_ATTN_ENTRIES(f32, float, 64, lopa::attn::partial, lopa::attn::kThreads)
LOPA_ATTN_ENTRIES(f32, float, 128, lopa::attn::partial, lopa::attn::kThreads)
LOPA_ATTN_ENTRIES(bf16, lopa::bf16, 64, lopa::attn::mma::partial, lopa::attn::mma::kThreads)
LOPA_ATTN_ENTRIES(bf16, lopa::bf16, 128, lopa::attn::mma::partial, lopa::attn::mma::kThreads)
LOPA_ATTN_ENTRIES(f16, lopa::f16, 64, lopa::attn::mma::partial, lopa::attn::mma::kThreads)
LOPA_ATTN_ENTRIES(f16, lopa::f16, 128, lopa::attn::mma::partial, lopa::attn::mma::kThreads)
