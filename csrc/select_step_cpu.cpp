// select_step on CPU: the threshold step's candidates, guard row, commit rule, commit, counters and head in one
// pass over plain arrays, bit for bit lopa_fast/reference/ops.py::select_step (built with -ffp-contract=off).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "select_step.h"

namespace lopa_fast {
namespace {

// torch's order for argmax / a descending sort: NaN above every number
template <typename T>
bool greater(T a, T b) {
  return (std::isnan(a) && !std::isnan(b)) || a > b;
}

// the rule's selection over the candidates (reference.ops.select_by_rule)
template <typename T>
void select_by_rule(const StepArgs& a, const T* conf, const std::vector<char>& cand, std::vector<char>& sel) {
  const int64_t n = a.n;
  int64_t n_cand = 0;
  for (int64_t r = 0; r < n; ++r) n_cand += cand[r];
  std::fill(sel.begin(), sel.end(), 0);
  if (n_cand == 0) return;
  if (a.rule == kFactor) {
    const T ninf = -std::numeric_limits<T>::infinity();
    std::vector<T> c(n);
    for (int64_t r = 0; r < n; ++r) c[r] = cand[r] ? conf[r] : ninf;
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return greater(c[i], c[j]); });
    // b: the first rank (< n_cand) whose value, in float64, is under 1 - f / (rank + 2) (rank 0: -1)
    int64_t b = n_cand;
    for (int64_t k = 0; k < n_cand; ++k) {
      const double th = k == 0 ? -1.0 : 1.0 - (1.0 / static_cast<double>(k + 2)) * *a.knob;
      if (static_cast<double>(c[order[k]]) < th) {
        b = k;
        break;
      }
    }
    const int64_t count = b < n_cand - 1 ? b : n_cand;
    for (int64_t k = 0; k < count && k < n; ++k) sel[order[k]] = cand[order[k]];
    return;
  }
  int64_t first = 0;
  if (a.rule == kEntropy) {  // argmin of where(cand, ent, inf): the first NaN, else the first minimum
    double best = std::numeric_limits<double>::infinity();
    bool nan = false;
    for (int64_t r = 0; r < n; ++r) {
      const double v = cand[r] ? a.ent[r] : std::numeric_limits<double>::infinity();
      if (nan) break;
      if (std::isnan(v)) { first = r; nan = true; }
      else if (v < best) { best = v; first = r; }
    }
    for (int64_t r = 0; r < n; ++r) sel[r] = cand[r] && !(a.ent[r] > *a.knob);
  } else {  // argmax of where(cand, conf, -inf); tau rounded to conf's dtype, as torch compares them
    const T ninf = -std::numeric_limits<T>::infinity();
    T best = ninf;
    for (int64_t r = 0; r < n; ++r) {
      const T v = cand[r] ? conf[r] : ninf;
      if (std::isnan(v)) { first = r; break; }
      if (v > best) { best = v; first = r; }
    }
    const T tau = static_cast<T>(*a.knob);
    for (int64_t r = 0; r < n; ++r) sel[r] = cand[r] && !(conf[r] < tau);
  }
  if (cand[first]) sel[first] = 1;
}

}  // namespace

void select_step_cpu(const StepArgs& a) {
  const int64_t L = a.L, n = a.n;
  std::vector<char> cand(n), sel(n);
  std::vector<int64_t> pos_c(n);
  int64_t bad_row = -1;
  for (int64_t r = 0; r < n; ++r) {
    pos_c[r] = std::min(a.pos[r], L - 1);
    cand[r] = a.valid[r] && a.x[pos_c[r]] == a.mask_id;
    const bool read = a.rule == kFirst ? a.valid[r] : cand[r];
    if (bad_row < 0 && read && !a.finite[r]) bad_row = r;
  }
  *a.multi_out = *a.multi;
  *a.noop_out = *a.noop;
  if (a.rule == kFirst) {
    for (int64_t r = 0; r < n; ++r) sel[r] = a.valid[r];
  } else {
    if (a.conf_is_double)
      select_by_rule(a, static_cast<const double*>(a.conf), cand, sel);
    else
      select_by_rule(a, static_cast<const float*>(a.conf), cand, sel);
    int64_t n_sel = 0;
    for (int64_t r = 0; r < n; ++r) n_sel += sel[r] != 0;
    *a.multi_out += n_sel >= 2;
    *a.noop_out += n_sel == 0;
  }
  std::copy(a.x, a.x + L, a.x_out);
  for (int64_t r = 0; r < n; ++r)
    if (sel[r] && a.valid[r]) a.x_out[pos_c[r]] = a.x0[r];
  int64_t fm = L, masks = 0;
  for (int64_t i = 0; i < L; ++i) {
    if (a.x_out[i] == a.mask_id) {
      if (fm == L) fm = i;
      ++masks;
    }
  }
  bool full = false;
  if (a.B > 0) {
    full = true;
    for (int64_t j = 0; j < a.B; ++j)
      if (a.x_out[std::min(*a.s + j, L - 1)] == a.mask_id) full = false;
  }
  *a.fm_out = fm;
  a.head_out[0] = bad_row;
  a.head_out[1] = full;
  a.head_out[2] = fm;
  a.head_out[3] = masks;
}

}  // namespace lopa_fast
