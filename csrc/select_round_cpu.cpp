// CPU C++ `select_round` (semantics: lopa_fast.reference.ops.select_round), torch.ops.lopa_fast_cpp.select_round.
// Inputs arrive normalised by lopa_fast/ops/_cpp.py: accept_value/conf fp32 [B, n], masked bool [B, n],
// block_ids int64 [B, n], block_complete bool [B, nb], creation_conf fp32 [B] | None, branch_active bool [B] | None,
// all contiguous. Branches in parallel; per branch: threshold accept, the at-least-one fallback per complete
// block, the n_look best remaining candidates (stable: earlier position first on equal conf), the mean of the
// k = max(1, floor(m * topp)) lowest conf values over the m masked positions, the score, then the winner.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

// The comparator codes come from lopa_fast/contracts.py as -D defines (lopa_fast/ops/_cpp.py passes them).
#if !defined(LOPA_CMP_GT) || !defined(LOPA_CMP_GE) || !defined(LOPA_CMP_LE)
#error "build with the -D flags of lopa_fast.contracts.code_defines() (lopa_fast/ops/_cpp.py does)"
#endif

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_round_cpu(
    const at::Tensor& value, const at::Tensor& conf, const at::Tensor& masked, const at::Tensor& block_ids,
    const at::Tensor& complete, double tau, int64_t cmp, int64_t n_look, double topp, double alpha,
    const std::optional<at::Tensor>& creation_conf, const std::optional<at::Tensor>& branch_active) {
  TORCH_CHECK(conf.dim() == 2 && conf.scalar_type() == at::kFloat && conf.is_contiguous(), "select_round: conf");
  TORCH_CHECK(value.sizes() == conf.sizes() && value.scalar_type() == at::kFloat && value.is_contiguous(),
              "select_round: accept_value");
  TORCH_CHECK(masked.sizes() == conf.sizes() && masked.scalar_type() == at::kBool && masked.is_contiguous(),
              "select_round: masked");
  TORCH_CHECK(block_ids.sizes() == conf.sizes() && block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(),
              "select_round: block_ids");
  TORCH_CHECK(complete.dim() == 2 && complete.size(0) == conf.size(0) && complete.scalar_type() == at::kBool &&
                  complete.is_contiguous(),
              "select_round: block_complete");
  TORCH_CHECK(cmp == LOPA_CMP_GT || cmp == LOPA_CMP_GE || cmp == LOPA_CMP_LE, "select_round: comparator code ", cmp);
  const int64_t B = conf.size(0), n = conf.size(1), nb = complete.size(1);
  const float tau_f = static_cast<float>(tau);  // the reference compares fp32 tensors with the scalar in fp32
  const float a_f = static_cast<float>(alpha), b_f = static_cast<float>(1.0 - alpha);

  at::Tensor accept = at::empty({B, n}, masked.options());
  at::Tensor look = at::empty({B, n_look}, block_ids.options());
  at::Tensor score = at::empty({B}, conf.options());
  const float* v = value.const_data_ptr<float>();
  const float* c = conf.const_data_ptr<float>();
  const bool* msk = masked.const_data_ptr<bool>();
  const int64_t* bid = block_ids.const_data_ptr<int64_t>();
  const bool* done = complete.const_data_ptr<bool>();
  const float* cc = creation_conf ? creation_conf->const_data_ptr<float>() : nullptr;
  bool* acc = accept.data_ptr<bool>();
  int64_t* lk = look.data_ptr<int64_t>();
  float* sc = score.data_ptr<float>();

  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> idx;
    std::vector<float> vals;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b * n;
      for (int64_t i = 0; i < n; ++i) {
        const float x = v[r + i];
        const bool hit = cmp == LOPA_CMP_GT ? x > tau_f : cmp == LOPA_CMP_GE ? x >= tau_f : x <= tau_f;
        acc[r + i] = msk[r + i] && bid[r + i] >= 0 && hit;
      }
      for (int64_t j = 0; j < nb; ++j) {
        int64_t first = -1;
        bool any_accept = false;
        for (int64_t i = 0; i < n; ++i) {
          if (!msk[r + i] || bid[r + i] != j) continue;
          any_accept = any_accept || acc[r + i];
          if (first < 0 || c[r + i] > c[r + first]) first = i;  // strict: the earliest arg-max
        }
        if (done[b * nb + j] && first >= 0 && !any_accept) acc[r + first] = true;
      }
      idx.clear();
      for (int64_t i = 0; i < n; ++i)
        if (msk[r + i] && bid[r + i] >= 0 && !acc[r + i]) idx.push_back(i);
      std::stable_sort(idx.begin(), idx.end(), [&](int64_t x, int64_t y) { return c[r + x] > c[r + y]; });
      for (int64_t t = 0; t < n_look; ++t) lk[b * n_look + t] = t < (int64_t)idx.size() ? idx[t] : -1;
      vals.clear();
      for (int64_t i = 0; i < n; ++i)
        if (msk[r + i]) vals.push_back(c[r + i]);
      const int64_t m = vals.size();
      float future = 1.f;
      if (m > 0) {
        const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(m) * topp));  // Python int()
        std::partial_sort(vals.begin(), vals.begin() + k, vals.end());
        double s = 0.0;
        for (int64_t t = 0; t < k; ++t) s += vals[t];
        future = static_cast<float>(s) / static_cast<float>(k);
      }
      sc[b] = a_f * (cc ? cc[b] : 1.f) + b_f * future;
    }
  });

  const bool* act = branch_active ? branch_active->const_data_ptr<bool>() : nullptr;
  int64_t win = -1;
  for (int64_t b = 0; b < B; ++b)
    if ((!act || act[b]) && (win < 0 || sc[b] > sc[win])) win = b;
  at::Tensor winner = at::empty({}, block_ids.options());
  winner.data_ptr<int64_t>()[0] = win;
  return {accept, look, score, winner};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lopa_fast_cpp, m) {
  m.def(
      "select_round(Tensor accept_value, Tensor conf, Tensor masked, Tensor block_ids, Tensor block_complete, "
      "float tau, int comparator, int n_look, float topp, float alpha, Tensor? creation_conf, "
      "Tensor? branch_active) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lopa_fast_cpp, CPU, m) { m.impl("select_round", &select_round_cpu); }
