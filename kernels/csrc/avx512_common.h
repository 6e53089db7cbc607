// Shared by the AVX-512 kernels (linear_avx512_bf16.cpp, fused_avx512.cpp): bf16 <-> fp32 on 16
// lanes. Include it after the file's `#pragma GCC target(... avx512 ...)`, which these inline
// functions need; only code that runs where cpu_has_avx512_bf16() may call them.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

// 16 bf16 values widened to fp32 (exact).
inline __m512 load16_bf16(const bf16_bits* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// fp32 -> bf16 bits in each 32-bit lane, round to nearest even, a NaN to the quiet NaN 0x7fc0:
// c10::BFloat16's conversion (vcvtneps2bf16 would flush denormals instead).
inline __m512i bf16_bits_rne16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
}

// The same, packed to 16 bf16 values.
inline __m256i to_bf16_rne(__m512 v) { return _mm512_cvtepi32_epi16(bf16_bits_rne16(v)); }

}  // namespace tgq_cpu
