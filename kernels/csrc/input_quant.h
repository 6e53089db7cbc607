// A W8A8 linear's inputs as int8 codes (input_quant.cpp), for the integer kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace tgq_cpu {

// x [M, K] (fp32 or bf16, contiguous) -> each row's int8 codes plus 128, K bytes at out + r * ld,
// and its scale in scales[r]: the codes `quantize_inputs(x, fp8=false, ...)` multiplies back by
// that scale (dynamic per row with `per_token`, dynamic for all rows without, or `static_scale`).
void int8_input_codes(const at::Tensor& x, bool per_token, std::optional<float> static_scale,
                      uint8_t* out, int64_t ld, float* scales);

}  // namespace tgq_cpu
