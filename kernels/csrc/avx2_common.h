// Shared by the AVX2/FMA CPU kernels: bf16 <-> fp32 in registers, horizontal sums, raw pointers.
//
// bf16 -> fp32 is exact: a bf16 is the top 16 bits of an fp32, so zero-extend and shift left 16.
// The kernels register as torch ops (torch.ops.tgq_cpu_ops.*) rather than a pybind module: the
// lean headers below compile several times faster than <torch/extension.h>.
#pragma once

#include "torch_headers.h"

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace tgq_cpu {

using bf16_bits = uint16_t;  // raw bf16 storage
constexpr int64_t kVec = 8;  // fp32 lanes in a __m256

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const bf16_bits* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float to_f32(float v) { return v; }

inline float to_f32(bf16_bits v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (lanes below -87 flush to 0): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7), 2^n built in the exponent bits.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in a part exact in fp32 and the rest, so n * ln2_hi is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  const __m256i pow2n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)));
}

// fp32 -> bf16 bits in each 32-bit lane, round to nearest even (NaN stays a quiet NaN), as
// c10::BFloat16 does.
inline __m256i bf16_bits_rne(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
}

// v rounded to bf16 precision, still as fp32.
inline __m256 round8_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits_rne(v), 16));
}

inline void store8_bf16(bf16_bits* p, __m256 v) {
  const __m256i bits = bf16_bits_rne(v);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

template <typename OutT>
inline void store_out(OutT* p, float v) {
  *p = static_cast<OutT>(v);
}

template <>
inline void store_out<bf16_bits>(bf16_bits* p, float v) {
  *p = c10::BFloat16(v).x;  // round to nearest even
}

// Raw pointers of a tensor whose dtype is fp32 or bf16 (viewed as its bits).
template <typename T>
const T* data_as(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

template <typename T>
T* mutable_data_as(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace tgq_cpu
