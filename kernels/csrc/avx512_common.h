// Shared by the AVX-512 kernels (linear, fused elementwise ops, decode attention): bf16 <-> fp32
// and e^x on 16 lanes. Include it after the file's `#pragma GCC target(... avx512 ...)`, which
// these inline functions need; only code that runs where cpu_has_avx512_bf16() may call them.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

constexpr int kLineValues = 32;  // bf16 values in a 64-byte line (16 pairs, one per fp32 lane)

// A line of 32 bf16 values as the 16 pairs vdpbf16ps multiplies.
inline __m512bh load_pairs(const bf16_bits* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// The pair of bf16 values at p in all 16 lanes.
inline __m512bh broadcast_pair(const bf16_bits* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

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

// exp_nonpositive (avx2_common.h) on 16 lanes.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 is_tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  const __m512i pow2n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~is_tiny),
                             _mm512_mul_ps(p, _mm512_castsi512_ps(pow2n)));
}

// tanh on 16 lanes as sign(x) (1 - e) / (1 + e), e = e^(-2|x|) <= 1 (no overflow); absolute
// error ~1e-7, as good as fp32 gets near +-1, relative error larger only where |x| < ~1e-3.
inline __m512 tanh16(__m512 x) {
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m512i bits = _mm512_castps_si512(x);
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, bits));
  const __m512 e = exp_nonpositive16(_mm512_mul_ps(magnitude, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(bits, sign_bit)));
}

// r[i] lane j <-> r[j] lane i.
inline void transpose16(__m512 (&r)[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d p0 = _mm512_castps_pd(a[4 * i]), p1 = _mm512_castps_pd(a[4 * i + 1]);
    const __m512d p2 = _mm512_castps_pd(a[4 * i + 2]), p3 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(p0, p2));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p2));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(p1, p3));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(p1, p3));
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      a[8 * i + j] = _mm512_shuffle_f32x4(b[8 * i + j], b[8 * i + 4 + j], 0x88);
      a[8 * i + 4 + j] = _mm512_shuffle_f32x4(b[8 * i + j], b[8 * i + 4 + j], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(a[j], a[8 + j], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(a[j], a[8 + j], 0xdd);
  }
}

}  // namespace tgq_cpu
