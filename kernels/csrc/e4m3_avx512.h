// FP8 E4M3 bytes to bf16 in registers, shared by the 8-bit linear (weights) and the attention
// kernels (an fp8 KV cache). Every E4M3 value is exactly a bf16 value, so the conversion is two
// 128-entry byte lookups (vpermt2b) of a byte's 7-bit magnitude code: the low and the high byte
// of its bf16 value; the byte's sign bit is then put back into the high byte. Include it after
// the file's `#pragma GCC target(... avx512bw,avx512vbmi ...)`; only code that runs where
// cpu_has_avx512_8bit_linear() (AVX512_BF16 and AVX512_VBMI) may call it.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace tgq_cpu {

// The value of magnitude code c (0..127) of E4M3 (bias 7, no infinities, 0x7F NaN): subnormal
// m * 2^-9 at exponent 0, else (1 + m / 8) * 2^(e - 7) (the OCP FP8 specification's E4M3).
inline float e4m3_magnitude(int c) {
  const int e = c >> 3, m = c & 7;
  if (c == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  return e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
}

// The low and high bytes of bf16(value_of(c)) for the codes c = 0..127, 64 entries a register.
struct Bf16ByteTables {
  __m512i lo0, lo1, hi0, hi1;

  // value_of(c) must be exactly a bf16 value (the low 16 bits of its fp32 are zero).
  template <typename ValueOf>
  explicit Bf16ByteTables(ValueOf value_of) {
    alignas(64) uint8_t lo[128], hi[128];
    for (int c = 0; c < 128; ++c) {
      const float f = value_of(c);
      uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof(bits));
      lo[c] = static_cast<uint8_t>(bits >> 16);
      hi[c] = static_cast<uint8_t>(bits >> 24);
    }
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
  }

  // 64 sign-and-magnitude bytes -> the low and the high bytes of their bf16 values, byte i of
  // each for byte i of q (vpermt2b reads bits 0-6 of each index byte: the sign is ignored there
  // and or-ed into the high byte).
  void bytes(__m512i q, __m512i& low, __m512i& high) const {
    low = _mm512_permutex2var_epi8(lo0, q, lo1);
    high = _mm512_permutex2var_epi8(hi0, q, hi1);
    high = _mm512_ternarylogic_epi32(high, q, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  }
};

}  // namespace tgq_cpu
