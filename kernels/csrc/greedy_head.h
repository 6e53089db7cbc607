// The screened greedy lm_head (greedy_head.cpp checks and registers it, greedy_head_avx512.cpp
// runs it): each row's argmax over the logits x @ w^T, as the packed bf16 linear would compute
// them, reading an int8 copy of w and then only the few rows of w that could win. See greedy_head_avx512.cpp for the bound.
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

// True where greedy_head_avx512 can run: AVX512_BF16 and AVX512_VNNI; checked once.
bool cpu_has_avx512_vnni_bf16();

// Requires cpu_has_avx512_vnni_bf16() (and cpu_has_amx_int8() for args.amx).
void greedy_head_avx512(const GreedyHeadArgs& args);

}  // namespace tgq_cpu
