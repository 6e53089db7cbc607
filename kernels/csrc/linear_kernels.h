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

// The experts of a sparse mixture-of-experts block with SiLU MLPs, weights packed and stacked:
// out[t] = sum over token t's k choices, in expert order, of bf16(expert(x[t]) * weight), each
// partial sum rounded to bf16 (as index_add_ adds them expert by expert); expert(v) =
// down(bf16(silu(gate)) * up) with [gate, up] = gate_up(v), every value rounded to bf16 as the
// unfused MLP rounds it. Each expert some token picked reads its weights once.
struct PackedExperts {
  const bf16_bits* x;        // [T, K]
  const int64_t* experts;    // [T, k]: expert ids in [0, E)
  const float* weights;      // [T, k]
  const bf16_bits* gate_up;  // [E] x packed [2I, K]
  const bf16_bits* down;     // [E] x packed [K, I]
  int64_t T, top_k, E, K, I;  // K and I even, I % 16 == 0
  bf16_bits* out;             // [T, K]
};

// Requires cpu_has_avx512_bf16().
void moe_experts_bf16_avx512(const PackedExperts& args);

// True where cpu_has_avx512_bf16() and the CPU has AMX-TILE and AMX-BF16 that this process may
// use (asked of Linux on the first call); checked once.
bool cpu_has_amx_bf16();

// The same for AMX-INT8 (the greedy head's screen, greedy_head_avx512.cpp).
bool cpu_has_amx_int8();

// The same on AMX tiles: requires cpu_has_amx_bf16() and K % 32 == 0; any M.
void linear_bf16_packed_amx(const PackedLinear& args);

}  // namespace tgq_cpu
