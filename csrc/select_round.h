// select_round's CPU kernel: argument structs (raw pointers into contiguous tensors; see
// lopa_fast/reference/ops.py::select_round for every tensor's meaning). NB slots, Lb1 = Lb + 1 row positions,
// G1 = G + 1 blocks, Nb window columns, bs block size.
#pragma once
#include <cstdint>

namespace lopa_fast {

struct RoundDims {
  int64_t NB, Lb1, G1, Nb, bs, mask_id, eos_id, n_look;
  bool shift, blend, score_all;
};

// the plan of a round (plan_round's outputs)
struct PlanOut {
  int64_t* n_blocks;     // [NB]
  bool* complete;        // [NB, G1]
  bool* exists;          // [NB, G1]
  bool* active;          // [NB, G1]
  bool* running;         // [NB]
  bool* done;            // [NB]
  bool* is_mask;         // [NB, Lb1]
  bool* need;            // [NB, Lb1]
  int64_t* lens;         // [NB]
  int64_t* window_lens;  // [NB]
  bool* to_cache;        // [G1]
  int64_t* shared_end;   // 0-d
  int64_t* layout_slot;  // 0-d
  int64_t* start;        // 0-d
  int64_t* commit_len;   // 0-d
  int64_t* head;         // [7]
};

struct RoundIn {
  const float* conf;  // [S]
  const int64_t* token;
  const float* p;
  const int64_t* x;  // [NB, Lb1]
  const int64_t* n_blocks;
  const int64_t* block_state;
  const bool* complete;
  const bool* eos;
  const bool* alive;
  const double* creation_conf;
  const int64_t* look_pos;
  const int64_t* counts;  // [8]
  const bool* exists;
  const bool* active;
  const bool* running;
  const bool* is_mask;
  const int64_t* lens;
  const bool* to_cache;
  const int64_t* shared_end;
  const int64_t* layout_slot;
  const int64_t* commit_len;
  const int64_t* win_pos;  // [Nb]
  const bool* win_valid;
  const bool* need_flat;  // [NB * Nb]
  const int64_t* prompt_len;
  const int64_t* gen_pos;  // [G * bs]
  const int64_t* block_start;
  const int64_t* block_end;
  const int64_t* pos_block;  // [Lb1]
  const bool* in_block;      // [Lb1, G1]
  const int64_t* lowest_k;   // [Lb1]
  const bool* grow_table;    // [bs + 1]
  const bool* activate_table;
  const double* skip_threshold;
  const double* alpha;
};

struct RoundOut {
  int64_t* winner;
  double* score;  // [NB]
  int64_t* last_row;
  bool* accepted;   // [Nb]
  int64_t* tokens;  // [Nb]
  int64_t* x;       // [NB, Lb1]
  bool* eos;
  bool* alive;
  double* creation_conf;
  int64_t* look_pos;
  int64_t* block_state;  // [G1]
  int64_t* counts;       // [8]
  PlanOut plan;
};

void select_round_cpu(const RoundDims& d, const RoundIn& in, const RoundOut& out);
void plan_round_cpu(const RoundDims& d, const int64_t* x, const int64_t* n_blocks, const int64_t* block_state,
                    const bool* complete, const bool* eos, const bool* alive, int64_t prompt_len,
                    const int64_t* gen_pos, const int64_t* block_start, const int64_t* block_end,
                    const bool* grow_table, const bool* activate_table, const PlanOut& o);

}  // namespace lopa_fast
