// One Llama-family decoder layer of a CPU decode step in one call (issue 43: the layer's ~9 module calls and the
// Python between its kernels cost more than its norms, rope and attention together):
//   decode_layer(hidden [M, H], residual [M, H] or None, ln1, ln2, eps, qkv, o, gate_up, down, heads, kv_heads,
//                positions [M], cos_sin_cache, kv_cache, slot_mapping [M], slots [M, L], seq_lens [M], scale)
//                -> (hidden, residual)
// Each linear is [qweight, scales, mins] (int4) or [qweight, scales] (int8). The steps are the module path's, in
// its order and by the same kernels (cpu_ops.h), with the same tensors between them, so the outputs are bit for
// bit the module path's: input RMSNorm (fused with the residual add after the first layer), q/k/v projection,
// NeoX rope of q and k with k and v stored in the cache, decode attention, output projection, the post-attention
// RMSNorm with its residual add, gate/up projection, SiLU(gate) * up (ATen's silu and mul, as
// ``ops.activation.silu_and_mul_ref``), down projection. ``models/llama.py`` decides when a step takes it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "cpu_ops.h"

namespace {

at::Tensor linear(const at::Tensor& x, at::TensorList w) {
  TORCH_CHECK(w.size() == 2 || w.size() == 3, "a linear is [qweight, scales(, mins)], got ", w.size(), " tensors");
  return w.size() == 3 ? dsinfer::int4_linear(x, w[0], w[1], w[2]) : dsinfer::int8_linear(x, w[0], w[1]);
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& ln1, const at::Tensor& ln2,
    double eps, at::TensorList qkv, at::TensorList o, at::TensorList gate_up, at::TensorList down, int64_t heads,
    int64_t kv_heads, const at::Tensor& positions, const at::Tensor& cos_sin_cache, at::Tensor kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& slots, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [M, H], got ", hidden.sizes());
  const int64_t M = hidden.size(0), D = kv_cache.size(4);
  at::Tensor h, res;
  if (residual.has_value()) {
    std::tie(h, res) = dsinfer::add_rms_norm(hidden, *residual, ln1, eps);
  } else {
    res = hidden;
    h = dsinfer::rms_norm(hidden, ln1, eps);
  }
  const at::Tensor proj = linear(h, qkv);
  TORCH_CHECK(proj.size(1) == (heads + 2 * kv_heads) * D, "qkv's ", proj.size(1), " outputs do not fit ", heads,
              " + 2 x ", kv_heads, " heads of ", D);
  const at::Tensor q = proj.narrow(1, 0, heads * D).view({M, heads, D});
  const at::Tensor k = proj.narrow(1, heads * D, kv_heads * D).view({M, kv_heads, D});
  const at::Tensor v = proj.narrow(1, (heads + kv_heads) * D, kv_heads * D).view({M, kv_heads, D});
  const at::Tensor rotated = dsinfer::rotary_store_kv(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping);
  const at::Tensor attn = dsinfer::decode_attention(rotated, kv_cache, slots, seq_lens, scale, 0);  // full attention
  std::tie(h, res) = dsinfer::add_rms_norm(linear(attn.view({M, heads * D}), o), res, ln2, eps);
  const at::Tensor gu = linear(h, gate_up);
  const int64_t inter = gu.size(1) / 2;
  const at::Tensor act = at::mul(at::silu(gu.narrow(1, 0, inter)), gu.narrow(1, inter, inter));
  return {linear(act, down), res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsinfer_cpu, m) {
  m.def("decode_layer(Tensor hidden, Tensor? residual, Tensor ln1, Tensor ln2, float eps, Tensor[] qkv, Tensor[] o, "
        "Tensor[] gate_up, Tensor[] down, int heads, int kv_heads, Tensor positions, Tensor cos_sin_cache, "
        "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor slots, Tensor seq_lens, float scale) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsinfer_cpu, CPU, m) {
  m.impl("decode_layer", &decode_layer);
}
