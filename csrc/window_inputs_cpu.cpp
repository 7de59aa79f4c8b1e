// window_inputs on CPU: a D2F / LoPA round's forward inputs on its bucket in one pass over plain arrays, the same
// values as lopa_fast/reference/ops.py::window_inputs (integers and booleans only: exact by construction).
#include <algorithm>

#include "window_inputs.h"

namespace lopa_fast {

void window_inputs_cpu(const WindowArgs& a) {
  const int64_t NB = a.NB, L1 = a.Lb1, Nb = a.Nb, Lb = a.Lb1 - 1;
  for (int64_t i = 0; i < 8; ++i) a.counts_out[i] = a.counts[i];
  if (NB > 1) {  // the LoPA-only counters that read the plan
    const int64_t lay_len = a.lens[*a.layout_slot];
    int64_t n_running = 0;
    bool split = false;
    for (int64_t b = 0; b < NB; ++b) {
      n_running += a.running[b];
      split |= a.running[b] && a.lens[b] != lay_len;
    }
    a.counts_out[5] += split;
    a.counts_out[7] = std::max(a.counts_out[7], n_running);
  }
  for (int64_t c = 0; c < Nb; ++c) {
    const int64_t p = *a.start + c;
    const bool valid = p < *a.total_len;
    a.win_valid[c] = valid;
    a.win_pos[c] = valid ? p : Lb;  // padding columns read / write the trash column
    if (a.blocks) a.win_block[c] = a.pos_block[a.win_pos[c]];
  }
  for (int64_t b = 0; b < NB; ++b) {
    a.win_lens[b] = a.alive[b] ? a.window_lens[b] : Nb;
    for (int64_t c = 0; c < Nb; ++c) {
      a.tokens[b * Nb + c] = a.x[b * L1 + a.win_pos[c]];
      a.need[b * Nb + c] = a.need_all[b * L1 + a.win_pos[c]] && a.win_valid[c];
    }
  }
  // the needed flat rows ascending, then the others ascending (a stable partition), the first Rb of them
  int64_t k = 0;
  for (int64_t f = 0; f < NB * Nb && k < a.Rb; ++f)
    if (a.need[f]) a.rows[k++] = f;
  for (int64_t f = 0; f < NB * Nb && k < a.Rb; ++f)
    if (!a.need[f]) a.rows[k++] = f;
}

}  // namespace lopa_fast
