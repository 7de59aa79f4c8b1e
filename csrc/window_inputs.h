// window_inputs' CPU kernel: arguments as raw pointers into contiguous tensors (see
// lopa_fast/reference/ops.py::window_inputs for every tensor's meaning). NB slots, Lb1 = Lb + 1 row positions, Nb
// window columns, Rb LM-head rows.
#pragma once
#include <cstdint>

namespace lopa_fast {

struct WindowArgs {
  int64_t NB, Lb1, Nb, Rb;
  bool blocks;                // fill win_block
  const int64_t* x;           // [NB, Lb1]
  const bool* need_all;       // [NB, Lb1]
  const bool* alive;          // [NB]
  const int64_t* window_lens; // [NB]
  const bool* running;        // [NB]
  const int64_t* lens;        // [NB]
  const int64_t* layout_slot; // 0-d
  const int64_t* counts;      // [8]
  const int64_t* start;       // 0-d
  const int64_t* total_len;   // 0-d
  const int64_t* pos_block;   // [Lb1]
  // outputs
  int64_t* win_pos;           // [Nb]
  bool* win_valid;            // [Nb]
  int64_t* tokens;            // [NB, Nb]
  int64_t* win_block;         // [Nb] (blocks) or empty
  int64_t* win_lens;          // [NB]
  bool* need;                 // [NB, Nb]
  int64_t* rows;              // [Rb]
  int64_t* counts_out;        // [8]
};

void window_inputs_cpu(const WindowArgs& a);

}  // namespace lopa_fast
