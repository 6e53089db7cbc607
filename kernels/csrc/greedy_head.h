// The screened greedy lm_head (greedy_head.cpp checks and registers it, greedy_head_avx512.cpp
// and greedy_head_avx2.cpp run it): each row's argmax over the logits x @ w^T, as the CPU's bf16
// lm_head kernel computes them, reading an int8 copy of w and then only the few rows of w that
// could win. See greedy_head_avx512.cpp for the bound.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

// The int8 screen's layout: tiles of 16 output columns, [ceil(N / 16)][K / 4][16][4] int8, i.e.
// for each tile and quad of K values the 16 columns' four values side by side (one 64-byte line,
// what vpdpbusd multiplies); zeros past N.
constexpr int kScreenQuad = 4;

struct GreedyHeadArgs {
  const bf16_bits* x;        // [M, K], rows contiguous, K a multiple of 4
  const bf16_bits* w;        // [N, K], rows contiguous: the exact logits of the candidates
  const int8_t* q;           // the screen: q[n, k] = round(w[n, k] / scale[n]), |q| <= 127
  const float* scale;        // [N]
  const int32_t* q_sum;      // [N]: sum over k of q[n, k]
  const float* bound_x;      // [N]: error bound per unit of |x| (see greedy_head_avx512.cpp)
  const float* bound_ex;     // [N]: error bound per unit of |x - x quantized|
  int64_t M, N, K;
  int64_t max_candidates;    // a row with more candidates than this gets -1
  int64_t* out;              // [M]: the argmax, or -1: the caller computes that row in full
  // Structured output, or null: [M, mask_words] bitmasks, column n allowed for row m when bit
  // n % 32 of word n / 32 is set (none past the end). The argmax is then over allowed columns.
  const uint32_t* masks = nullptr;
  int64_t mask_words = 0;
  // The screen on AMX-INT8 tiles (cpu_has_amx_int8(), K % 64 == 0), else AVX512_VNNI; the same
  // integer sums either way, so the same tokens.
  bool amx = false;
};

// One row of x quantized for the screen: x ~ sx * xq with integers |xq| <= limit, stored as the
// unsigned bytes xq + limit + 1 (the integer dot products multiply unsigned by signed bytes; the
// q_sum term takes the offset back off), and the norms the bounds need. Scalar: it serves both
// kernels.
struct RowQuant {
  float sx = 1.0f;      // x ~ sx * xq
  float norm_x = 0.f;   // |x|
  float norm_ex = 0.f;  // |x - sx * xq|
  bool usable = false;  // false: non-finite or huge values; the caller computes the row in full
};

// ex is exact in double: sx * xq has at most 31 significant bits.
inline RowQuant quantize_row(const bf16_bits* x, int64_t K, int limit, uint8_t* xu8) {
  RowQuant r;
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_f32(x[k])));
  if (!(amax <= 0x1p32f)) return r;  // also NaN
  const float top = static_cast<float>(limit);
  if (amax > 0.f) r.sx = amax / top;
  double sum_x = 0, sum_ex = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float v = to_f32(x[k]);
    const float xq = std::clamp(std::nearbyint(v / r.sx), -top, top);
    xu8[k] = static_cast<uint8_t>(static_cast<int>(xq) + limit + 1);
    const double ex = static_cast<double>(v) - static_cast<double>(r.sx) * xq;
    sum_x += static_cast<double>(v) * v;
    sum_ex += ex * ex;
  }
  r.norm_x = static_cast<float>(std::sqrt(sum_x));
  r.norm_ex = static_cast<float>(std::sqrt(sum_ex));
  r.usable = true;
  return r;
}

// The largest K the screen takes: its integer sums stay within int32 (K * 255 * 127 < 2^31).
constexpr int64_t kScreenMaxK = int64_t{1} << 16;

// True where greedy_head_avx512 can run: AVX512_BF16 and AVX512_VNNI; checked once.
bool cpu_has_avx512_vnni_bf16();

// Requires cpu_has_avx512_vnni_bf16() (and cpu_has_amx_int8() for args.amx).
void greedy_head_avx512(const GreedyHeadArgs& args);

// The same on any AVX2/FMA CPU, against the AVX2 bf16 kernel's logits of each row alone
// (linear_bf16 path "avx2", one row per call: see greedy_head_avx2.cpp); args.amx must be false.
void greedy_head_avx2(const GreedyHeadArgs& args);

}  // namespace tgq_cpu
