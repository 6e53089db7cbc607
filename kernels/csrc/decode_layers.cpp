// decode_layers_: every decoder layer of a decode-only step (one token per sequence) on the CPU
// kernels, in one call. gpu_worker/models/cpu_decode.py (CpuDecodePath) captures the layers'
// weights at load and calls this instead of the modules' forward; it runs the same ops (through the
// dispatcher, as the Python path does), in the same order, on the same tensors, so the result is
// bit-identical to the modules'. What it saves is the ~10 Python -> C++ op calls per layer and
// their views: ~3 us each, a few percent of a batch-1 step.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/slice.h>

#include "avx2_common.h"

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Tensor = at::Tensor;
using OptionalTensor = std::optional<at::Tensor>;

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      op<Tensor(const Tensor&, const Tensor&, double)>("tgq_cpu_ops::rms_norm");
  c10::TypedOperatorHandle<Tensor(Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm =
      op<Tensor(Tensor&, const Tensor&, const Tensor&, double)>("tgq_cpu_ops::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, const OptionalTensor&,
                                  bool)>
      linear = op<Tensor(const Tensor&, const Tensor&, int64_t, const OptionalTensor&, bool)>(
          "tgq_cpu_ops::linear_bf16_packed");
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)> rotary =
      op<void(Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>("tgq_cpu_ops::rotary_qk_");
  c10::TypedOperatorHandle<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>
      write_kv = op<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
          "tgq_cpu_ops::write_kv_");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, int64_t, c10::string_view)>
      attention = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, double, int64_t, c10::string_view)>(
          "tgq_cpu_ops::paged_decode_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul =
      op<Tensor(const Tensor&)>("tgq_cpu_ops::silu_mul");
};

constexpr int64_t kNormsPerLayer = 2;    // input, post-attention
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down

void decode_layers_(Tensor& x, at::TensorList norms, at::TensorList weights,
                    const c10::List<OptionalTensor>& biases, at::IntArrayRef out_features,
                    at::TensorList k_caches, at::TensorList v_caches, const Tensor& cos,
                    const Tensor& sin, const Tensor& slot_mapping, const Tensor& block_tables,
                    const Tensor& kv_lens, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, double eps, double scale, at::IntArrayRef windows) {
  const auto layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0, "decode_layers_: no layers");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNormsPerLayer * layers &&
                  static_cast<int64_t>(weights.size()) == kLinearsPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kLinearsPerLayer * layers &&
                  static_cast<int64_t>(out_features.size()) == kLinearsPerLayer * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decode_layers_: per layer, 2 norms, 4 weights, biases and out_features, one K and "
              "V cache and one window, for ", layers, " layers");
  TORCH_CHECK(x.dim() == 2, "decode_layers_: x must be [tokens, hidden], got ", x.sizes());
  static const Ops ops;
  const int64_t tokens = x.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto linear = [&](const Tensor& in, int64_t layer, int64_t which) {
    const int64_t i = kLinearsPerLayer * layer + which;
    const OptionalTensor bias = biases.get(i);
    return ops.linear.call(in, weights[i], out_features[i], bias, false);
  };
  Tensor delta;
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor& input_norm = norms[kNormsPerLayer * l];
    Tensor hidden = delta.defined() ? ops.add_rms_norm.call(x, delta, input_norm, eps)
                                    : ops.rms_norm.call(x, input_norm, eps);
    Tensor qkv = linear(hidden, l, 0);
    ops.rotary.call(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    const Tensor k = at::slice(qkv, 1, q_size, q_size + kv_size).view({tokens, num_kv_heads, head_dim});
    const Tensor v = at::slice(qkv, 1, q_size + kv_size).view({tokens, num_kv_heads, head_dim});
    Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    ops.write_kv.call(k_cache, v_cache, k, v, slot_mapping);
    const Tensor q = at::slice(qkv, 1, 0, q_size).view({tokens, num_heads, head_dim});
    const Tensor out = ops.attention.call(q, k_cache, v_cache, block_tables, kv_lens, scale,
                                          windows[l], "auto");
    const Tensor attn = linear(out.view({tokens, q_size}), l, 1);
    hidden = ops.add_rms_norm.call(x, attn, norms[kNormsPerLayer * l + 1], eps);
    delta = linear(ops.silu_mul.call(linear(hidden, l, 2)), l, 3);
  }
  x.add_(delta);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def(
      "decode_layers_(Tensor(a!) x, Tensor[] norms, Tensor[] weights, Tensor?[] biases, "
      "int[] out_features, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor block_tables, Tensor kv_lens, int num_heads, int num_kv_heads, "
      "int head_dim, float eps, float scale, int[] windows) -> ()",
      &decode_layers_);
}
