// CPU C++ twin of the D2F / LoPA round's bookkeeping: torch.ops.lopa_fast_cpp.round_prepare and round_update.
// Semantics: lopa_fast/decode/round.py (`window` + the part of `round_step` after the token statistics +
// `plan`), which is the plain-PyTorch reference of these two ops; tests/test_round_cpp.py checks the whole round
// state after every round of a grid of requests. Why: at tiny shapes the eager torch round is ~270 small tensor
// ops per round (~5 us each on a 2-core CPU, more than the model's forward); here it is two calls.
//
// Layouts are those of round.py (x [NB, Lb + 1] long with the trash column Lb, block tables [G + 1], ...).
// The interface is generated from ONE description, lopa_fast.contracts.ROUND_CPP_OPS (lopa_fast/ops/_cpp.py
// `header()` writes lopa_round_ops.h into the build directory): each op takes its arguments as a struct of named
// fields (`a.skip_threshold`, `a.logits`, ...; `RoundPrepareArgs`, `RoundUpdateArgs`), the schemas and entry points
// are generated, and Python passes them by name (`lopa_fast.ops._cpp.call`). The state arrives as a list in the
// order of lopa_fast.contracts.ROUND_STATE_FIELDS and leaves in the order of ROUND_OUT_FIELDS (+ the round's trace
// facts ROUND_INFO_FIELDS); the indices (LOPA_ST_<NAME>, LOPA_OUT_<NAME>) come from the same header, never as
// literals. Nothing is written in place except the KV cache (the request's largest tensors), exactly as the torch
// round does.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "lopa_round_ops.h"  // generated: lopa_fast/ops/_cpp.py header()

#if !defined(LOPA_ST_X) || !defined(LOPA_OUT_HEAD) || !defined(LOPA_N_OUT) || !defined(LOPA_CMP_GT)
#error "build with lopa_fast/ops/_cpp.py (the generated lopa_round_ops.h and the -D flags of contracts.code_defines())"
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t ACTIVE = 0, TO_CACHE = 1, IN_CACHE = 2;  // round.py's block states

at::Tensor new_like(const at::Tensor& t) { return at::empty(t.sizes(), t.options()); }
at::Tensor scalar_long(int64_t v, const at::TensorOptions& o) {
  at::Tensor t = at::empty({}, o.dtype(at::kLong));
  t.data_ptr<int64_t>()[0] = v;
  return t;
}
int64_t item(const at::Tensor& t) { return t.const_data_ptr<int64_t>()[0]; }

void check(const at::Tensor& t, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dt && t.is_contiguous(), "round_cpu: ", name,
              " must be a contiguous CPU tensor of ", dt, ", got ", t.scalar_type());
}

// ---------------------------------------------------------------------------------------------- round_prepare
// The forward's inputs for window [s, s + Nb) of every slot (round.py `window`): window positions (padding ->
// the trash column Lb), tokens [NB, Nb], block ids [NB, Nb] (block_causal; else an empty tensor), win_lens [NB]
// (dead slots see their whole window), and the Rb LM-head rows: the needed flat rows (slot * Nb + column)
// ascending, then the others ascending (the stable sort of round.py), cut to Rb.
std::vector<at::Tensor> round_prepare(const RoundPrepareArgs& a) {
  const at::Tensor &x = a.x, &need = a.need, &pos_block = a.pos_block, &alive = a.alive, &wl = a.wl;
  const int64_t s = a.s, Nb = a.Nb, Rb = a.Rb, L = a.L;
  const bool block_causal = a.block_causal;
  check(x, at::kLong, "x");
  check(need, at::kBool, "need");
  check(pos_block, at::kLong, "pos_block");
  check(alive, at::kBool, "alive");
  check(wl, at::kLong, "wl");
  const int64_t NB = x.size(0), W = x.size(1), Lb = W - 1;
  TORCH_CHECK(Rb <= NB * Nb, "round_prepare: Rb=", Rb, " > NB * Nb=", NB * Nb);
  auto lo = x.options();
  at::Tensor wpos = at::empty({Nb}, lo), tokens = at::empty({NB, Nb}, lo), win_lens = at::empty({NB}, lo);
  at::Tensor bids = block_causal ? at::empty({NB, Nb}, lo) : at::empty({0}, lo);
  at::Tensor rows = at::empty({Rb}, lo);
  const int64_t* xp = x.const_data_ptr<int64_t>();
  const bool* np = need.const_data_ptr<bool>();
  const int64_t* pb = pos_block.const_data_ptr<int64_t>();
  int64_t* wp = wpos.data_ptr<int64_t>();
  for (int64_t i = 0; i < Nb; ++i) wp[i] = s + i < L ? s + i : Lb;
  int64_t* tk = tokens.data_ptr<int64_t>();
  int64_t* bd = block_causal ? bids.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t i = 0; i < Nb; ++i) {
      tk[b * Nb + i] = xp[b * W + wp[i]];
      if (bd) bd[b * Nb + i] = pb[wp[i]];
    }
  const bool* al = alive.const_data_ptr<bool>();
  const int64_t* wlp = wl.const_data_ptr<int64_t>();
  int64_t* wn = win_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < NB; ++b) wn[b] = al[b] ? wlp[b] : Nb;
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t r = 0;
  for (int pass = 0; pass < 2 && r < Rb; ++pass)
    for (int64_t f = 0; f < NB * Nb && r < Rb; ++f) {
      const int64_t i = f % Nb;
      const bool needed = wp[i] != Lb && np[(f / Nb) * W + wp[i]];
      if (needed == (pass == 0)) rp[r++] = f;
    }
  return {wpos, tokens, bids, win_lens, rows};
}

// ----------------------------------------------------------------------------------------------- round_update
// Everything of round.py's round after the forward and the token statistics: the numerics guard, branch
// scores and the winner, the winner's K/V commit (in place), the fill rule on the winner, the lookahead spawn,
// the new block table, then the plan of the next round and its 9-int head (head[8], the stop flag, is left 0:
// the caller computes it when stop sequences are set).
//
// a (RoundUpdateArgs, lopa_fast.contracts.ROUND_CPP_OPS): st (the state), the tables pos_block [Lb + 1],
// bstart [G + 1], bend [G + 1], tab_add [bs + 1] bool, tab_act [bs + 1] bool, ktable [>= Nb + 1] long; conf / x0 / p:
// the statistics of the table rows (with the shift: row 0 = the stale last_logit, row r >= 1 = logits row r - 1),
// fp32 / long / fp32; P, L, G, bs, mask_id, eos_id (-1: none), n_look, shift, scores (compute branch scores), the
// bucket Nb, Rb; the float knobs skip_threshold, alpha (0: scores do not blend).
std::vector<at::Tensor> round_update(const RoundUpdateArgs& a) {
  const at::TensorList st = a.st;
  TORCH_CHECK(st.size() == LOPA_N_ST, "round_update: ", st.size(), " state tensors, expected ", LOPA_N_ST);
  const at::Tensor &logits = a.logits, &rows = a.rows, &wpos_t = a.wpos, &conf_t = a.conf, &x0_t = a.x0;
  const at::Tensor &p_t = a.p, &k_win = a.k_win, &v_win = a.v_win;
  at::Tensor cache_k = a.cache_k, cache_v = a.cache_v;
  const int64_t P = a.P, L = a.L, G = a.G, bs = a.bs, mask_id = a.mask_id, eos_id = a.eos_id;
  const int64_t n_look = a.n_look, Nb = a.Nb, Rb = a.Rb;
  const bool shift = a.shift, scores = a.scores;
  const float tau_f = static_cast<float>(a.skip_threshold);  // torch compares fp32 tensors with the scalar in fp32
  const double alpha = a.alpha;
  const at::Tensor& x_t = st[LOPA_ST_X];
  check(x_t, at::kLong, "x");
  const int64_t NB = x_t.size(0), W1 = x_t.size(1), Lb = W1 - 1, G1 = G + 1;
  for (int64_t k = 0; k < LOPA_N_ST; ++k)
    TORCH_CHECK(st[k].device().is_cpu() && st[k].is_contiguous(), "round_update: state ", k, " not contiguous CPU");
  check(conf_t, at::kFloat, "conf");
  check(p_t, at::kFloat, "p");
  check(x0_t, at::kLong, "x0");
  check(rows, at::kLong, "rows");
  check(wpos_t, at::kLong, "wpos");
  auto lo = x_t.options();
  auto bo = st[LOPA_ST_ALIVE].options();

  const int64_t* x = x_t.const_data_ptr<int64_t>();
  const int64_t* nblk = st[LOPA_ST_NBLK].const_data_ptr<int64_t>();
  const int64_t* state = st[LOPA_ST_STATE].const_data_ptr<int64_t>();
  const bool* complete = st[LOPA_ST_COMPLETE].const_data_ptr<bool>();
  const bool* eos = st[LOPA_ST_EOS].const_data_ptr<bool>();
  const bool* alive = st[LOPA_ST_ALIVE].const_data_ptr<bool>();
  const double* cconf = st[LOPA_ST_CCONF].const_data_ptr<double>();
  const bool* exists = st[LOPA_ST_EXISTS].const_data_ptr<bool>();
  const bool* active = st[LOPA_ST_ACTIVE].const_data_ptr<bool>();
  const bool* rem = st[LOPA_ST_REM].const_data_ptr<bool>();
  const bool* ismask = st[LOPA_ST_ISMASK].const_data_ptr<bool>();
  const bool* need = st[LOPA_ST_NEED].const_data_ptr<bool>();
  const int64_t* lens = st[LOPA_ST_LENS].const_data_ptr<int64_t>();
  const bool* tc = st[LOPA_ST_TC].const_data_ptr<bool>();
  const int64_t spe = item(st[LOPA_ST_SPE]), lay = item(st[LOPA_ST_LAY]), u = item(st[LOPA_ST_U]);
  const int64_t cache_len = item(st[LOPA_ST_CACHE_LEN]);
  check(a.pos_block, at::kLong, "pos_block");
  check(a.bstart, at::kLong, "bstart");
  check(a.bend, at::kLong, "bend");
  check(a.tab_add, at::kBool, "tab_add");
  check(a.tab_act, at::kBool, "tab_act");
  check(a.ktable, at::kLong, "ktable");
  const int64_t* pos_block = a.pos_block.const_data_ptr<int64_t>();
  const int64_t* bstart = a.bstart.const_data_ptr<int64_t>();
  const int64_t* bend = a.bend.const_data_ptr<int64_t>();
  const bool* tab_add = a.tab_add.const_data_ptr<bool>();
  const bool* tab_act = a.tab_act.const_data_ptr<bool>();
  const int64_t* ktable = a.ktable.const_data_ptr<int64_t>();
  const int64_t* wpos = wpos_t.const_data_ptr<int64_t>();
  const float* conf = conf_t.const_data_ptr<float>();
  const int64_t* x0 = x0_t.const_data_ptr<int64_t>();
  const float* pv = p_t.const_data_ptr<float>();
  const float NEG_INF = -std::numeric_limits<float>::infinity();

  std::vector<at::Tensor> out(LOPA_N_OUT);
  int64_t cnt[8];
  for (int k = 0; k < 8; ++k) cnt[k] = item(st[LOPA_ST_C_THRESH + k]);
  int64_t& c_thresh = cnt[LOPA_ST_C_THRESH - LOPA_ST_C_THRESH];
  int64_t& c_fallback = cnt[LOPA_ST_C_FALLBACK - LOPA_ST_C_THRESH];
  int64_t& c_eos_fills = cnt[LOPA_ST_C_EOS_FILLS - LOPA_ST_C_THRESH];
  int64_t& c_multi = cnt[LOPA_ST_C_MULTI - LOPA_ST_C_THRESH];
  int64_t& c_look_wins = cnt[LOPA_ST_C_LOOK_WINS - LOPA_ST_C_THRESH];
  int64_t& c_growth_split = cnt[LOPA_ST_C_GROWTH_SPLIT - LOPA_ST_C_THRESH];
  int64_t& c_winner_grew = cnt[LOPA_ST_C_WINNER_GREW - LOPA_ST_C_THRESH];
  int64_t& c_max_branches = cnt[LOPA_ST_C_MAX_BRANCHES - LOPA_ST_C_THRESH];

  // LoPA-only counters of the round's own plan (before anything moves)
  if (NB > 1) {
    bool split = false;
    int64_t nrem = 0;
    for (int64_t b = 0; b < NB; ++b) {
      split = split || (rem[b] && lens[b] != lens[lay]);
      nrem += rem[b];
    }
    c_growth_split += split;
    c_max_branches = std::max(c_max_branches, nrem);
  }

  // ---- needed rows, their 1-based ranks (csum of round.py: a flat cumulative count over slot-major rows)
  std::vector<uint8_t> wvalid(Nb), needw(NB * Nb), masked(NB * Nb);
  std::vector<int64_t> csum(NB * Nb), sidx(NB * Nb);
  int64_t nreal = 0;
  for (int64_t i = 0; i < Nb; ++i) wvalid[i] = wpos[i] != Lb;
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t i = 0; i < Nb; ++i) {
      const int64_t f = b * Nb + i;
      needw[f] = wvalid[i] && need[b * W1 + wpos[i]];
      masked[f] = wvalid[i] && ismask[b * W1 + wpos[i]];
      nreal += needw[f];
      csum[f] = nreal;
    }
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t i = 0; i < Nb; ++i) {
      const int64_t f = b * Nb + i;
      sidx[f] = shift ? (i == 0 ? 0 : csum[f - 1]) : std::max<int64_t>(csum[f] - 1, 0);
    }

  // ---- numerics guard: the first needed raw row holding NaN / inf, else -1
  int64_t nonfinite = -1;
  {
    at::Tensor lg = logits.to(at::kFloat).contiguous();
    const float* l = lg.const_data_ptr<float>();
    const int64_t V = lg.size(1);
    const int64_t* rp = rows.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < std::min(nreal, Rb) && nonfinite < 0; ++r)
      for (int64_t v = 0; v < V; ++v)
        if (!std::isfinite(l[r * V + v])) {
          nonfinite = rp[r];
          break;
        }
  }

  // ---- branch scores and the winner (first maximum over running slots; NaN -> the last slot, as round.py)
  at::Tensor score_t = at::empty({0}, st[LOPA_ST_CCONF].options());  // empty: not computed (D2F, no trace)
  int64_t Wn = 0;
  if (scores) {
    // future = the mean of the k lowest confidences over a slot's masks, as round.py computes it: the k lowest
    // in ascending order padded with zeros to Nb columns, torch's own row sum over [NB, Nb] (the same kernel on
    // the same shape, so the same fp32 summation order), divided by k in fp32
    at::Tensor lowpad = at::zeros({NB, Nb}, conf_t.options());
    float* lp = lowpad.data_ptr<float>();
    std::vector<int64_t> m(NB), kk(NB);
    std::vector<float> vals;
    for (int64_t b = 0; b < NB; ++b) {
      vals.clear();
      for (int64_t i = 0; i < Nb; ++i)
        if (masked[b * Nb + i]) vals.push_back(conf[sidx[b * Nb + i]]);
      m[b] = vals.size();
      kk[b] = ktable[m[b]];
      std::sort(vals.begin(), vals.end());
      for (int64_t i = 0; i < std::min<int64_t>(kk[b], m[b]); ++i) lp[b * Nb + i] = vals[i];
    }
    at::Tensor low = lowpad.sum(1);
    const float* lw = low.const_data_ptr<float>();
    score_t = at::empty({NB}, st[LOPA_ST_CCONF].options());
    double* sc = score_t.data_ptr<double>();
    for (int64_t b = 0; b < NB; ++b) {
      const double future = m[b] > 0 ? static_cast<double>(lw[b] / static_cast<float>(kk[b])) : 1.0;
      double s = alpha == 0.0 ? future : alpha * cconf[b] + (1.0 - alpha) * future;
      if (lens[b] <= spe) s = 1.0;
      sc[b] = s;
    }
    const double NINF = -std::numeric_limits<double>::infinity();
    double best = NINF;
    bool nan = false;
    for (int64_t b = 0; b < NB; ++b) {
      const double kw = rem[b] ? sc[b] : NINF;
      if (std::isnan(kw)) nan = true;
      else best = std::max(best, kw);
    }
    Wn = NB - 1;  // NaN scores: round.py's clamp (the driver refuses the round after its host read)
    if (!nan)
      for (int64_t b = 0; b < NB; ++b)
        if ((rem[b] ? sc[b] : NINF) == best) {
          Wn = b;
          break;
        }
  }
  const int64_t Wb = Wn;

  // ---- commit the winner's first u window positions to the cache (in place)
  if (u > 0) {
    cache_k.narrow(1, cache_len, u).copy_(k_win.select(1, Wb).narrow(1, 0, u));
    cache_v.narrow(1, cache_len, u).copy_(v_win.select(1, Wb).narrow(1, 0, u));
  }
  at::Tensor last_logit = st[LOPA_ST_LAST_LOGIT];
  if (shift && u > 0) {
    const int64_t r = csum[Wb * Nb + (u - 1)];  // table row (raw row u - 1 of the winner is always needed)
    if (r >= 1) last_logit = logits.select(0, r - 1).clone();
  }

  // ---- the D2F fill rule on the winner
  std::vector<uint8_t> candW(Nb), thr(Nb), accW(Nb);
  std::vector<float> cW(Nb), pW(Nb);
  std::vector<int64_t> tokW(Nb), blkW(Nb);
  const bool* actW = active + Wb * G1;
  for (int64_t i = 0; i < Nb; ++i) {
    const int64_t f = Wb * Nb + i;
    cW[i] = conf[sidx[f]];
    tokW[i] = x0[sidx[f]];
    pW[i] = pv[sidx[f]];
    blkW[i] = pos_block[wpos[i]];  // > G for positions of no block (the trash column)
    candW[i] = masked[f] && actW[std::min(blkW[i], G)];
    thr[i] = candW[i] && pW[i] > tau_f;
  }
  std::vector<float> best(G1, NEG_INF);
  std::vector<int64_t> firstpos(G1, Nb);
  std::vector<uint8_t> anycand(G1, 0), anythr(G1, 0);
  for (int64_t i = 0; i < Nb; ++i) {
    const int64_t j = blkW[i];
    if (j > G) continue;
    if (thr[i]) anythr[j] = 1;
    if (!candW[i]) continue;
    anycand[j] = 1;
    if (firstpos[j] == Nb || cW[i] > best[j]) {  // strict: the first maximum
      best[j] = cW[i];
      firstpos[j] = i;
    }
  }
  int64_t n_thr = 0, n_fb = 0, n_acc = 0, n_eos = 0;
  const bool* complW = complete + Wb * G1;
  for (int64_t i = 0; i < Nb; ++i) {
    const int64_t j = blkW[i];
    const bool fb = j <= G && firstpos[j] == i && complW[j] && actW[j] && anycand[j] && !anythr[j];
    accW[i] = thr[i] || fb;
    n_thr += thr[i];
    n_fb += fb;
    n_acc += accW[i];
  }
  std::vector<int64_t> xW(x + Wb * W1, x + (Wb + 1) * W1);
  bool eosW = eos[Wb];
  for (int64_t i = 0; i < Nb; ++i)
    if (accW[i]) {
      xW[wpos[i]] = tokW[i];
      if (eos_id >= 0 && tokW[i] == eos_id) {
        ++n_eos;
        eosW = true;
      }
    }
  c_thresh += n_thr;
  c_fallback += n_fb;
  c_eos_fills += n_eos;
  int64_t nA_old = 0;
  for (int64_t b = 0; b < NB; ++b) nA_old += alive[b];
  if (NB == 1) {
    c_multi += n_acc >= 2;
  } else {
    const bool is_look = Wb != nA_old - 1;  // the anchor is the last alive slot
    c_winner_grew += lens[Wb] != lens[lay];
    c_look_wins += is_look;
    c_multi += (n_acc + is_look) >= 2;
  }

  // ---- the winner's block table after the fill
  std::vector<uint8_t> base_done(G1, 0);
  for (int64_t j = 1; j <= G; ++j) {
    int64_t mc = 0;
    for (int64_t q = P + (j - 1) * bs; q < P + j * bs; ++q) mc += xW[q] == mask_id;
    base_done[j] = actW[j] && mc == 0;
  }

  // ---- spawn: lookaheads at the winner's top-n_look remaining masks (stable, higher conf first)
  at::Tensor x_new = new_like(x_t), eos_new = new_like(st[LOPA_ST_EOS]), cconf_new = new_like(st[LOPA_ST_CCONF]);
  at::Tensor look_new = new_like(st[LOPA_ST_LOOK_POS]);
  int64_t* xn = x_new.data_ptr<int64_t>();
  bool* en = eos_new.data_ptr<bool>();
  double* cn = cconf_new.data_ptr<double>();
  int64_t* ln = look_new.data_ptr<int64_t>();
  for (int64_t b = 0; b < NB; ++b) {
    std::copy(xW.begin(), xW.end(), xn + b * W1);
    en[b] = eosW;
    cn[b] = 1.0;
    ln[b] = -1;
  }
  int64_t n_valid = 0;
  if (n_look > 0) {
    std::vector<int64_t> order;
    for (int64_t i = 0; i < Nb; ++i)
      if (candW[i] && !accW[i]) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return cW[a] > cW[c]; });
    for (int64_t r = 0; r < n_look && r < (int64_t)order.size(); ++r) {
      const int64_t i = order[r];
      xn[r * W1 + wpos[i]] = tokW[i];
      cn[r] = static_cast<double>(cW[i]);
      if (eos_id >= 0 && tokW[i] == eos_id) en[r] = true;
      ln[r] = wpos[i];
      ++n_valid;
    }
  }

  // ---- new block table: cached span -> in_cache; retire completed blocks in order (a cumulative AND)
  at::Tensor state_new = new_like(st[LOPA_ST_STATE]);
  int64_t* sn = state_new.data_ptr<int64_t>();
  const bool* existsW = exists + Wb * G1;
  bool chain = true;
  for (int64_t j = 0; j < G1; ++j) {
    int64_t v = tc[j] ? IN_CACHE : state[j];
    const bool act = existsW[j] && v == ACTIVE;
    const bool retire = act && base_done[j];
    chain = chain && (!act || retire);
    if (retire && chain) v = TO_CACHE;
    sn[j] = v;
  }
  at::Tensor alive_new = new_like(st[LOPA_ST_ALIVE]);
  bool* an = alive_new.data_ptr<bool>();
  for (int64_t b = 0; b < NB; ++b) an[b] = b <= n_valid;

  // ================================================================ the plan of the next round (round.py `plan`)
  at::Tensor nblk_new = new_like(st[LOPA_ST_NBLK]), complete_new = new_like(st[LOPA_ST_COMPLETE]);
  at::Tensor exists_new = new_like(st[LOPA_ST_EXISTS]), active_new = new_like(st[LOPA_ST_ACTIVE]);
  at::Tensor rem_new = new_like(st[LOPA_ST_REM]), done_new = new_like(st[LOPA_ST_REM]);
  at::Tensor ismask_new = new_like(st[LOPA_ST_ISMASK]), need_new = new_like(st[LOPA_ST_NEED]);
  at::Tensor lens_new = new_like(st[LOPA_ST_LENS]), wl_new = new_like(st[LOPA_ST_WL]);
  at::Tensor tc_new = new_like(st[LOPA_ST_TC]);
  int64_t* nbn = nblk_new.data_ptr<int64_t>();
  bool* cpn = complete_new.data_ptr<bool>();
  bool* exn = exists_new.data_ptr<bool>();
  bool* acn = active_new.data_ptr<bool>();
  bool* rmn = rem_new.data_ptr<bool>();
  bool* dnn = done_new.data_ptr<bool>();
  bool* imn = ismask_new.data_ptr<bool>();
  bool* ndn = need_new.data_ptr<bool>();
  int64_t* lnn = lens_new.data_ptr<int64_t>();
  int64_t* wln = wl_new.data_ptr<int64_t>();
  bool* tcn = tc_new.data_ptr<bool>();
  std::vector<int64_t> mc(G1);
  for (int64_t b = 0; b < NB; ++b) {
    const int64_t* xr = xn + b * W1;
    mc[0] = 0;
    for (int64_t j = 1; j <= G; ++j) {
      int64_t c = 0;
      for (int64_t q = P + (j - 1) * bs; q < P + j * bs; ++q) c += xr[q] == mask_id;
      mc[j] = c;
    }
    const int64_t nb0 = nblk[Wb];  // every slot starts from the winner's count
    const bool grow = an[b] && nb0 < G && !en[b] && tab_add[mc[nb0]];
    const int64_t nb1 = nb0 + grow;
    nbn[b] = nb1;
    bool any_active = false;
    for (int64_t j = 0; j < G1; ++j) {
      const bool ex = j <= nb1;
      exn[b * G1 + j] = ex;
      cpn[b * G1 + j] = complW[j] || (j >= 1 && tab_act[mc[j - 1]] && ex);
      acn[b * G1 + j] = ex && sn[j] == ACTIVE;
      any_active = any_active || acn[b * G1 + j];
    }
    lnn[b] = P + nb1 * bs;
    bool any_mask = false;
    for (int64_t q = 0; q < W1; ++q) {
      const bool mq = xr[q] == mask_id && q < lnn[b] && an[b];
      imn[b * W1 + q] = mq;
      any_mask = any_mask || mq;
    }
    dnn[b] = an[b] && !any_mask && !any_active;
    rmn[b] = an[b] && !dnn[b];
  }
  int64_t lead = 0;
  while (lead < G1 && sn[lead] != ACTIVE) ++lead;
  const int64_t spe_new = bend[lead - 1];
  bool has_tc = false;
  int64_t s_new = Lb, tc_end = 0;
  for (int64_t j = 0; j < G1; ++j) {
    tcn[j] = sn[j] == TO_CACHE;
    if (tcn[j]) {
      has_tc = true;
      s_new = std::min(s_new, bstart[j]);
      tc_end = std::max(tc_end, bend[j]);
    }
  }
  if (!has_tc) s_new = spe_new;
  const int64_t u_new = has_tc ? tc_end - s_new : 0;
  int64_t n_new = 0, nA = 0, first_rem = NB - 1;
  bool any_rem = false;
  for (int64_t b = 0; b < NB; ++b) {
    wln[b] = lnn[b] - s_new;
    if (rmn[b]) {
      n_new = std::max(n_new, wln[b]);
      if (!any_rem) first_rem = b;
      any_rem = true;
    }
    nA += an[b];
  }
  const int64_t lay_new = rmn[nA - 1] ? nA - 1 : first_rem;
  bool ragged = false;
  for (int64_t b = 0; b < NB; ++b) ragged = ragged || (an[b] ? wln[b] : n_new) != n_new;
  int64_t R = 0;
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t q = 0; q < W1; ++q) {
      bool nd;
      if (shift) {
        const bool last = q == s_new + u_new - 1 && u_new > 0;
        nd = ((q + 1 <= Lb && imn[b * W1 + q + 1]) || last) && an[b] && q >= s_new;
      } else {
        nd = imn[b * W1 + q];
      }
      ndn[b * W1 + q] = nd;
      R += nd;
    }

  at::Tensor head = at::empty({9}, lo);
  int64_t* hd = head.data_ptr<int64_t>();
  const int64_t hv[9] = {!any_rem, nA, s_new, u_new, n_new, R, ragged, nonfinite, 0};
  std::copy(hv, hv + 9, hd);

  out[LOPA_OUT_X] = x_new;
  out[LOPA_OUT_NBLK] = nblk_new;
  out[LOPA_OUT_STATE] = state_new;
  out[LOPA_OUT_COMPLETE] = complete_new;
  out[LOPA_OUT_EOS] = eos_new;
  out[LOPA_OUT_ALIVE] = alive_new;
  out[LOPA_OUT_CCONF] = cconf_new;
  out[LOPA_OUT_LOOK_POS] = look_new;
  out[LOPA_OUT_LAST_LOGIT] = last_logit;
  out[LOPA_OUT_CACHE_LEN] = scalar_long(cache_len + u, lo);
  out[LOPA_OUT_EXISTS] = exists_new;
  out[LOPA_OUT_ACTIVE] = active_new;
  out[LOPA_OUT_REM] = rem_new;
  out[LOPA_OUT_ISMASK] = ismask_new;
  out[LOPA_OUT_NEED] = need_new;
  out[LOPA_OUT_LENS] = lens_new;
  out[LOPA_OUT_WL] = wl_new;
  out[LOPA_OUT_TC] = tc_new;
  out[LOPA_OUT_SPE] = scalar_long(spe_new, lo);
  out[LOPA_OUT_LAY] = scalar_long(lay_new, lo);
  out[LOPA_OUT_S] = scalar_long(s_new, lo);
  out[LOPA_OUT_U] = scalar_long(u_new, lo);
  for (int k = 0; k < 8; ++k) out[LOPA_OUT_C_THRESH + k] = scalar_long(cnt[k], lo);
  out[LOPA_OUT_DONE] = done_new;
  out[LOPA_OUT_NONFINITE] = scalar_long(nonfinite, lo);
  out[LOPA_OUT_HEAD] = head;
  // the round's trace facts (ROUND_INFO_FIELDS): score (empty when not computed), winner, accepted, tokens
  at::Tensor acc_t = at::empty({Nb}, bo), tok_t = at::empty({Nb}, lo);
  std::copy(accW.begin(), accW.end(), acc_t.data_ptr<bool>());
  std::copy(tokW.begin(), tokW.end(), tok_t.data_ptr<int64_t>());
  out.push_back(score_t);
  out.push_back(scalar_long(Wb, lo));
  out.push_back(acc_t);
  out.push_back(tok_t);
  return out;
}

}  // namespace

// schemas and entry points: generated (lopa_round_ops.h) from lopa_fast.contracts.ROUND_CPP_OPS
TORCH_LIBRARY_FRAGMENT(lopa_fast_cpp, m) { LOPA_ROUND_OPS_DEF(m) }

TORCH_LIBRARY_IMPL(lopa_fast_cpp, CPU, m) { LOPA_ROUND_OPS_IMPL(m) }
