// Weight-only quantized linears for CPU: y[M, N] = x[M, K] W^T with W in blocks of 32 along K.
//
// The activations are quantized per row in blocks of 32 to int16 (scale = max|x| / 32767, round half to even;
// llama.cpp's int8 q8_0 / q8_1 changed the bundled model's greedy answers, this does not), and each block's dot
// product is integer (AVX2: madd_epi16 on the weights widened to int16), then scaled:
//   int4 ("q4"): w = d * q + m, q in 0..15, byte j of a block holding element j (low nibble) and j + 16 (high):
//                ggml's Q4_0 / Q4_1 layout, so GGUF blocks are copied in as they are; d, m float16.
//                sum_blocks d * dx * sum(q * xq) + m * dx * sum(xq).
//   int8 ("q8"): w = d * q, q int8 (Q8_0), d float16: sum_blocks d * dx * sum(q * xq).
// Weight rows are split over torch's intra-op threads; each weight block is unpacked once and used by up to 4
// activation rows at a time, so a batch of rows reads the weights once.
// ``dsinfer/ops/cpu_quant.py`` holds the torch reference with the same arithmetic and the op registration.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DSINFER_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRows = 4;  // activation rows sharing one unpacked weight block

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

constexpr float kQmax = 32767.f;

// x [M, K] float32 -> xq [M, K] int16, xd [M, K/32] (scale), xs [M, K/32] (scale * sum of the block's q)
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* xd, float* xs) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* src = x + r * K + b * kBlock;
        int16_t* dst = xq + r * K + b * kBlock;
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(src[i]));
        const float d = amax / kQmax;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int i = 0; i < kBlock; ++i) {
          int q = static_cast<int>(std::nearbyint(src[i] * inv));  // default rounding mode: half to even
          q = std::min(32767, std::max(-32767, q));
          dst[i] = static_cast<int16_t>(q);
          sum += q;
        }
        xd[r * nb + b] = d;
        xs[r * nb + b] = d * static_cast<float>(sum);
      }
    }
  });
}

#ifdef DSINFER_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// weight block b's 32 elements as int16: w0 elements 0..15, w1 16..31 (int4: low nibbles, then high nibbles)
template <bool Int4>
inline void unpack_block(const uint8_t* wq, int64_t b, __m256i& w0, __m256i& w1) {
  if constexpr (Int4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + b * 16));
    w0 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low));
    w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low));
  } else {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + b * 32)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + b * 32 + 16)));
  }
}
#endif

// one weight row n against activation rows r0 .. r0 + R - 1
template <int R, bool Int4>
inline void dot_rows(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, const int16_t* xq,
                     const float* xd, const float* xs, int64_t K, float* out, int64_t ldo) {
  float mins[R] = {};
#ifdef DSINFER_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float d = _cvtsh_ss(wd[b]);
    __m256i w0, w1;
    unpack_block<Int4>(wq, b, w0, w1);
    const float m = Int4 ? _cvtsh_ss(wm[b]) : 0.f;
    for (int r = 0; r < R; ++r) {
      const int16_t* x = xq + r * K + b * kBlock;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r * nb + b]), _mm256_cvtepi32_ps(p), acc[r]);
      if constexpr (Int4) mins[r] += m * xs[r * nb + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]) + mins[r];
#else
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half_to_float(wd[b]);
    for (int r = 0; r < R; ++r) {
      const int16_t* x = xq + r * K + b * kBlock;
      int sum = 0;
      for (int i = 0; i < kBlock; ++i) {
        int q;
        if constexpr (Int4) {
          const uint8_t byte = wq[b * 16 + (i % 16)];
          q = i < 16 ? (byte & 0x0F) : (byte >> 4);
        } else {
          q = reinterpret_cast<const int8_t*>(wq)[b * 32 + i];
        }
        sum += q * x[i];
      }
      acc[r] += d * xd[r * nb + b] * static_cast<float>(sum);
      if constexpr (Int4) mins[r] += half_to_float(wm[b]) * xs[r * nb + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = acc[r] + mins[r];
#endif
}

#ifdef DSINFER_AVX2
// One weight row against one activation row (a decode step's linears): dot_rows<1>'s products, with the block
// scales taken 8 at a time (one float16 conversion and one multiply for 8 blocks, not one each), the minimums'
// term as one vector FMA per 8 blocks, and even and odd blocks in two accumulators, so that consecutive blocks do
// not wait on one FMA chain. Sums in another order than dot_rows<1>: results agree to float rounding.
template <bool Int4>
inline float dot_row(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, const int16_t* xq,
                     const float* xd, const float* xs) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 macc = _mm256_setzero_ps();
  float mtail = 0.f;
  alignas(32) float scale[8];
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int64_t n = std::min<int64_t>(8, nb - b0);
    if (n == 8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b0)));
      _mm256_store_ps(scale, _mm256_mul_ps(d, _mm256_loadu_ps(xd + b0)));
      if constexpr (Int4) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + b0)));
        macc = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + b0), macc);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        scale[j] = _cvtsh_ss(wd[b0 + j]) * xd[b0 + j];
        if constexpr (Int4) mtail += _cvtsh_ss(wm[b0 + j]) * xs[b0 + j];
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = b0 + j;
      __m256i w0, w1;
      unpack_block<Int4>(wq, b, w0, w1);
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock + 16));
      const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
      acc[j & 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + j), _mm256_cvtepi32_ps(p), acc[j & 1]);
    }
  }
  return hsum(_mm256_add_ps(acc[0], acc[1])) + (hsum(macc) + mtail);
}
#endif

template <bool Int4>
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor* mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(1) == (Int4 ? K / 2 : K), "qweight must be [N, ",
              (Int4 ? K / 2 : K), "], got ", qweight.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == N &&
                  scales.size(1) == K / kBlock, "scales must be contiguous [N, K/32] float16");
  if (mins != nullptr) {
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "mins must be contiguous [N, K/32] float16");
  }
  const int64_t nb = K / kBlock;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), xd.data(), xs.data());
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  const auto* wq = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const auto* wd = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const auto* wm = mins != nullptr ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr;
  const int64_t row_bytes = Int4 ? K / 2 : K;
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* w = wq + n * row_bytes;
      const uint16_t* d = wd + n * nb;
      const uint16_t* m = wm != nullptr ? wm + n * nb : nullptr;
      int64_t r = 0;
      for (; r + kRows <= M; r += kRows)
        dot_rows<kRows, Int4>(w, d, m, nb, xq.data() + r * K, xd.data() + r * nb, xs.data() + r * nb, K,
                              out + r * N + n, N);
      for (; r < M; ++r) {
#ifdef DSINFER_AVX2
        out[r * N + n] = dot_row<Int4>(w, d, m, nb, xq.data() + r * K, xd.data() + r * nb, xs.data() + r * nb);
#else
        dot_rows<1, Int4>(w, d, m, nb, xq.data() + r * K, xd.data() + r * nb, xs.data() + r * nb, K,
                          out + r * N + n, N);
#endif
      }
    }
  });
  return y;
}

}  // namespace

namespace dsinfer {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  return quant_linear<true>(x, qweight, scales, &mins);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return quant_linear<false>(x, qweight, scales, nullptr);
}

}  // namespace dsinfer

namespace {

bool has_avx2() {
#ifdef DSINFER_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(dsinfer_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsinfer_cpu, CPU, m) {
  m.impl("int4_linear", &dsinfer::int4_linear);
  m.impl("int8_linear", &dsinfer::int8_linear);
}

// simd_width(): 256 where the AVX2 path was compiled in, else 0 (scalar loops)
TORCH_LIBRARY_FRAGMENT(dsinfer_cpu, m) {
  m.def("simd_width() -> int", []() -> int64_t { return has_avx2() ? 256 : 0; });
}
