// The bf16-weight linear kernels that linear_bf16.cpp dispatches between, per ISA.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

// out[M, N] = x[M, K] @ w[N, K]^T + bias, all rows contiguous.
struct SmallLinear {
  const bf16_bits* x;  // [M, K]
  const bf16_bits* w;  // [N, K]
  const float* bias;   // [N] or nullptr
  int64_t M, N, K;
  bf16_bits* out;    // [M, N] bf16, or nullptr when out_f32 is set
  float* out_f32;    // [M, N]: the bf16-rounded results widened to fp32 (logits), or nullptr
};

// True on CPUs with AVX512F/BW/VL and AVX512_BF16 (vdpbf16ps); checked once.
bool cpu_has_avx512_bf16();

// Requires cpu_has_avx512_bf16(); written for small M (a decode step's rows).
void linear_bf16_avx512(const SmallLinear& args);

}  // namespace tgq_cpu
