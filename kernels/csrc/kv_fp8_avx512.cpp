// An FP8 E4M3 KV cache's rows decoded to bf16 for the AVX-512 attention kernels (runs where
// cpu_has_avx512_8bit_linear(): AVX512_BF16 and AVX512_VBMI). Every E4M3 value is exactly a bf16
// value, so the decoded rows are those of `cache.to(torch.bfloat16)`, in the same order, and the
// kernels read them as they read a bf16 cache: the same sums, bit for bit.
//
// 64 bytes (two 32-value bf16 lines) take a load, the two byte lookups and the sign
// (e4m3_avx512.h), two vpermt2b that interleave the low and high bytes in element order, and two
// stores.
#include "attention_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi")
#include "avx512_common.h"
#include "e4m3_avx512.h"

namespace tgq_cpu {
namespace {

struct E4m3Decoder {
  Bf16ByteTables tables{e4m3_magnitude};
  __m512i first_line, second_line;  // vpermt2b indices: (low[i], high[i]) for i in 0-31, 32-63

  E4m3Decoder() {
    alignas(64) uint8_t first[64], second[64];
    for (int i = 0; i < 32; ++i) {
      first[2 * i] = static_cast<uint8_t>(i);  // indices 0-63 read `low`, 64-127 `high`
      first[2 * i + 1] = static_cast<uint8_t>(64 + i);
      second[2 * i] = static_cast<uint8_t>(32 + i);
      second[2 * i + 1] = static_cast<uint8_t>(96 + i);
    }
    first_line = _mm512_load_si512(first);
    second_line = _mm512_load_si512(second);
  }

  // values = row_values bytes (a multiple of 32) -> as many bf16 values at out.
  void row(const uint8_t* values, int64_t row_values, bf16_bits* out) const {
    int64_t i = 0;
    for (; i + 2 * kLineValues <= row_values; i += 2 * kLineValues) {
      __m512i low, high;
      tables.bytes(_mm512_loadu_si512(values + i), low, high);
      _mm512_storeu_si512(out + i, _mm512_permutex2var_epi8(low, first_line, high));
      _mm512_storeu_si512(out + i + kLineValues, _mm512_permutex2var_epi8(low, second_line, high));
    }
    if (i < row_values) {  // one 32-value line left
      __m512i low, high;
      tables.bytes(_mm512_castsi256_si512(
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i))),
                   low, high);
      _mm512_storeu_si512(out + i, _mm512_permutex2var_epi8(low, first_line, high));
    }
  }
};

}  // namespace

void e4m3_rows_to_bf16(const uint8_t* rows, int64_t stride, int64_t num_rows, int64_t row_values,
                       bf16_bits* out) {
  static const E4m3Decoder decoder;
  for (int64_t r = 0; r < num_rows; ++r) {
    decoder.row(rows + r * stride, row_values, out + r * row_values);
  }
}

// 32 bytes at a time, in 16-bit lanes, straight to bf16 (exactly: 2 mantissa bits): a normal
// value's 7 exponent-and-mantissa bits shifted up by 5 with the exponent rebiased by 112 (127 - 15);
// zero and the three subnormals (m * 2^-16) from a 4-entry table; exponent 31 (infinities, NaNs)
// to bf16's all-ones exponent with the mantissa kept; the sign put back.
void e5m2_rows_to_bf16(const uint8_t* rows, int64_t stride, int64_t num_rows, int64_t row_values,
                       bf16_bits* out) {
  const __m512i magnitude = _mm512_set1_epi16(0x7F), rebias = _mm512_set1_epi16(112 << 7);
  const __m512i low = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       0, 0, 0, 0, 0, 0, 0, 0, 0x3840, 0x3800, 0x3780, 0);
  const __m512i all_ones = _mm512_set1_epi16(0x7F80), two_bits = _mm512_set1_epi16(3);
  const __m512i sign_bit = _mm512_set1_epi16(0x80);
  for (int64_t r = 0; r < num_rows; ++r) {
    const uint8_t* row = rows + r * stride;
    bf16_bits* dst = out + r * row_values;
    for (int64_t i = 0; i < row_values; i += 32) {
      const int64_t left = row_values - i;
      const auto mask = static_cast<__mmask32>(left >= 32 ? 0xFFFFFFFFu : (1u << left) - 1);
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, row + i));
      const __m512i m = _mm512_and_si512(b, magnitude);
      __m512i v = _mm512_add_epi16(_mm512_slli_epi16(m, 5), rebias);
      v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(m, _mm512_set1_epi16(4)), m,
                                        low);
      v = _mm512_mask_mov_epi16(
          v, _mm512_cmpge_epu16_mask(m, _mm512_set1_epi16(0x7C)),
          _mm512_or_si512(all_ones, _mm512_slli_epi16(_mm512_and_si512(m, two_bits), 5)));
      v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(b, sign_bit), 8));
      _mm512_mask_storeu_epi16(dst + i, mask, v);
    }
  }
}

void fp8_rows_to_bf16(KvFormat format, const uint8_t* rows, int64_t stride, int64_t num_rows,
                      int64_t row_values, bf16_bits* out) {
  if (format == KvFormat::kFp8E5M2) {
    e5m2_rows_to_bf16(rows, stride, num_rows, row_values, out);
  } else {
    e4m3_rows_to_bf16(rows, stride, num_rows, row_values, out);
  }
}

}  // namespace tgq_cpu
