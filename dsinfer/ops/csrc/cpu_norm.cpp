// RMSNorm on CPU in one pass per row, with the residual add before it fused in (issue 43: torch's float32
// rms_norm is six small ops, ~40 us a call at [1, 576], 61 calls a decode step of SmolLM2):
//   rms_norm(x, w, eps)               -> x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x, residual, w, eps) -> (rms_norm(x + residual, w, eps), x + residual)
// The sum of squares is taken in double (torch sums in float: results agree to an ulp or two, so this path is
// for the quantized layers only, never the exact float32 one); the rest rounds as torch does: (h * r) * w.
// ``dsinfer/ops/norm.py``'s ``rms_norm_ref`` is the reference the tests compare.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, H] float32");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == x.size(1), "weight must be contiguous [H] float32, H = ", x.size(1));
}

inline void norm_row(const float* h, const float* w, int64_t H, float eps, float* out) {
  double sq = 0.0;
  for (int64_t i = 0; i < H; ++i) sq += static_cast<double>(h[i]) * h[i];
  const float mean = static_cast<float>(sq) / static_cast<float>(H);
  const float r = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = (h[i] * r) * w[i];
}

// rows per task: one task for a decode step's few rows, many for a prompt's
constexpr int64_t kGrainElements = 1 << 15;

}  // namespace

namespace dsinfer {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const int64_t M = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(H, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xs + r * H, w, H, static_cast<float>(eps), o + r * H);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.sizes() == x.sizes(),
              "residual must be contiguous float32 of x's shape ", x.sizes());
  const int64_t M = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* rs = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(H, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t i = 0; i < H; ++i) s[r * H + i] = xs[r * H + i] + rs[r * H + i];
      norm_row(s + r * H, w, H, static_cast<float>(eps), o + r * H);
    }
  });
  return {out, sum};
}

}  // namespace dsinfer

TORCH_LIBRARY_FRAGMENT(dsinfer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsinfer_cpu, CPU, m) {
  m.impl("rms_norm", &dsinfer::rms_norm);
  m.impl("add_rms_norm", &dsinfer::add_rms_norm);
}
