// Shared by the AVX2/FMA CPU kernels: bf16 <-> fp32 in registers, horizontal sums, raw pointers.
//
// bf16 -> fp32 is exact: a bf16 is the top 16 bits of an fp32, so zero-extend and shift left 16.
// The kernels register as torch ops (torch.ops.tgq_cpu_ops.*) rather than a pybind module: the
// lean headers below compile several times faster than <torch/extension.h>.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
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
