// The CPU kernels' entry points, shared by the files that define them and by ``cpu_layer.cpp``'s fused decode
// layer, which calls them directly (no dispatcher, no Python between them). Each is registered as a
// ``torch.ops.dsinfer_cpu`` op in its own file; the Python wrappers and references are in ``dsinfer/ops``.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace dsinfer {

// cpu_quant.cpp: y [M, N] float32 = x [M, K] float32 W^T, W in blocks of 32 (int4 with mins, int8 without)
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales);

// cpu_norm.cpp: RMSNorm of contiguous float32 rows; add_rms_norm -> (norm(x + residual), x + residual)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

// cpu_rotary.cpp: NeoX rope of q and k [T, H, D] at positions, k and v stored at slot_mapping; -> rotated q
at::Tensor rotary_store_kv(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& cos_sin_cache, at::Tensor kv_cache,
                           const at::Tensor& slot_mapping);

// cpu_attention.cpp: one query row per sequence over its context's cache slots; -> [B, Hq, D]
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                            const at::Tensor& seq_lens, double scale, int64_t window);

}  // namespace dsinfer
