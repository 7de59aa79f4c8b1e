// CPU C++ `confidence` (semantics: lopa_fast.reference.ops.confidence; p = exp(x - lse) here, within the tests'
// tolerance rule of the reference's softmax), registered with TORCH_LIBRARY as
// torch.ops.lopa_fast_cpp.confidence. Per-op ATen headers only (11-15 s build; torch/extension.h ~90 s).
// Rows in parallel (at::parallel_for); per row the same two passes as kernels/cuda/confidence.cu:
//   max + top-1 (lowest index on ties) + top-2, then sum exp(x - max) (-> lse), then sum p*log(p+eps).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

namespace {

template <typename T>
void rows(const T* x, int64_t row_stride, int64_t V, int64_t suppress, float eps, int64_t begin, int64_t end,
          int64_t* token, float* p_max, float* margin, float* neg_entropy, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = begin; r < end; ++r) {
    const T* row = x + r * row_stride;
    float t1 = kNegInf, t2 = kNegInf;
    int64_t i1 = -1;
    for (int64_t j = 0; j < V; ++j) {  // max and top-2 first: no per-element rescale of the sum
      const float f = j == suppress ? kNegInf : static_cast<float>(row[j]);
      if (f > t1 || i1 < 0) {
        t2 = i1 < 0 ? kNegInf : t1;
        t1 = f;
        i1 = j;
      } else if (f > t2) {
        t2 = f;
      }
    }
    const float m = t1;  // the row max
    double s = 0.0;  // double sums: a sequential fp32 sum over 152k entries drifts by ~5e-4 (measured)
    if (m != kNegInf) {
      for (int64_t j = 0; j < V; ++j) s += j == suppress ? 0.f : std::exp(static_cast<float>(row[j]) - m);
    }
    const float l = m + static_cast<float>(std::log(s));
    double acc = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      const float p = j == suppress ? 0.f : std::exp(static_cast<float>(row[j]) - l);
      acc += p * std::log(p + eps);
    }
    token[r] = i1 < 0 ? 0 : i1;
    p_max[r] = std::exp(t1 - l);
    margin[r] = std::exp(t1 - l) - std::exp(t2 - l);
    neg_entropy[r] = static_cast<float>(acc);
    lse[r] = l;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> confidence_cpu(const at::Tensor& logits,
                                                                                      int64_t suppress, double eps) {
  TORCH_CHECK(logits.dim() == 2, "confidence: logits must be [N, V], got ", logits.sizes());
  TORCH_CHECK(logits.stride(1) == 1, "confidence: logits needs a contiguous last dim, strides ", logits.strides());
  const int64_t N = logits.size(0), V = logits.size(1);
  auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor token = at::empty({N}, logits.options().dtype(at::kLong));
  at::Tensor p_max = at::empty({N}, f32), margin = at::empty({N}, f32), ne = at::empty({N}, f32),
             lse = at::empty({N}, f32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "confidence_cpu", [&] {
    using T = scalar_t;
    const T* x = logits.const_data_ptr<T>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
      rows<T>(x, logits.stride(0), V, suppress, static_cast<float>(eps), b, e, token.data_ptr<int64_t>(),
              p_max.data_ptr<float>(), margin.data_ptr<float>(), ne.data_ptr<float>(), lse.data_ptr<float>());
    });
  });
  return {token, p_max, margin, ne, lse};
}

}  // namespace

TORCH_LIBRARY(lopa_fast_cpp, m) {
  m.def("confidence(Tensor logits, int suppress, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lopa_fast_cpp, CPU, m) { m.impl("confidence", &confidence_cpu); }
