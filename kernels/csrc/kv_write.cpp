// write_kv_: a step's new K/V rows into their cache slots. Cache row slot_mapping[t] (of the
// [num_blocks * block_size, Hkv, D] view) = key[t], and the same for value: one copy per token and
// tensor. key and value may be views of the fused qkv activation (any token stride, each token's
// heads contiguous), so nothing is copied first. Slots are checked before anything is written.
//
// FP8 caches take bf16 or fp32 rows, each value quantized with its cache's fp32 scale: the byte
// is torch's `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` (E4M3), or
// `(x.float() / scale).clamp(-57344, 57344).to(torch.float8_e5m2)` (E5M2), bit for bit.
#include "avx2_common.h"

namespace {

using tgq_cpu::bf16_bits;
using tgq_cpu::kVec;

// The FP8 bytes (in the low byte of each lane) of 8 values as torch rounds them, for a format of
// M mantissa bits and exponent bias B saturating at `largest` (E4M3: 3, 7, 448; E5M2: 2, 15,
// 57344): y = x / scale in fp32, saturated (a NaN stays one), then to nearest, ties to even:
//  - |y| >= 2^(1 - B) (normal): the fp32 significand rounded to M bits in the integer domain,
//    the exponent rebiased from 127 to B;
//  - below (subnormal, m * 2^(1 - B - M)): |y| + 2^(23 + 1 - B - M) rounds, in the fp32 add, to
//    a multiple of that ulp, whose low bits are m (E4M3's m = 8 is 2^-6, whose code is 8 too);
//  - a NaN: 0x7F. The sign bit is y's.
template <int M, int B>
inline __m256i fp8_codes(__m256 x, __m256 scale, float largest) {
  constexpr int kShift = 23 - M;
  const __m256 limit = _mm256_set1_ps(largest);
  // max/min return their second operand when either is NaN: a NaN y passes through.
  const __m256 y = _mm256_min_ps(limit, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), limit),
                                                      _mm256_div_ps(x, scale)));
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i magnitude = _mm256_xor_si256(bits, sign);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, kShift), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(
      magnitude, _mm256_add_epi32(odd, _mm256_set1_epi32((1 << (kShift - 1)) - 1)));
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, kShift),
                                          _mm256_set1_epi32((127 - B) << M));
  const __m256 magic = _mm256_castsi256_ps(_mm256_set1_epi32((127 + 23 + 1 - B - M) << 23));
  const __m256i subnormal =
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(magnitude), magic)),
                       _mm256_castps_si256(magic));
  const __m256i is_normal =
      _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(((127 + 1 - B) << 23) - 1));
  const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
  __m256i code = _mm256_blendv_epi8(subnormal, normal, is_normal);
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), is_nan);
  return _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
}

// The low bytes of the 8 lanes, to out[0..7].
inline void store_bytes(__m256i codes, uint8_t* out) {
  const __m256i words = _mm256_packus_epi32(codes, codes);  // per 128-bit half: c0-3 c0-3
  const __m256i bytes = _mm256_packus_epi16(words, words);  // per half: c0-3 four times
  const __m256i both =
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(both));
}

// n values of x -> their FP8 bytes at out (E5M2 with kE5m2, else E4M3).
template <typename T, bool kE5m2>
void fp8_row(const T* x, int64_t n, __m256 scale, uint8_t* out) {
  const auto codes = [scale](__m256 v) {
    return kE5m2 ? fp8_codes<2, 15>(v, scale, 57344.0f) : fp8_codes<3, 7>(v, scale, 448.0f);
  };
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) store_bytes(codes(tgq_cpu::load8(x + i)), out + i);
  if (i < n) {  // the tail, through a zero-padded vector
    float tail[kVec] = {};
    uint8_t bytes[kVec];
    for (int64_t j = i; j < n; ++j) tail[j - i] = tgq_cpu::to_f32(x[j]);
    store_bytes(codes(_mm256_loadu_ps(tail)), bytes);
    std::memcpy(out + i, bytes, n - i);
  }
}

// A token's Hkv * D values of key or value -> their bytes in an fp8 cache row.
using QuantizeRow = void (*)(const char* row, int64_t n, float scale, char* out);

template <typename T, bool kE5m2>
void quantize_row(const char* row, int64_t n, float scale, char* out) {
  fp8_row<T, kE5m2>(reinterpret_cast<const T*>(row), n, _mm256_set1_ps(scale),
                    reinterpret_cast<uint8_t*>(out));
}

// key and value share a dtype, and so do the caches: the same one (rows copied as they are, no
// scales: both 1), or float8_e4m3fn or float8_e5m2 caches beside bf16 or fp32 rows, with finite
// scales > 0.
// Returns how rows are quantized, nullptr where they are copied.
QuantizeRow check_dtypes(const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& key, const at::Tensor& value, double k_scale,
                         double v_scale) {
  const at::ScalarType rows = key.scalar_type(), cache = k_cache.scalar_type();
  TORCH_CHECK(rows == value.scalar_type() && cache == v_cache.scalar_type(),
              "write_kv_: key and value must share a dtype, and so must the caches");
  if (rows == cache) {
    TORCH_CHECK(k_scale == 1.0 && v_scale == 1.0, "write_kv_: k_scale and v_scale apply to "
                "fp8 caches of bf16 or fp32 rows only, got ", k_scale, " and ",
                v_scale, " for ", cache, " rows and caches");
    return nullptr;
  }
  const bool e5m2 = cache == at::kFloat8_e5m2;
  TORCH_CHECK((cache == at::kFloat8_e4m3fn || e5m2) &&
                  (rows == at::kBFloat16 || rows == at::kFloat),
              "write_kv_: key, value and the caches must share a dtype, or the caches be "
              "float8_e4m3fn or float8_e5m2 and key and value bf16 or fp32, got ", rows, " and ",
              cache);
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              "write_kv_: k_scale and v_scale must be finite and > 0, got ", k_scale, " and ",
              v_scale);
  if (e5m2) return rows == at::kFloat ? quantize_row<float, true> : quantize_row<bf16_bits, true>;
  return rows == at::kFloat ? quantize_row<float, false> : quantize_row<bf16_bits, false>;
}

void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key,
               const at::Tensor& value, const at::Tensor& slot_mapping, double k_scale,
               double v_scale) {
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
    TORCH_CHECK(t->device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                "write_kv_: CPU tensors only");
  }
  const QuantizeRow quantize = check_dtypes(k_cache, v_cache, key, value, k_scale, v_scale);
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
  const int64_t row_values = kv_heads * d, row_bytes = row_values * k_cache.element_size();
  // torch's `x.float() / scale` divides by the scale rounded to fp32.
  const float k_scale_f = static_cast<float>(k_scale), v_scale_f = static_cast<float>(v_scale);
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
      if (quantize == nullptr) {
        std::memcpy(kc + slot[t] * row_bytes, kp + t * k_stride, row_bytes);
        std::memcpy(vc + slot[t] * row_bytes, vp + t * v_stride, row_bytes);
      } else {
        quantize(kp + t * k_stride, row_values, k_scale_f, kc + slot[t] * row_bytes);
        quantize(vp + t * v_stride, row_values, v_scale_f, vc + slot[t] * row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def(
      "write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, "
      "Tensor slot_mapping, float k_scale=1.0, float v_scale=1.0) -> ()",
      &write_kv_);
}
