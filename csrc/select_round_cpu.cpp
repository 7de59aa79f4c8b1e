// select_round on the CPU: a D2F / LoPA round's selection and bookkeeping after its token statistics, in one call.
// Plain C++ on raw pointers (no torch headers: the extension builds in seconds at install). The semantics are
// lopa_fast/reference/ops.py::select_round, line for line; every output is bit-identical to it (scores: the
// lowest-k confidences summed in double, rounded once to float, divided by k in float, blended in double; built
// with -ffp-contract=off so no multiply-add is fused). Shapes and argument order: select_round.h.
#include "select_round.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace lopa_fast {
namespace {

constexpr int64_t ACTIVE = 0, TO_CACHE = 1, IN_CACHE = 2;

// torch's order for sort(ascending): NaN after everything, +inf before it
inline bool ascending(float a, float b) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a < b;
}
// torch's order for sort(descending): NaN first
inline bool descending(float a, float b) {
  if (std::isnan(b)) return false;
  if (std::isnan(a)) return true;
  return a > b;
}
// torch's max: NaN if any element is NaN
inline float nan_max(float a, float b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }
inline double nan_max(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }

}  // namespace

void plan_round_cpu(const RoundDims& d, const int64_t* x, const int64_t* n_blocks_in, const int64_t* state,
                    const bool* complete_in, const bool* eos, const bool* alive, int64_t P, const int64_t* gen_pos,
                    const int64_t* block_start, const int64_t* block_end, const bool* grow_table,
                    const bool* activate_table, const PlanOut& o) {
  const int64_t NB = d.NB, L1 = d.Lb1, G1 = d.G1, G = d.G1 - 1, bs = d.bs, Lb = d.Lb1 - 1;
  std::vector<int64_t> mc(NB * G1, 0);
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t j = 1; j < G1; ++j) {
      int64_t c = 0;
      for (int64_t t = 0; t < bs; ++t) c += x[b * L1 + gen_pos[(j - 1) * bs + t]] == d.mask_id;
      mc[b * G1 + j] = c;
    }
  int64_t nA = 0;
  for (int64_t b = 0; b < NB; ++b) nA += alive[b];
  // grow, activation, lengths, masks, done
  bool any_rem = false;
  for (int64_t b = 0; b < NB; ++b) {
    const int64_t last_mc = mc[b * G1 + n_blocks_in[b]];
    const bool grow = alive[b] && n_blocks_in[b] < G && !eos[b] && grow_table[last_mc];
    const int64_t nblk = n_blocks_in[b] + grow;
    o.n_blocks[b] = nblk;
    bool any_active = false;
    for (int64_t j = 0; j < G1; ++j) {
      const bool ex = j <= nblk;
      o.exists[b * G1 + j] = ex;
      o.complete[b * G1 + j] = complete_in[b * G1 + j] || (j >= 1 && activate_table[mc[b * G1 + j - 1]] && ex);
      const bool act = ex && state[j] == ACTIVE;
      o.active[b * G1 + j] = act;
      any_active |= act;
    }
    const int64_t len = P + nblk * bs;
    o.lens[b] = len;
    bool any_mask = false;
    for (int64_t q = 0; q < L1; ++q) {
      const bool m = x[b * L1 + q] == d.mask_id && q < len && alive[b];
      o.is_mask[b * L1 + q] = m;
      any_mask |= m;
    }
    o.done[b] = alive[b] && !any_mask && !any_active;
    o.running[b] = alive[b] && !o.done[b];
    any_rem |= o.running[b];
  }
  // shared-prefix end, the to-cache span
  int64_t lead = 0;
  while (lead < G1 && state[lead] != ACTIVE) ++lead;
  const int64_t spe = block_end[lead - 1];  // block 0 (the prompt) is never active: lead >= 1
  bool has_tc = false;
  int64_t s_min = Lb, e_max = 0;
  for (int64_t j = 0; j < G1; ++j) {
    const bool tc = state[j] == TO_CACHE;
    o.to_cache[j] = tc;
    if (tc) {
      has_tc = true;
      s_min = std::min(s_min, block_start[j]);
      e_max = std::max(e_max, block_end[j]);
    }
  }
  const int64_t s = has_tc ? s_min : spe;
  const int64_t u = has_tc ? e_max - s : 0;
  int64_t n = 0, first_rem = NB - 1;
  for (int64_t b = 0; b < NB; ++b) {
    o.window_lens[b] = o.lens[b] - s;
    if (o.running[b]) {
      n = std::max(n, o.window_lens[b]);
      first_rem = std::min(first_rem, b);
    }
  }
  if (!any_rem) n = 0;
  const int64_t lay = o.running[nA - 1] ? nA - 1 : first_rem;
  bool ragged = false;
  for (int64_t b = 0; b < NB; ++b) ragged |= (alive[b] ? o.window_lens[b] : n) != n;
  int64_t R = 0;
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t q = 0; q < L1; ++q) {
      bool need;
      if (d.shift) {
        const bool last = q == s + u - 1 && u > 0;
        const bool next_mask = q + 1 < L1 && o.is_mask[b * L1 + q + 1];
        need = (next_mask || last) && alive[b] && q >= s;
      } else {
        need = o.is_mask[b * L1 + q];
      }
      o.need[b * L1 + q] = need;
      R += need;
    }
  *o.shared_end = spe;
  *o.layout_slot = lay;
  *o.start = s;
  *o.commit_len = u;
  o.head[0] = !any_rem;
  o.head[1] = nA;
  o.head[2] = s;
  o.head[3] = u;
  o.head[4] = n;
  o.head[5] = R;
  o.head[6] = ragged;
}

void select_round_cpu(const RoundDims& d, const RoundIn& in, const RoundOut& out) {
  const int64_t NB = d.NB, L1 = d.Lb1, G1 = d.G1, G = d.G1 - 1, Nb = d.Nb, bs = d.bs;
  const float inf = std::numeric_limits<float>::infinity();

  // ---- select: the table row predicting each window position, the scores, the winner
  std::vector<int64_t> csum(NB * Nb), sidx(NB * Nb);
  int64_t acc = 0;
  for (int64_t f = 0; f < NB * Nb; ++f) csum[f] = acc += in.need_flat[f];
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t i = 0; i < Nb; ++i)
      sidx[b * Nb + i] = d.shift ? (i == 0 ? 0 : csum[b * Nb + i - 1]) : std::max<int64_t>(csum[b * Nb + i] - 1, 0);
  std::vector<char> masked(NB * Nb);
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t i = 0; i < Nb; ++i) masked[b * Nb + i] = in.is_mask[b * L1 + in.win_pos[i]] && in.win_valid[i];
  int64_t W = 0;
  if (NB == 1 && !d.score_all) {
    out.score[0] = 0.0;
  } else {
    std::vector<float> row(Nb);
    std::vector<double> keyw(NB);
    const double alpha = *in.alpha;
    for (int64_t b = 0; b < NB; ++b) {
      int64_t m = 0;
      for (int64_t i = 0; i < Nb; ++i) {
        const bool mk = masked[b * Nb + i];
        m += mk;
        row[i] = mk ? in.conf[sidx[b * Nb + i]] : inf;
      }
      const int64_t kk = in.lowest_k[m];
      std::stable_sort(row.begin(), row.end(), ascending);
      double sum = 0.0;
      for (int64_t i = 0; i < std::min(kk, Nb); ++i) sum += static_cast<double>(row[i]);
      const float low = static_cast<float>(sum) / static_cast<float>(kk);
      const double future = m > 0 ? static_cast<double>(low) : 1.0;
      double score = d.blend ? alpha * in.creation_conf[b] + (1.0 - alpha) * future : future;
      if (in.lens[b] <= *in.shared_end) score = 1.0;
      out.score[b] = score;
      keyw[b] = in.running[b] ? score : -std::numeric_limits<double>::infinity();
    }
    double best = keyw[0];
    for (int64_t b = 1; b < NB; ++b) best = nan_max(best, keyw[b]);
    W = NB;
    for (int64_t b = 0; b < NB; ++b)
      if (keyw[b] == best) {
        W = b;
        break;
      }
    W = std::min(W, NB - 1);  // NaN scores: the last slot (the driver refuses the round after its host read)
  }
  *out.winner = W;
  *out.last_row = d.shift ? csum[W * Nb + std::max<int64_t>(*in.commit_len - 1, 0)] : 0;

  // ---- the D2F fill rule on the winner only
  std::vector<float> cW(Nb), pW(Nb);
  std::vector<char> candW(Nb), thr(Nb), accW(Nb);
  const float tau = static_cast<float>(*in.skip_threshold);  // the knob rounded to p's float32, as torch does
  const bool* actWb = in.active + W * G1;
  for (int64_t i = 0; i < Nb; ++i) {
    const int64_t r = sidx[W * Nb + i];
    cW[i] = in.conf[r];
    pW[i] = in.p[r];
    out.tokens[i] = in.token[r];
    const int64_t pb = std::min(in.pos_block[in.win_pos[i]], G);
    candW[i] = masked[W * Nb + i] && actWb[pb];
    thr[i] = candW[i] && pW[i] > tau;
  }
  std::vector<char> fb(Nb, 0);
  for (int64_t j = 0; j < G1; ++j) {
    float best = -inf;
    bool any_cand = false, any_thr = false;
    for (int64_t i = 0; i < Nb; ++i) {
      const bool cb = candW[i] && in.in_block[in.win_pos[i] * G1 + j];
      best = nan_max(best, cb ? cW[i] : -inf);
      any_cand |= cb;
      any_thr |= thr[i] && in.in_block[in.win_pos[i] * G1 + j];
    }
    const bool need_fb = in.complete[W * G1 + j] && actWb[j] && any_cand && !any_thr;
    if (!need_fb) continue;
    for (int64_t i = 0; i < Nb; ++i) {
      const bool cb = candW[i] && in.in_block[in.win_pos[i] * G1 + j];
      if (cb && (cb ? cW[i] : -inf) == best) {
        fb[i] = 1;
        break;
      }
    }
  }
  int64_t n_thr = 0, n_fb = 0, n_acc = 0, n_eos = 0;
  std::vector<int64_t> xW(in.x + W * L1, in.x + (W + 1) * L1);
  const std::vector<int64_t> xW0 = xW;
  bool eosW = in.eos[W];
  for (int64_t i = 0; i < Nb; ++i) {
    accW[i] = thr[i] || fb[i];
    out.accepted[i] = accW[i];
    n_thr += thr[i];
    n_fb += fb[i];
    n_acc += accW[i];
    const int64_t q = in.win_pos[i];
    xW[q] = accW[i] ? out.tokens[i] : xW0[q];
    if (d.eos_id >= 0 && accW[i] && out.tokens[i] == d.eos_id) {
      ++n_eos;
      eosW = true;
    }
  }
  int64_t nA = 0;
  for (int64_t b = 0; b < NB; ++b) nA += in.alive[b];
  int64_t multi, look_win = 0, grew = 0;
  if (NB == 1) {
    multi = n_acc >= 2;
  } else {
    look_win = W != nA - 1;  // the anchor is the last alive slot
    grew = in.lens[W] != in.lens[*in.layout_slot];
    multi = (n_acc + look_win) >= 2;
  }
  const int64_t delta[8] = {n_thr, n_fb, n_eos, multi, look_win, 0, grew, 0};
  for (int k = 0; k < 8; ++k) out.counts[k] = in.counts[k] + delta[k];

  // ---- the winner's completed blocks (upstream's base_completed_blocks)
  std::vector<char> base_done(G1);
  for (int64_t j = 0; j < G1; ++j) {
    int64_t mcj = 0;
    if (j >= 1)
      for (int64_t t = 0; t < bs; ++t) mcj += xW[in.gen_pos[(j - 1) * bs + t]] == d.mask_id;
    base_done[j] = actWb[j] && mcj == 0;
  }

  // ---- spawn: lookaheads at the winner's top-n_look remaining masks (ranked by confidence, stable)
  for (int64_t b = 0; b < NB; ++b) {
    std::copy(xW.begin(), xW.end(), out.x + b * L1);
    out.eos[b] = eosW;
    out.creation_conf[b] = 1.0;
    out.look_pos[b] = -1;
  }
  int64_t n_valid = 0;
  if (d.n_look > 0) {
    std::vector<int64_t> order(Nb);
    std::iota(order.begin(), order.end(), 0);
    std::vector<float> keyl(Nb);
    for (int64_t i = 0; i < Nb; ++i) keyl[i] = (candW[i] && !accW[i]) ? cW[i] : -inf;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return descending(keyl[a], keyl[b]); });
    for (int64_t r = 0; r < std::min<int64_t>(d.n_look, Nb); ++r) {
      const int64_t i = order[r];
      if (!(candW[i] && !accW[i])) continue;
      ++n_valid;
      const int64_t q = in.win_pos[i];
      out.x[r * L1 + q] = out.tokens[i];
      out.creation_conf[r] = static_cast<double>(cW[i]);
      if (d.eos_id >= 0 && out.tokens[i] == d.eos_id) out.eos[r] = true;
      out.look_pos[r] = q;
    }
  }

  // ---- new block tables: the cached span -> in_cache; the anchor rule's completions -> to_cache in order
  bool chain = true;
  const bool* existsW = in.exists + W * G1;
  for (int64_t j = 0; j < G1; ++j) {
    int64_t st = in.to_cache[j] ? IN_CACHE : in.block_state[j];
    const bool act = existsW[j] && st == ACTIVE;
    const bool retire = act && base_done[j];
    chain = chain && (!act || retire);
    out.block_state[j] = (retire && chain) ? TO_CACHE : st;
  }
  std::vector<int64_t> nblk(NB, in.n_blocks[W]);
  std::vector<char> complete_new(NB * G1);
  for (int64_t b = 0; b < NB; ++b) {
    out.alive[b] = b <= n_valid;
    for (int64_t j = 0; j < G1; ++j) complete_new[b * G1 + j] = in.complete[W * G1 + j];
  }
  plan_round_cpu(d, out.x, nblk.data(), out.block_state, reinterpret_cast<const bool*>(complete_new.data()),
                 out.eos, out.alive, *in.prompt_len, in.gen_pos, in.block_start, in.block_end, in.grow_table,
                 in.activate_table, out.plan);
}

}  // namespace lopa_fast
