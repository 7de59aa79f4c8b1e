// select_round: a D2F / LoPA round's selection and bookkeeping after its token statistics, as one launch.
// Semantics: lopa_fast/reference/ops.py::select_round (the oracle); csrc/select_round_cpu.cpp is the same rules
// sequentially. Every output is bit-identical to the reference: scores are the lowest-k confidences (stable
// ascending, NaN last) summed in double, rounded once to float, divided by k in float (IEEE, no fast-math),
// blended in double with explicit __dmul_rn / __dadd_rn (no FMA contraction).
//
//   ptrs SrPtrs, by value (504 bytes of the 4 KB parameter space): the data pointers of the 35 inputs then the
//        28 outputs, in reference order (as csrc/bindings). A kernel parameter, not a device table: a launch needs
//        no host-to-device copy, so a CUDA graph captures it (the pointers are baked into the graph node, as are
//        every other kernel's tensor arguments)
//   ws   bytes: scratch sized by lopa_fast.ops.cuda.launch.select_round_ws_bytes (value-independent: capturable)
//   dims: NB slots, Lb1 row positions, G1 blocks, Nb window columns, bs, mask_id, eos_id, n_look, flags
//         (bit 0 shift, bit 1 blend, bit 2 score_all)
//
// One CTA per request (the op takes one request; grid (1,1,1)), LOPA_SR_THREADS threads. Element-wise work
// (window gather, per-slot scores, per-block fill rule, copies, the plan's masks) is spread over the threads;
// the order-dependent steps (the need scan, the winner, the spawn ranking, the block-state chain) run on thread 0
// with block barriers between phases: they are O(NB * Nb) on rounds of <= 9 slots x a few hundred columns.
#include "common.cuh"

namespace lopa {
namespace sr {

constexpr int kThreads = LOPA_SR_THREADS;
constexpr long long ACTIVE = 0, TO_CACHE = 1, IN_CACHE = 2;
constexpr int kInputs = LOPA_SR_INPUTS, kOutputs = LOPA_SR_OUTPUTS;  // the IN / OUT indices below


LOPA_INLINE bool is_nan(float a) { return a != a; }
LOPA_INLINE bool is_nan(double a) { return a != a; }
// torch's sort(ascending): NaN after everything
LOPA_INLINE bool ascending(float a, float b) { return is_nan(a) ? false : (is_nan(b) ? true : a < b); }
// torch's sort(descending): NaN first
LOPA_INLINE bool descending(float a, float b) { return is_nan(b) ? false : (is_nan(a) ? true : a > b); }
LOPA_INLINE float nan_max(float a, float b) { return (is_nan(a) || is_nan(b)) ? a + b : (a > b ? a : b); }
LOPA_INLINE double nan_max(double a, double b) { return (is_nan(a) || is_nan(b)) ? a + b : (a > b ? a : b); }
LOPA_INLINE long long imin(long long a, long long b) { return a < b ? a : b; }
LOPA_INLINE long long imax(long long a, long long b) { return a > b ? a : b; }

// scratch carve-up; the byte count is select_round_ws_bytes in launch.py (same order, same sizes)
struct Ws {
  long long *csum, *sidx, *xW, *xW0, *mc, *nblk;  // NB*Nb, NB*Nb, Lb1, Lb1, NB*G1, NB
  double* keyw;                                   // NB
  float *rows, *cW, *pW, *keyl;                   // NB*Nb, Nb, Nb, Nb
  int* order;                                     // Nb
  bool *masked, *candW, *thr, *accW, *fb, *base_done, *complete_new;  // NB*Nb, Nb x4, G1, NB*G1
};
LOPA_INLINE Ws carve(unsigned char* p, long long NB, long long L1, long long G1, long long Nb) {
  Ws w;
  auto take = [&p](long long bytes) { unsigned char* r = p; p += (bytes + 7) / 8 * 8; return r; };
  w.csum = (long long*)take(8 * NB * Nb);
  w.sidx = (long long*)take(8 * NB * Nb);
  w.xW = (long long*)take(8 * L1);
  w.xW0 = (long long*)take(8 * L1);
  w.mc = (long long*)take(8 * NB * G1);
  w.nblk = (long long*)take(8 * NB);
  w.keyw = (double*)take(8 * NB);
  w.rows = (float*)take(4 * NB * Nb);
  w.cW = (float*)take(4 * Nb);
  w.pW = (float*)take(4 * Nb);
  w.keyl = (float*)take(4 * Nb);
  w.order = (int*)take(4 * Nb);
  w.masked = (bool*)take(NB * Nb);
  w.candW = (bool*)take(Nb);
  w.thr = (bool*)take(Nb);
  w.accW = (bool*)take(Nb);
  w.fb = (bool*)take(Nb);
  w.base_done = (bool*)take(G1);
  w.complete_new = (bool*)take(NB * G1);
  return w;
}

}  // namespace sr
}  // namespace lopa

// the kernel's pointer table, passed by value (lopa_fast.ops.cuda.launch.run_select_round packs it: kind "t")
struct SrPtrs {
  long long p[lopa::sr::kInputs + lopa::sr::kOutputs];
};

// read from shared memory at each use: a barrier forces a reload, so ~60 pointers are not held live in registers
// across the kernel (held in registers, they spilled: 96 registers + 24 bytes of spills under ptxas)
#define IN(T, k) ((const T*)s_ptr[k])
#define OUT(T, k) ((T*)s_ptr[kInputs + (k)])

extern "C" __global__ void __launch_bounds__(LOPA_SR_THREADS)
    select_round_kernel(const SrPtrs ptrs, unsigned char* __restrict__ wsp, long long NB,
                        long long L1, long long G1, long long Nb, long long bs, long long mask_id, long long eos_id,
                        long long n_look, int flags) {
  using namespace lopa::sr;
  const bool shift = flags & 1, blend = flags & 2, score_all = flags & 4;
  const int tid = threadIdx.x;
  const long long G = G1 - 1;
  const float inf = __int_as_float(0x7f800000);
  constexpr int kPtrs = kInputs + kOutputs;
  __shared__ long long s_ptr[kPtrs];
  __shared__ Ws w;
  for (int k = tid; k < kPtrs; k += kThreads) s_ptr[k] = ptrs.p[k];
  if (tid == 0) w = carve(wsp, NB, L1, G1, Nb);
  __syncthreads();
  // inputs, in reference order
#define conf IN(float, 0)
#define token IN(long long, 1)
#define p_in IN(float, 2)
#define x_in IN(long long, 3)
#define n_blocks_in IN(long long, 4)
#define block_state_in IN(long long, 5)
#define complete_in IN(bool, 6)
#define eos_in IN(bool, 7)
#define alive_in IN(bool, 8)
#define creation_conf_in IN(double, 9)
#define counts_in IN(long long, 11)
#define exists_in IN(bool, 12)
#define active_in IN(bool, 13)
#define running_in IN(bool, 14)
#define is_mask_in IN(bool, 15)
#define lens_in IN(long long, 16)
#define to_cache_in IN(bool, 17)
  const long long shared_end_in = *IN(long long, 18);
  const long long layout_slot_in = *IN(long long, 19);
  const long long commit_len_in = *IN(long long, 20);
#define win_pos IN(long long, 21)
#define win_valid IN(bool, 22)
#define need_flat IN(bool, 23)
  const long long P = *IN(long long, 24);
#define gen_pos IN(long long, 25)
#define block_start IN(long long, 26)
#define block_end IN(long long, 27)
#define pos_block IN(long long, 28)
#define in_block IN(bool, 29)
#define lowest_k IN(long long, 30)
#define grow_table IN(bool, 31)
#define activate_table IN(bool, 32)
  const double tau_d = *IN(double, 33);
  const double alpha = *IN(double, 34);
  // outputs
#define o_winner OUT(long long, 0)
#define o_score OUT(double, 1)
#define o_last_row OUT(long long, 2)
#define o_accepted OUT(bool, 3)
#define o_tokens OUT(long long, 4)
#define o_x OUT(long long, 5)
#define o_eos OUT(bool, 6)
#define o_alive OUT(bool, 7)
#define o_cc OUT(double, 8)
#define o_look_pos OUT(long long, 9)
#define o_state OUT(long long, 10)
#define o_counts OUT(long long, 11)
#define o_n_blocks OUT(long long, 12)
#define o_complete OUT(bool, 13)
#define o_exists OUT(bool, 14)
#define o_active OUT(bool, 15)
#define o_running OUT(bool, 16)
#define o_done OUT(bool, 17)
#define o_is_mask OUT(bool, 18)
#define o_need OUT(bool, 19)
#define o_lens OUT(long long, 20)
#define o_wlens OUT(long long, 21)
#define o_to_cache OUT(bool, 22)
#define o_shared_end OUT(long long, 23)
#define o_layout_slot OUT(long long, 24)
#define o_start OUT(long long, 25)
#define o_commit_len OUT(long long, 26)
#define o_head OUT(long long, 27)

  __shared__ long long s_W, s_nA, s_nvalid, s_s, s_u;
  __shared__ bool s_eosW;

  // ---- select: the table row predicting each window position (inclusive scan of need_flat: thread 0)
  if (tid == 0) {
    long long acc = 0;
    for (long long f = 0; f < NB * Nb; ++f) w.csum[f] = acc += need_flat[f];
    long long nA = 0;
    for (long long b = 0; b < NB; ++b) nA += alive_in[b];
    s_nA = nA;
  }
  __syncthreads();
  for (long long f = tid; f < NB * Nb; f += kThreads) {
    const long long b = f / Nb, i = f % Nb;
    w.sidx[f] = shift ? (i == 0 ? 0 : w.csum[f - 1]) : imax(w.csum[f] - 1, 0);
    w.masked[f] = is_mask_in[b * L1 + win_pos[i]] && win_valid[i];
  }
  __syncthreads();
  // ---- scores: one thread per slot (stable insertion sort of its row: ascending, NaN last)
  const bool scored = !(NB == 1 && !score_all);
  if (scored) {
    for (long long b = tid; b < NB; b += kThreads) {
      float* row = w.rows + b * Nb;
      long long m = 0;
      for (long long i = 0; i < Nb; ++i) {
        const bool mk = w.masked[b * Nb + i];
        m += mk;
        const float v = mk ? conf[w.sidx[b * Nb + i]] : inf;
        long long j = i;
        while (j > 0 && ascending(v, row[j - 1])) {  // strict: equal keys keep their order (stable)
          row[j] = row[j - 1];
          --j;
        }
        row[j] = v;
      }
      const long long kk = lowest_k[m];
      double sum = 0.0;
      for (long long i = 0; i < imin(kk, Nb); ++i) sum += (double)row[i];
      const float low = (float)sum / (float)kk;
      const double future = m > 0 ? (double)low : 1.0;
      double score = blend ? __dadd_rn(__dmul_rn(alpha, creation_conf_in[b]), __dmul_rn(1.0 - alpha, future))
                           : future;
      if (lens_in[b] <= shared_end_in) score = 1.0;
      o_score[b] = score;
      w.keyw[b] = running_in[b] ? score : -(double)inf;
    }
  } else if (tid == 0) {
    o_score[0] = 0.0;
  }
  __syncthreads();
  if (tid == 0) {
    long long W = 0;
    if (scored) {
      double best = w.keyw[0];
      for (long long b = 1; b < NB; ++b) best = nan_max(best, w.keyw[b]);
      W = NB;
      for (long long b = 0; b < NB; ++b)
        if (w.keyw[b] == best) { W = b; break; }
      W = imin(W, NB - 1);  // NaN scores: the last slot (the driver refuses the round after its host read)
    }
    s_W = W;
    *o_winner = W;
    *o_last_row = shift ? w.csum[W * Nb + imax(commit_len_in - 1, 0)] : 0;
  }
  __syncthreads();
  const long long W = s_W;
  const bool* actWb = active_in + W * G1;
  // ---- the D2F fill rule on the winner only
  const float tau = (float)tau_d;  // the knob rounded to p's float32, as torch does
  for (long long i = tid; i < Nb; i += kThreads) {
    const long long r = w.sidx[W * Nb + i];
    w.cW[i] = conf[r];
    w.pW[i] = p_in[r];
    o_tokens[i] = token[r];
    const long long pb = imin(pos_block[win_pos[i]], G);
    w.candW[i] = w.masked[W * Nb + i] && actWb[pb];
    w.thr[i] = w.candW[i] && w.pW[i] > tau;
    w.fb[i] = false;
  }
  for (long long q = tid; q < L1; q += kThreads) w.xW0[q] = x_in[W * L1 + q];
  __syncthreads();
  for (long long j = tid; j < G1; j += kThreads) {  // one thread per block j
    float best = -inf;
    bool any_cand = false, any_thr = false;
    for (long long i = 0; i < Nb; ++i) {
      const bool ib = in_block[win_pos[i] * G1 + j];
      const bool cb = w.candW[i] && ib;
      best = nan_max(best, cb ? w.cW[i] : -inf);
      any_cand |= cb;
      any_thr |= w.thr[i] && ib;
    }
    if (complete_in[W * G1 + j] && actWb[j] && any_cand && !any_thr)
      for (long long i = 0; i < Nb; ++i) {
        const bool cb = w.candW[i] && in_block[win_pos[i] * G1 + j];
        if (cb && w.cW[i] == best) { w.fb[i] = true; break; }  // benign: blocks write only `true`
      }
  }
  __syncthreads();
  for (long long i = tid; i < Nb; i += kThreads) {
    w.accW[i] = w.thr[i] || w.fb[i];
    o_accepted[i] = w.accW[i];
  }
  for (long long q = tid; q < L1; q += kThreads) w.xW[q] = w.xW0[q];
  __syncthreads();
  if (tid == 0) {  // window positions are distinct; sequential keeps the counters exact and simple
    long long n_thr = 0, n_fb = 0, n_acc = 0, n_eos = 0;
    bool eosW = eos_in[W];
    for (long long i = 0; i < Nb; ++i) {
      n_thr += w.thr[i];
      n_fb += w.fb[i];
      n_acc += w.accW[i];
      const long long q = win_pos[i];
      w.xW[q] = w.accW[i] ? o_tokens[i] : w.xW0[q];
      if (eos_id >= 0 && w.accW[i] && o_tokens[i] == eos_id) { ++n_eos; eosW = true; }
    }
    s_eosW = eosW;
    const long long nA = s_nA;
    long long multi, look_win = 0, grew = 0;
    if (NB == 1) {
      multi = n_acc >= 2;
    } else {
      look_win = W != nA - 1;  // the anchor is the last alive slot
      grew = lens_in[W] != lens_in[layout_slot_in];
      multi = (n_acc + look_win) >= 2;
    }
    // ROUND_COUNTERS order; written out (a local array indexed in a loop would live on the stack)
    o_counts[0] = counts_in[0] + n_thr;
    o_counts[1] = counts_in[1] + n_fb;
    o_counts[2] = counts_in[2] + n_eos;
    o_counts[3] = counts_in[3] + multi;
    o_counts[4] = counts_in[4] + look_win;
    o_counts[5] = counts_in[5];
    o_counts[6] = counts_in[6] + grew;
    o_counts[7] = counts_in[7];
  }
  __syncthreads();
  // ---- the winner's completed blocks; the slots start as copies of the winner
  for (long long j = tid; j < G1; j += kThreads) {
    long long mcj = 0;
    if (j >= 1)
      for (long long t = 0; t < bs; ++t) mcj += w.xW[gen_pos[(j - 1) * bs + t]] == mask_id;
    w.base_done[j] = actWb[j] && mcj == 0;
  }
  for (long long f = tid; f < NB * L1; f += kThreads) o_x[f] = w.xW[f % L1];
  for (long long b = tid; b < NB; b += kThreads) {
    o_eos[b] = s_eosW;
    o_cc[b] = 1.0;
    o_look_pos[b] = -1;
  }
  __syncthreads();
  // ---- spawn (thread 0): lookaheads at the winner's top-n_look remaining masks, ranked by confidence, stable
  if (tid == 0) {
    long long n_valid = 0;
    if (n_look > 0) {
      for (long long i = 0; i < Nb; ++i) {
        const float v = (w.candW[i] && !w.accW[i]) ? w.cW[i] : -inf;
        w.keyl[i] = v;
        long long j = i;
        while (j > 0 && descending(v, w.keyl[w.order[j - 1]])) {
          w.order[j] = w.order[j - 1];
          --j;
        }
        w.order[j] = (int)i;
      }
      for (long long r = 0; r < imin(n_look, Nb); ++r) {
        const long long i = w.order[r];
        if (!(w.candW[i] && !w.accW[i])) continue;
        ++n_valid;
        const long long q = win_pos[i];
        o_x[r * L1 + q] = o_tokens[i];
        o_cc[r] = (double)w.cW[i];
        if (eos_id >= 0 && o_tokens[i] == eos_id) o_eos[r] = true;
        o_look_pos[r] = q;
      }
    }
    s_nvalid = n_valid;
    // new block tables: the cached span -> in_cache; the anchor rule's completions -> to_cache in order
    bool chain = true;
    const bool* existsW = exists_in + W * G1;
    for (long long j = 0; j < G1; ++j) {
      const long long st = to_cache_in[j] ? IN_CACHE : block_state_in[j];
      const bool act = existsW[j] && st == ACTIVE;
      const bool retire = act && w.base_done[j];
      chain = chain && (!act || retire);
      o_state[j] = (retire && chain) ? TO_CACHE : st;
    }
  }
  __syncthreads();
  // ---- the next round's plan on the new state (plan_round)
  const long long n_valid = s_nvalid;
  for (long long b = tid; b < NB; b += kThreads) o_alive[b] = b <= n_valid;
  for (long long f = tid; f < NB * G1; f += kThreads) {
    const long long b = f / G1, j = f % G1;
    long long c = 0;
    if (j >= 1)
      for (long long t = 0; t < bs; ++t) c += o_x[b * L1 + gen_pos[(j - 1) * bs + t]] == mask_id;
    w.mc[f] = c;
  }
  __syncthreads();
  const long long n_blocks_W = n_blocks_in[W];
  for (long long b = tid; b < NB; b += kThreads) {
    const bool al = o_alive[b];
    const long long last_mc = w.mc[b * G1 + n_blocks_W];
    const bool grow = al && n_blocks_W < G && !o_eos[b] && grow_table[last_mc];
    const long long nblk = n_blocks_W + grow;
    o_n_blocks[b] = nblk;
    bool any_active = false;
    for (long long j = 0; j < G1; ++j) {
      const bool ex = j <= nblk;
      o_exists[b * G1 + j] = ex;
      o_complete[b * G1 + j] = complete_in[W * G1 + j] || (j >= 1 && activate_table[w.mc[b * G1 + j - 1]] && ex);
      const bool act = ex && o_state[j] == ACTIVE;
      o_active[b * G1 + j] = act;
      any_active |= act;
    }
    const long long len = P + nblk * bs;
    o_lens[b] = len;
    bool any_mask = false;
    for (long long q = 0; q < L1; ++q) {
      const bool m = o_x[b * L1 + q] == mask_id && q < len && al;
      o_is_mask[b * L1 + q] = m;
      any_mask |= m;
    }
    o_done[b] = al && !any_mask && !any_active;
    o_running[b] = al && !o_done[b];
  }
  __syncthreads();
  if (tid == 0) {
    bool any_rem = false;
    for (long long b = 0; b < NB; ++b) any_rem |= o_running[b];
    long long lead = 0;
    while (lead < G1 && o_state[lead] != ACTIVE) ++lead;
    const long long spe = block_end[lead - 1];  // block 0 (the prompt) is never active: lead >= 1
    bool has_tc = false;
    long long s_min = L1 - 1, e_max = 0;
    for (long long j = 0; j < G1; ++j) {
      const bool tc = o_state[j] == TO_CACHE;
      o_to_cache[j] = tc;
      if (tc) {
        has_tc = true;
        s_min = imin(s_min, block_start[j]);
        e_max = imax(e_max, block_end[j]);
      }
    }
    const long long s = has_tc ? s_min : spe;
    const long long u = has_tc ? e_max - s : 0;
    long long n = 0, first_rem = NB - 1;
    for (long long b = 0; b < NB; ++b) {
      o_wlens[b] = o_lens[b] - s;
      if (o_running[b]) {
        n = imax(n, o_wlens[b]);
        first_rem = imin(first_rem, b);
      }
    }
    if (!any_rem) n = 0;
    long long nA = 0;
    for (long long b = 0; b < NB; ++b) nA += o_alive[b];
    const long long lay = o_running[nA - 1] ? nA - 1 : first_rem;
    *o_shared_end = spe;
    *o_layout_slot = lay;
    *o_start = s;
    *o_commit_len = u;
    s_s = s;
    s_u = u;
    o_head[0] = !any_rem;
    o_head[1] = nA;
    o_head[2] = s;
    o_head[3] = u;
    o_head[4] = n;
  }
  __syncthreads();
  const long long s = s_s, u = s_u;
  long long R = 0;
  for (long long f = tid; f < NB * L1; f += kThreads) {
    const long long b = f / L1, q = f % L1;
    bool need;
    if (shift) {
      const bool last = q == s + u - 1 && u > 0;
      const bool next_mask = q + 1 < L1 && o_is_mask[f + 1];
      need = (next_mask || last) && o_alive[b] && q >= s;
    } else {
      need = o_is_mask[f];
    }
    o_need[f] = need;
    R += need;
  }
  // block sum of R (integers: any order is exact)
  __shared__ long long s_part[kThreads];
  s_part[tid] = R;
  __syncthreads();
  if (tid == 0) {
    long long tot = 0;
    for (int t = 0; t < kThreads; ++t) tot += s_part[t];
    o_head[5] = tot;
    bool ragged = false;
    long long nn = o_head[4];
    for (long long b = 0; b < NB; ++b) ragged |= (o_alive[b] ? o_wlens[b] : nn) != nn;
    o_head[6] = ragged;
  }
}
#undef conf
#undef token
#undef p_in
#undef x_in
#undef n_blocks_in
#undef block_state_in
#undef complete_in
#undef eos_in
#undef alive_in
#undef creation_conf_in
#undef counts_in
#undef exists_in
#undef active_in
#undef running_in
#undef is_mask_in
#undef lens_in
#undef to_cache_in
#undef win_pos
#undef win_valid
#undef need_flat
#undef gen_pos
#undef block_start
#undef block_end
#undef pos_block
#undef in_block
#undef lowest_k
#undef grow_table
#undef activate_table
#undef o_winner
#undef o_score
#undef o_last_row
#undef o_accepted
#undef o_tokens
#undef o_x
#undef o_eos
#undef o_alive
#undef o_cc
#undef o_look_pos
#undef o_state
#undef o_counts
#undef o_n_blocks
#undef o_complete
#undef o_exists
#undef o_active
#undef o_running
#undef o_done
#undef o_is_mask
#undef o_need
#undef o_lens
#undef o_wlens
#undef o_to_cache
#undef o_shared_end
#undef o_layout_slot
#undef o_start
#undef o_commit_len
#undef o_head
