// write_kv_: a step's new K/V rows into their cache slots. Cache row slot_mapping[t] (of the
// [num_blocks * block_size, Hkv, D] view) = key[t], and the same for value: one copy per token and
// tensor. key and value may be views of the fused qkv activation (any token stride, each token's
// heads contiguous), so nothing is copied first. Slots are checked before anything is written.
#include "avx2_common.h"

namespace {

void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key,
               const at::Tensor& value, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv_: k_cache and v_cache must both be contiguous [num_blocks, block_size, "
              "Hkv, D], got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t kv_heads = k_cache.size(2), d = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == kv_heads &&
                  key.size(2) == d,
              "write_kv_: key and value must both be [T, ", kv_heads, ", ", d, "], got ",
              key.sizes(), " and ", value.sizes());
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d,
                "write_kv_: each token's key and value heads must be contiguous");
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                "write_kv_: key, value and the caches must share a dtype");
    TORCH_CHECK(t->device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                "write_kv_: CPU tensors only");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.device().is_cpu(),
              "write_kv_: slot_mapping must be [", key.size(0), "] int64 on the CPU, got ",
              slot_mapping.sizes(), " ", slot_mapping.scalar_type());
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t tokens = key.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_: slot_mapping[", t, "] = ",
                slot[t], " is outside the cache's ", num_slots, " slots");
  }
  const int64_t row_bytes = kv_heads * d * k_cache.element_size();
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  // A decode step's few rows stay on one thread; a long prompt's are split.
  constexpr int64_t kBytesPerTask = 256 * 1024;
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / (2 * row_bytes));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot[t] * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + slot[t] * row_bytes, vp + t * v_stride, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def(
      "write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, "
      "Tensor slot_mapping) -> ()",
      &write_kv_);
}
