// quantize_inputs: a W8A8 linear's input quantized to 8 bits and dequantized again, in one pass
// per row instead of a dozen torch ops (gpu_worker/layers/activation_quant.py has the torch path
// and the meaning; the op gives the same values bit for bit).
//
// Torch computes each elementwise step of a bf16 tensor in fp32 and rounds the result to bf16;
// the op does the same step by step (c10::BFloat16 is torch's own conversion, to nearest, ties
// to even; FP8 E4M3 rounding is written out branch-free below, so that the loops vectorize, and
// tested against torch's conversion). An fp32 x has no rounding between the steps.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "input_quant.h"

namespace {

template <typename T>
float step(float value) {  // one torch step's result in T
  return static_cast<float>(static_cast<T>(value));
}

// v in [-448, 448] to the nearest FP8 E4M3 value, ties to even: normal values (|v| >= 2^-6)
// keep 3 mantissa bits (round half to even at bit 20 of the fp32 bits; a carry moves into the
// exponent as it should), subnormal ones are multiples of 2^-9.
inline float round_e4m3(float v) {
  const float a = std::fabs(v);
  uint32_t bits = 0;
  std::memcpy(&bits, &a, sizeof(bits));
  bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & 0xFFF00000u;
  float normal = 0;
  std::memcpy(&normal, &bits, sizeof(normal));
  const float subnormal = std::nearbyint(a * 512.0f) * (1.0f / 512.0f);
  return std::copysign(a < 0.015625f ? subnormal : normal, v);
}

inline float round_8bit(float scaled, bool fp8) {
  return fp8 ? round_e4m3(scaled) : std::nearbyint(scaled);
}

// x / scale, clamped to [low, high], rounded to the 8-bit type, times scale: each in T.
template <typename T>
void round_trip(const T* x, T* out, int64_t n, float scale, bool fp8, float low, float high) {
  for (int64_t i = 0; i < n; ++i) {
    const float scaled = std::clamp(step<T>(static_cast<float>(x[i]) / scale), low, high);
    out[i] = static_cast<T>(round_8bit(scaled, fp8) * scale);
  }
}

// max(|min(x)| with min clamped to <= 0, max(x) clamped to >= 0) over [x, x + n).
template <typename T>
float amax(const T* x, int64_t n) {
  float smallest = 0, largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    smallest = std::min(smallest, static_cast<float>(x[i]));
    largest = std::max(largest, static_cast<float>(x[i]));
  }
  return std::max(-smallest, largest);
}

template <typename T>
void quantize(const at::Tensor& x, at::Tensor& out, bool fp8, bool per_token) {
  const float low = fp8 ? -448.0f : -128.0f, high = fp8 ? 448.0f : 127.0f;
  const float half_range = step<T>(step<T>(high - low) / 2);
  const float eps = static_cast<float>(std::numeric_limits<T>::epsilon());
  const int64_t rows = x.size(0), K = x.size(1);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  auto scale_of = [&](float largest) {
    const float scale = step<T>(largest / half_range);
    return scale == 0 ? eps : scale;
  };
  const float whole = per_token ? 0 : scale_of(amax(src, rows * K));
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float scale = per_token ? scale_of(amax(src + r * K, K)) : whole;
      round_trip(src + r * K, dst + r * K, K, scale, fp8, low, high);
    }
  });
}

// Static: x in fp32 over the stored fp32 scale, the result back in x's dtype.
template <typename T>
void quantize_static(const at::Tensor& x, at::Tensor& out, bool fp8, float scale) {
  const float low = fp8 ? -448.0f : -128.0f, high = fp8 ? 448.0f : 127.0f;
  const int64_t n = x.numel();
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float scaled = std::clamp(static_cast<float>(src[i]) / scale, low, high);
      dst[i] = static_cast<T>(round_8bit(scaled, fp8) * scale);
    }
  });
}

// Each row of x [M, K] as int8 codes, stored as code + 128 (the unsigned operand of vpdpbusd),
// at out + r * ld, and its scale: the values `quantize_inputs` (int8) rounds, before it multiplies
// them back. Dynamic scales are x's dtype's (each row's, or one for all rows); a static one is
// fp32 and so is x / scale.
template <typename T>
void codes_of(const at::Tensor& x, bool per_token, std::optional<float> static_scale,
              uint8_t* out, int64_t ld, float* scales) {
  const int64_t rows = x.size(0), K = x.size(1);
  const T* src = x.data_ptr<T>();
  const float half_range = step<T>(step<T>(127.0f + 128.0f) / 2);
  const float eps = static_cast<float>(std::numeric_limits<T>::epsilon());
  auto scale_of = [&](float largest) {
    const float scale = step<T>(largest / half_range);
    return scale == 0 ? eps : scale;
  };
  const float whole = static_scale ? *static_scale : per_token ? 0 : scale_of(amax(src, rows * K));
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = src + r * K;
      const float scale = per_token && !static_scale ? scale_of(amax(row, K)) : whole;
      scales[r] = scale;
      uint8_t* dst = out + r * ld;
      for (int64_t i = 0; i < K; ++i) {
        const float divided = static_cast<float>(row[i]) / scale;
        const float scaled = std::clamp(static_scale ? divided : step<T>(divided), -128.0f, 127.0f);
        dst[i] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(scaled)) + 128);
      }
    }
  });
}

}  // namespace

namespace tgq_cpu {

void int8_input_codes(const at::Tensor& x, bool per_token, std::optional<float> static_scale,
                      uint8_t* out, int64_t ld, float* scales) {
  if (x.scalar_type() == at::kFloat) {
    codes_of<float>(x, per_token, static_scale, out, ld, scales);
  } else {
    codes_of<c10::BFloat16>(x, per_token, static_scale, out, ld, scales);
  }
}

}  // namespace tgq_cpu

namespace {

at::Tensor quantize_inputs(const at::Tensor& x, bool fp8, bool per_token,
                           const std::optional<at::Tensor>& static_scale) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quantize_inputs: x must be [M, K] on CPU");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "quantize_inputs: x must be fp32 or bf16, got ", dtype);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  if (xc.numel() == 0) return out;
  if (static_scale.has_value()) {
    TORCH_CHECK(static_scale->numel() == 1 && static_scale->scalar_type() == at::kFloat,
                "quantize_inputs: the static scale must be one fp32 value");
    const float scale = static_scale->item<float>();
    if (dtype == at::kFloat) {
      quantize_static<float>(xc, out, fp8, scale);
    } else {
      quantize_static<c10::BFloat16>(xc, out, fp8, scale);
    }
  } else if (dtype == at::kFloat) {
    quantize<float>(xc, out, fp8, per_token);
  } else {
    quantize<c10::BFloat16>(xc, out, fp8, per_token);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def(
      "quantize_inputs(Tensor x, bool fp8, bool per_token, Tensor? static_scale=None) -> Tensor",
      &quantize_inputs);
}
