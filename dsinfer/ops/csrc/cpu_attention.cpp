// Paged attention for a decode step on CPU: one query row per sequence, float32 (issue 43: the torch path
// gathers the context, then two matmuls, a softmax and casts, ~8 ops a layer; this is one).
//   decode_attention(q [B, Hq, D], kv_cache [2, blocks, block_size, Hkv, D], slots [B, L] int64,
//                    seq_lens [B], scale, window) -> [B, Hq, D]
// Row b attends to the keys at context positions max(0, len - window) .. len - 1 (window 0: from 0), position p
// read from cache slot slots[b, p] (block * block_size + offset, as ``ops.attention``'s plan lays them out).
// Scores are float dot products times ``scale``, softmax with the row max subtracted, then the weighted sum of
// the value rows: the torch path's arithmetic, summed in another order (results agree to float rounding).
// ``dsinfer/ops/attention.py``'s ``paged_attention_ref`` is the reference the tests compare.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc[0:n] += p * v[0:n]
inline void axpy(float p, const float* __restrict v, float* __restrict acc, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * v[i];
}

}  // namespace

namespace dsinfer {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                            const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous [B, Hq, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be [2, blocks, block_size, Hkv, D] float32");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "kv_cache heads / dim do not fit q: ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == D && kv_cache.stride(2) == Hkv * D &&
                  kv_cache.stride(1) == kv_cache.size(2) * Hkv * D, "each half of kv_cache must be contiguous");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be contiguous [B, L] int64");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B, "seq_lens must be [B]");
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t L = slots.size(1), group = Hq / Hkv, num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* len_of = lens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len_of[b] >= 1 && len_of[b] <= L, "seq_lens[", b, "] = ", len_of[b], " is outside 1..", L);
    for (int64_t j = 0; j < len_of[b]; ++j)
      TORCH_CHECK(slot[b * L + j] >= 0 && slot[b * L + j] < num_slots, "slot ", slot[b * L + j], " is outside the cache");
  }
  const float* qs = q.data_ptr<float>();
  const float* keys = kv_cache.data_ptr<float>();
  const float* values = keys + kv_cache.stride(0);
  at::Tensor out = at::empty_like(q);
  float* o = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // one task per (sequence, KV head); a decode step's few tasks stay on one thread below ~64k multiply-adds
  const int64_t work = std::max<int64_t>(1, L * group * D);
  at::parallel_for(0, B * Hkv, std::max<int64_t>(1, (1 << 16) / work), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * L);
    std::vector<float> acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t len = len_of[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - first;
      const int64_t* row_slots = slot + b * L + first;
      for (int64_t g = 0; g < group; ++g) {
        const float* qrow = qs + (b * Hq + h * group + g) * D;
        float* s = scores.data() + g * L;
        float top = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = dot(qrow, keys + (row_slots[j] * Hkv + h) * D, D) * sc;
          top = std::max(top, s[j]);
        }
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - top);
          total += s[j];
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < n; ++j) {
          axpy(s[j] / total, values + (row_slots[j] * Hkv + h) * D, acc.data(), D);
        }
        std::copy(acc.begin(), acc.end(), o + (b * Hq + h * group + g) * D);
      }
    }
  });
  return out;
}

}  // namespace dsinfer

TORCH_LIBRARY_FRAGMENT(dsinfer_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor kv_cache, Tensor slots, Tensor seq_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsinfer_cpu, CPU, m) {
  m.impl("decode_attention", &dsinfer::decode_attention);
}
