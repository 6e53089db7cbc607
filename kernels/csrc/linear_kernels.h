// The bf16-weight linear kernels that linear_bf16.cpp dispatches between, per ISA.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

// Weights packed for the AVX-512 kernel: tiles of kPackColumns output columns, [ceil(N / 16)]
// [ceil(K / 2)][16][2] bf16, i.e. for each tile and pair of K values the 16 columns' two values
// side by side. w[n, k] sits at ((n / 16 * ceil(K / 2) + k / 2) * 16 + n % 16) * 2 + k % 2; the
// padding past N and K is zeros.
constexpr int kPackColumns = 16;

// out[M, N] = x[M, K] @ w[N, K]^T + bias, w packed.
struct PackedLinear {
  const bf16_bits* x;  // [M, x_stride] with x_stride = 2 * ceil(K / 2), zeros past K
  const bf16_bits* w;  // packed
  const float* bias;   // [N] or nullptr
  int64_t M, N, x_stride;
  bf16_bits* out;    // [M, N] bf16, or nullptr when out_f32 is set
  float* out_f32;    // [M, N]: the bf16-rounded results widened to fp32 (logits), or nullptr
};

// True on CPUs with AVX512F/BW/VL and AVX512_BF16 (vdpbf16ps); checked once.
bool cpu_has_avx512_bf16();

// Requires cpu_has_avx512_bf16(); any M (decode steps and prefill chunks).
void linear_bf16_packed_avx512(const PackedLinear& args);

// True where cpu_has_avx512_bf16() and the CPU has AMX-TILE and AMX-BF16 that this process may
// use (asked of Linux on the first call); checked once.
bool cpu_has_amx_bf16();

// The same for AMX-INT8 (the greedy head's screen, greedy_head_avx512.cpp).
bool cpu_has_amx_int8();

// The same on AMX tiles: requires cpu_has_amx_bf16() and K % 32 == 0; any M.
void linear_bf16_packed_amx(const PackedLinear& args);

}  // namespace tgq_cpu
