// Rope on q and k, then k and v stored into the paged cache, in one op for a float32 CPU step (issue 43: the
// torch path is ~10 small ops a layer). NeoX style (rotate halves) over whole heads:
//   rotary_store_kv(positions [T], q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], cos_sin_cache [P, D],
//                   kv_cache [2, blocks, block_size, Hk, D], slot_mapping [T]) -> rotated q [T, Hq, D]
// with the rotated k and v written at kv_cache[0 / 1] slot slot_mapping[t] (negative slots skipped).
// x1 * cos - x2 * sin and x2 * cos + x1 * sin are rounded as torch rounds them (built with -ffp-contract=off:
// no fused multiply-adds), so the result equals ``ops.rotary.rotary_store_kv_ref``'s bit for bit.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <cstdint>

namespace {

void check_heads(const at::Tensor& x, const char* name, int64_t T, int64_t D) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(0) == T && x.size(2) == D && x.stride(2) == 1 &&
                  x.stride(1) == D, name, " must be float32 [T, H, D] with contiguous heads, got ", x.sizes());
}

inline void rotate(const float* x, const float* cos, const float* sin, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

}  // namespace

namespace dsinfer {

at::Tensor rotary_store_kv(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& cos_sin_cache, at::Tensor kv_cache,
                           const at::Tensor& slot_mapping) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), half = D / 2;
  check_heads(q, "q", T, D);
  check_heads(k, "k", T, D);
  check_heads(v, "v", T, D);
  TORCH_CHECK(v.size(1) == Hk && D % 2 == 0, "v must have k's heads and D must be even");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == D && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous [positions, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == Hk && kv_cache.size(4) == D &&
                  kv_cache.scalar_type() == at::kFloat && kv_cache.stride(4) == 1 && kv_cache.stride(3) == D &&
                  kv_cache.stride(2) == Hk * D && kv_cache.stride(1) == kv_cache.size(2) * Hk * D,
              "kv_cache must be [2, blocks, block_size, Hk, D] float32, each half contiguous");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
              "positions and slot_mapping must be [T]");
  const at::Tensor pos = positions.to(at::kLong).contiguous(), slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_positions = cos_sin_cache.size(0), num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < num_positions, "position ", p[t], " is outside the rope cache (", num_positions, ")");
    TORCH_CHECK(s[t] < num_slots, "slot ", s[t], " is outside the cache (", num_slots, " slots)");
  }
  at::Tensor out = at::empty({T, Hq, D}, q.options());
  const float* cs = cos_sin_cache.data_ptr<float>();
  float* keys = kv_cache.data_ptr<float>();
  float* values = keys + kv_cache.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    const float* cos = cs + p[t] * D;
    const float* sin = cos + half;
    for (int64_t h = 0; h < Hq; ++h)
      rotate(q.data_ptr<float>() + t * q.stride(0) + h * D, cos, sin, half, out.data_ptr<float>() + (t * Hq + h) * D);
    if (s[t] < 0) continue;
    for (int64_t h = 0; h < Hk; ++h) {
      rotate(k.data_ptr<float>() + t * k.stride(0) + h * D, cos, sin, half, keys + (s[t] * Hk + h) * D);
      const float* src = v.data_ptr<float>() + t * v.stride(0) + h * D;
      float* dst = values + (s[t] * Hk + h) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = src[i];
    }
  }
  return out;
}

}  // namespace dsinfer

TORCH_LIBRARY_FRAGMENT(dsinfer_cpu, m) {
  m.def("rotary_store_kv(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos_sin_cache, Tensor(a!) kv_cache, "
        "Tensor slot_mapping) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsinfer_cpu, CPU, m) {
  m.impl("rotary_store_kv", &dsinfer::rotary_store_kv);
}
