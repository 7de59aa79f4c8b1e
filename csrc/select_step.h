// select_step's CPU kernel: arguments as raw pointers into contiguous tensors (see
// lopa_fast/reference/ops.py::select_step for every tensor's meaning). L canvas positions, n rows.
#pragma once
#include <cstdint>

namespace lopa_fast {

enum StepRule : int64_t { kThreshold = 0, kEntropy = 1, kFactor = 2, kFirst = 3 };  // reference.ops.STEP_RULES

struct StepArgs {
  int64_t L, n, rule, mask_id, B;
  bool conf_is_double;      // conf is float64 (the LLaDA family's statistics), else float32
  const int64_t* x;         // [L]
  const int64_t* pos;       // [n]
  const bool* valid;        // [n]
  const int64_t* x0;        // [n]
  const void* conf;         // [n] float32 or float64
  const double* ent;        // [n]
  const bool* finite;       // [n]
  const int64_t* multi;     // 0-d
  const int64_t* noop;      // 0-d
  const int64_t* s;         // 0-d
  const double* knob;       // 0-d
  // outputs
  int64_t* x_out;           // [L]
  int64_t* fm_out;          // 0-d
  int64_t* multi_out;       // 0-d
  int64_t* noop_out;        // 0-d
  int64_t* head_out;        // [4]
};

void select_step_cpu(const StepArgs& a);

}  // namespace lopa_fast
