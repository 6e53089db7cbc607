// The AVX-512 loops of the fused elementwise ops (fused_avx512.cpp), for cpu_fused.cpp.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

// out[i] = bf16(bf16(silu(gate[i])) * up[i]) for the leading multiple of 16 of `count` values,
// bit-identical to cpu_fused.cpp's 8-lane loop; returns how many it did (the caller does the
// rest). Requires cpu_has_avx512_bf16() (linear_kernels.h), which implies the ISA it uses.
int64_t silu_mul_row_avx512(const bf16_bits* gate, const bf16_bits* up, int64_t count,
                            bf16_bits* out);

// The same with GeGLU's tanh-approximated GELU in place of SiLU.
int64_t gelu_tanh_mul_row_avx512(const bf16_bits* gate, const bf16_bits* up, int64_t count,
                                 bf16_bits* out);

}  // namespace tgq_cpu
