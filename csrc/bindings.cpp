// lopa_fast._C: the package's compiled CPU ops, bound with pybind11 (no torch headers: arguments are the data
// pointers of tensors the Python wrappers in lopa_fast/ops have checked, passed as integers). Adding an op: its
// source in csrc/, its declaration in a header, one m.def line below (setup.py compiles every csrc/*.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "first_nonfinite.h"
#include "rms_norm.h"
#include "rope.h"
#include "select_round.h"
#include "select_step.h"
#include "window_inputs.h"

namespace py = pybind11;
using lopa_fast::RoundDims;

namespace {

template <typename T>
T* ptr(const std::vector<uintptr_t>& p, size_t i) {
  return reinterpret_cast<T*>(p.at(i));
}

// ptrs: the 35 inputs then the 28 outputs of reference.ops.select_round, in its order; dims: NB, Lb1, G1, Nb, bs,
// mask_id, eos_id, n_look, shift, blend, score_all
void select_round(const std::vector<uintptr_t>& p, const std::vector<int64_t>& dims) {
  if (p.size() != 63 || dims.size() != 11) throw std::invalid_argument("select_round_cpu: 63 pointers, 11 dims");
  RoundDims d{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7],
              dims[8] != 0, dims[9] != 0, dims[10] != 0};
  size_t k = 0;
  lopa_fast::RoundIn in;
  in.conf = ptr<const float>(p, k++);
  in.token = ptr<const int64_t>(p, k++);
  in.p = ptr<const float>(p, k++);
  in.x = ptr<const int64_t>(p, k++);
  in.n_blocks = ptr<const int64_t>(p, k++);
  in.block_state = ptr<const int64_t>(p, k++);
  in.complete = ptr<const bool>(p, k++);
  in.eos = ptr<const bool>(p, k++);
  in.alive = ptr<const bool>(p, k++);
  in.creation_conf = ptr<const double>(p, k++);
  in.look_pos = ptr<const int64_t>(p, k++);
  in.counts = ptr<const int64_t>(p, k++);
  in.exists = ptr<const bool>(p, k++);
  in.active = ptr<const bool>(p, k++);
  in.running = ptr<const bool>(p, k++);
  in.is_mask = ptr<const bool>(p, k++);
  in.lens = ptr<const int64_t>(p, k++);
  in.to_cache = ptr<const bool>(p, k++);
  in.shared_end = ptr<const int64_t>(p, k++);
  in.layout_slot = ptr<const int64_t>(p, k++);
  in.commit_len = ptr<const int64_t>(p, k++);
  in.win_pos = ptr<const int64_t>(p, k++);
  in.win_valid = ptr<const bool>(p, k++);
  in.need_flat = ptr<const bool>(p, k++);
  in.prompt_len = ptr<const int64_t>(p, k++);
  in.gen_pos = ptr<const int64_t>(p, k++);
  in.block_start = ptr<const int64_t>(p, k++);
  in.block_end = ptr<const int64_t>(p, k++);
  in.pos_block = ptr<const int64_t>(p, k++);
  in.in_block = ptr<const bool>(p, k++);
  in.lowest_k = ptr<const int64_t>(p, k++);
  in.grow_table = ptr<const bool>(p, k++);
  in.activate_table = ptr<const bool>(p, k++);
  in.skip_threshold = ptr<const double>(p, k++);
  in.alpha = ptr<const double>(p, k++);
  lopa_fast::RoundOut out;
  out.winner = ptr<int64_t>(p, k++);
  out.score = ptr<double>(p, k++);
  out.last_row = ptr<int64_t>(p, k++);
  out.accepted = ptr<bool>(p, k++);
  out.tokens = ptr<int64_t>(p, k++);
  out.x = ptr<int64_t>(p, k++);
  out.eos = ptr<bool>(p, k++);
  out.alive = ptr<bool>(p, k++);
  out.creation_conf = ptr<double>(p, k++);
  out.look_pos = ptr<int64_t>(p, k++);
  out.block_state = ptr<int64_t>(p, k++);
  out.counts = ptr<int64_t>(p, k++);
  out.plan.n_blocks = ptr<int64_t>(p, k++);
  out.plan.complete = ptr<bool>(p, k++);
  out.plan.exists = ptr<bool>(p, k++);
  out.plan.active = ptr<bool>(p, k++);
  out.plan.running = ptr<bool>(p, k++);
  out.plan.done = ptr<bool>(p, k++);
  out.plan.is_mask = ptr<bool>(p, k++);
  out.plan.need = ptr<bool>(p, k++);
  out.plan.lens = ptr<int64_t>(p, k++);
  out.plan.window_lens = ptr<int64_t>(p, k++);
  out.plan.to_cache = ptr<bool>(p, k++);
  out.plan.shared_end = ptr<int64_t>(p, k++);
  out.plan.layout_slot = ptr<int64_t>(p, k++);
  out.plan.start = ptr<int64_t>(p, k++);
  out.plan.commit_len = ptr<int64_t>(p, k++);
  out.plan.head = ptr<int64_t>(p, k++);
  py::gil_scoped_release nogil;  // a server's other threads run while a round is selected
  lopa_fast::select_round_cpu(d, in, out);
}

// ptrs: the 12 inputs then the 16 outputs of reference.ops.plan_round (x, n_blocks, block_state, complete, eos,
// alive, prompt_len, gen_pos, block_start, block_end, grow_table, activate_table; RoundPlan's fields); dims: NB, Lb1,
// G1, bs, mask_id, shift
void plan_round(const std::vector<uintptr_t>& p, const std::vector<int64_t>& dims) {
  if (p.size() != 28 || dims.size() != 6) throw std::invalid_argument("plan_round_cpu: 28 pointers, 6 dims");
  RoundDims d{dims[0], dims[1], dims[2], 0, dims[3], dims[4], -1, 0, dims[5] != 0, false, false};
  lopa_fast::PlanOut o;
  size_t k = 12;
  o.n_blocks = ptr<int64_t>(p, k++);
  o.complete = ptr<bool>(p, k++);
  o.exists = ptr<bool>(p, k++);
  o.active = ptr<bool>(p, k++);
  o.running = ptr<bool>(p, k++);
  o.done = ptr<bool>(p, k++);
  o.is_mask = ptr<bool>(p, k++);
  o.need = ptr<bool>(p, k++);
  o.lens = ptr<int64_t>(p, k++);
  o.window_lens = ptr<int64_t>(p, k++);
  o.to_cache = ptr<bool>(p, k++);
  o.shared_end = ptr<int64_t>(p, k++);
  o.layout_slot = ptr<int64_t>(p, k++);
  o.start = ptr<int64_t>(p, k++);
  o.commit_len = ptr<int64_t>(p, k++);
  o.head = ptr<int64_t>(p, k++);
  py::gil_scoped_release nogil;
  lopa_fast::plan_round_cpu(d, ptr<const int64_t>(p, 0), ptr<const int64_t>(p, 1), ptr<const int64_t>(p, 2),
                            ptr<const bool>(p, 3), ptr<const bool>(p, 4), ptr<const bool>(p, 5),
                            *ptr<const int64_t>(p, 6), ptr<const int64_t>(p, 7), ptr<const int64_t>(p, 8),
                            ptr<const int64_t>(p, 9), ptr<const bool>(p, 10), ptr<const bool>(p, 11), o);
}

// ptrs: x, pos, valid, x0, conf, ent, finite, multi, noop, s, knob (reference.ops.select_step's 11 inputs) then its
// 5 outputs x, fm, multi, noop, head; dims: L, n, rule (STEP_RULES index), mask_id, B, conf is float64
void select_step(const std::vector<uintptr_t>& p, const std::vector<int64_t>& dims) {
  if (p.size() != 16 || dims.size() != 6) throw std::invalid_argument("select_step_cpu: 16 pointers, 6 dims");
  lopa_fast::StepArgs a{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5] != 0,
                        ptr<const int64_t>(p, 0), ptr<const int64_t>(p, 1), ptr<const bool>(p, 2),
                        ptr<const int64_t>(p, 3), ptr<const void>(p, 4), ptr<const double>(p, 5),
                        ptr<const bool>(p, 6), ptr<const int64_t>(p, 7), ptr<const int64_t>(p, 8),
                        ptr<const int64_t>(p, 9), ptr<const double>(p, 10), ptr<int64_t>(p, 11), ptr<int64_t>(p, 12),
                        ptr<int64_t>(p, 13), ptr<int64_t>(p, 14), ptr<int64_t>(p, 15)};
  if (a.rule < 0 || a.rule > lopa_fast::kFirst) throw std::invalid_argument("select_step_cpu: rule out of range");
  py::gil_scoped_release nogil;
  lopa_fast::select_step_cpu(a);
}

// ptrs: the 11 inputs then the 8 outputs of reference.ops.window_inputs (WindowInputs' fields); dims: NB, Lb1, Nb,
// Rb, blocks
void window_inputs(const std::vector<uintptr_t>& p, const std::vector<int64_t>& dims) {
  if (p.size() != 19 || dims.size() != 5) throw std::invalid_argument("window_inputs_cpu: 19 pointers, 5 dims");
  lopa_fast::WindowArgs a{dims[0], dims[1], dims[2], dims[3], dims[4] != 0,
                          ptr<const int64_t>(p, 0), ptr<const bool>(p, 1), ptr<const bool>(p, 2),
                          ptr<const int64_t>(p, 3), ptr<const bool>(p, 4), ptr<const int64_t>(p, 5),
                          ptr<const int64_t>(p, 6), ptr<const int64_t>(p, 7), ptr<const int64_t>(p, 8),
                          ptr<const int64_t>(p, 9), ptr<const int64_t>(p, 10),
                          ptr<int64_t>(p, 11), ptr<bool>(p, 12), ptr<int64_t>(p, 13), ptr<int64_t>(p, 14),
                          ptr<int64_t>(p, 15), ptr<bool>(p, 16), ptr<int64_t>(p, 17), ptr<int64_t>(p, 18)};
  py::gil_scoped_release nogil;
  lopa_fast::window_inputs_cpu(a);
}

// ptrs: q, k, cos, sin, q_out, k_out (float32); dims: B, n, Hq, Hkv, D, q's strides (B, n, head), k's, cos / sin's
// stride over B (0: one [n, D] table)
void rope(const std::vector<uintptr_t>& p, const std::vector<int64_t>& dims) {
  if (p.size() != 6 || dims.size() != 12) throw std::invalid_argument("rope_cpu: 6 pointers, 12 dims");
  lopa_fast::RopeArgs a{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8], dims[9],
                        dims[10], dims[11], ptr<const float>(p, 0), ptr<const float>(p, 1), ptr<const float>(p, 2),
                        ptr<const float>(p, 3), ptr<float>(p, 4), ptr<float>(p, 5)};
  if (a.D % 2) throw std::invalid_argument("rope_cpu: D must be even");
  py::gil_scoped_release nogil;
  lopa_fast::rope_cpu(a);
}

// ptrs: x, residual (0: none), weight, out, sum (0: none) (float32, contiguous); dims: rows, H; eps
void rms_norm(const std::vector<uintptr_t>& p, const std::vector<int64_t>& dims, double eps) {
  if (p.size() != 5 || dims.size() != 2) throw std::invalid_argument("rms_norm_cpu: 5 pointers, 2 dims");
  if ((p[1] == 0) != (p[4] == 0)) throw std::invalid_argument("rms_norm_cpu: residual and sum go together");
  lopa_fast::RmsNormArgs a{dims[0], dims[1], eps, ptr<const float>(p, 0), ptr<const float>(p, 1),
                           ptr<const float>(p, 2), ptr<float>(p, 3), ptr<float>(p, 4)};
  py::gil_scoped_release nogil;
  lopa_fast::rms_norm_cpu(a);
}

// ptrs: logits (float32), rows (long), n_real (0-d long, or 0: dims' n_real), temperature (0-d float64, or 0:
// the float argument), out (0-d long); dims: R, V, row stride, n_real, none, sampling
void first_nonfinite(const std::vector<uintptr_t>& p, const std::vector<int64_t>& dims, double temperature) {
  if (p.size() != 5 || dims.size() != 6) throw std::invalid_argument("first_nonfinite_cpu: 5 pointers, 6 dims");
  lopa_fast::GuardArgs a{dims[0], dims[1], dims[2], dims[3], dims[4], ptr<const float>(p, 0),
                         ptr<const int64_t>(p, 1), ptr<const int64_t>(p, 2), dims[5] != 0,
                         static_cast<float>(temperature), ptr<const double>(p, 3), ptr<int64_t>(p, 4)};
  py::gil_scoped_release nogil;
  lopa_fast::first_nonfinite_cpu(a);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "lopa_fast's compiled CPU ops (csrc/): select_round, plan_round, window_inputs, select_step, rope, rms_norm, first_nonfinite";
  m.def("select_round_cpu", &select_round, py::arg("ptrs"), py::arg("dims"),
        "select_round on CPU tensors: the data pointers of its 35 inputs and 28 outputs (lopa_fast.ops.select_round)");
  m.def("plan_round_cpu", &plan_round, py::arg("ptrs"), py::arg("dims"),
        "plan_round on CPU tensors: the data pointers of its 12 inputs and 16 outputs (lopa_fast.ops.plan_round)");
  m.def("window_inputs_cpu", &window_inputs, py::arg("ptrs"), py::arg("dims"),
        "window_inputs on CPU tensors: the data pointers of its 11 inputs and 8 outputs (lopa_fast.ops.window_inputs)");
  m.def("select_step_cpu", &select_step, py::arg("ptrs"), py::arg("dims"),
        "select_step on CPU tensors: the data pointers of its 11 inputs and 5 outputs (lopa_fast.ops.select_step)");
  m.def("rope_cpu", &rope, py::arg("ptrs"), py::arg("dims"),
        "rope on float32 CPU tensors: q, k, cos, sin, q_out, k_out and their dims / strides (lopa_fast.ops.rope)");
  m.def("rms_norm_cpu", &rms_norm, py::arg("ptrs"), py::arg("dims"), py::arg("eps"),
        "rms_norm / add_rms_norm on float32 CPU tensors: x, residual, weight, out, sum (0: none), rows, H, eps "
        "(lopa_fast.ops.rms_norm)");
  m.def("first_nonfinite_cpu", &first_nonfinite, py::arg("ptrs"), py::arg("dims"), py::arg("temperature"),
        "the D2F / LoPA round's numerics guard on float32 CPU logits (lopa_fast.ops.first_nonfinite)");
}
