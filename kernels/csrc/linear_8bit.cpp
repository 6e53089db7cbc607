// The 8-bit-weight linear's ops (`--quantize int8|fp8`, checkpoints): pack_weight_8bit and
// linear_8bit_packed over weights packed once at load, for one of two kernels whose layouts
// differ (linear_kernels.h): "avx512" (linear_8bit_avx512.cpp: AVX512_BF16 and VBMI), a 3-d
// tensor whose dtype says how its bytes read: int8 (int8 weights in [-127, 127]), uint8 (int8
// weights that contain -128, ByteCode::kInt8Minus128), float8_e4m3fn; or "avx2"
// (linear_8bit_avx2.cpp: any CPU the kernels build for), a 4-d tensor of int8 or float8_e4m3fn.
// linear_8bit_packed tells them apart by the rank. The torch path for GPUs is Python's
// (gpu_worker/layers/linear.py).
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <string_view>

#include "linear_kernels.h"

namespace {

using namespace tgq_cpu;

// int8 q -> sign and magnitude (-128: 0x80, the "-0" no other value uses); E4M3 bits as they are.
uint8_t byte_code(const uint8_t* src, int64_t i, bool is_int8) {
  if (!is_int8) return src[i];
  const auto q = static_cast<int8_t>(src[i]);
  return static_cast<uint8_t>(q < 0 ? 0x80 | -q : q);
}

// The AVX2 layout: the bytes as they are, 16 columns side by side per K value. Its E4M3 decoding
// has no NaN (S.1111.111 would read as 480): weights holding one are refused.
at::Tensor pack_avx2(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), blocks = ceil_div(K, kAvx2ByteBlockValues);
  if (w.scalar_type() == at::kFloat8_e4m3fn) {
    const auto* bytes = static_cast<const uint8_t*>(w.data_ptr());
    TORCH_CHECK(std::none_of(bytes, bytes + w.numel(), [](uint8_t b) { return (b & 0x7F) == 0x7F; }),
                "pack_weight_8bit: FP8 weights hold NaN");
  }
  at::Tensor packed =
      at::zeros({ceil_div(N, kPackColumns), blocks, kAvx2ByteBlockValues, kPackColumns},
                w.options());
  const auto* src = static_cast<const uint8_t*>(w.data_ptr());
  auto* dst = static_cast<uint8_t*>(packed.data_ptr());
  const int64_t tile_bytes = blocks * kAvx2ByteBlockBytes;
  at::parallel_for(0, packed.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < kPackColumns && t * kPackColumns + c < N; ++c) {
        const uint8_t* row = src + (t * kPackColumns + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[t * tile_bytes + k * kPackColumns + c] = row[k];
      }
    }
  });
  return packed;
}

// layout: "avx512" or "avx2", the kernel that will read it.
at::Tensor pack_weight_8bit(const at::Tensor& weight, c10::string_view layout) {
  const std::string_view kernel(layout.data(), layout.size());
  TORCH_CHECK(kernel == "avx512" || kernel == "avx2", "pack_weight_8bit: unknown kernel '", kernel,
              "' (avx2, avx512)");
  TORCH_CHECK(weight.dim() == 2, "pack_weight_8bit: weight must be [N, K], got ", weight.sizes());
  const bool is_int8 = weight.scalar_type() == at::kChar;
  TORCH_CHECK(is_int8 || weight.scalar_type() == at::kFloat8_e4m3fn,
              "pack_weight_8bit: weight must be int8 or float8_e4m3fn, got ", weight.scalar_type());
  TORCH_CHECK(weight.device().is_cpu(), "pack_weight_8bit: CPU tensors only");
  const at::Tensor w = weight.contiguous();
  if (kernel == "avx2") return pack_avx2(w);
  const int64_t N = w.size(0), K = w.size(1), blocks = ceil_div(K, 4);
  const auto* src = static_cast<const uint8_t*>(w.data_ptr());
  const bool has_minus128 = is_int8 && std::any_of(src, src + w.numel(), [](uint8_t b) {
                              return b == 0x80;
                            });
  at::Tensor packed = at::empty({ceil_div(N, kPackColumns), blocks, kByteBlockBytes},
                                w.options().dtype(has_minus128 ? at::kByte : w.scalar_type()));
  auto* dst = static_cast<uint8_t*>(packed.data_ptr());
  at::parallel_for(0, packed.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < blocks; ++j) {
        uint8_t* block = dst + (t * blocks + j) * kByteBlockBytes;
        for (int h = 0; h < 2; ++h) {
          for (int i = 0; i < 2 * kPackColumns; ++i) {  // index in line 2j + h: column * 2 + k % 2
            const int64_t n = t * kPackColumns + i / 2, k = 2 * (2 * j + h) + i % 2;
            block[i / 8 * 16 + h * 8 + i % 8] = n < N && k < K ? byte_code(src, n * K + k, is_int8)
                                                               : 0;
          }
        }
      }
    }
  });
  return packed;
}

// For the avx2 layout, kernel: "auto" (avx512f where the CPU has it, else avx2), "avx2" or
// "avx512f"; the avx512 layout takes "auto" or "avx512". Whether the 16-lane kernel runs.
bool use_avx512f(c10::string_view name, bool avx2_layout) {
  const std::string_view kernel(name.data(), name.size());
  if (!avx2_layout) {
    TORCH_CHECK(kernel == "auto" || kernel == "avx512", "linear_8bit_packed: kernel '", kernel,
                "' does not read the avx512 layout (auto, avx512)");
    return false;
  }
  TORCH_CHECK(kernel == "auto" || kernel == "avx2" || kernel == "avx512f",
              "linear_8bit_packed: kernel '", kernel,
              "' does not read the avx2 layout (auto, avx2, avx512f)");
  TORCH_CHECK(kernel != "avx512f" || cpu_has_avx512f_kernels(),
              "linear_8bit_packed: kernel 'avx512f' needs a CPU with AVX512F, BW and VL");
  return kernel == "avx512f" || (kernel == "auto" && cpu_has_avx512f_kernels());
}

at::Tensor linear_8bit_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale, int64_t N,
                              const std::optional<at::Tensor>& bias, bool out_fp32,
                              c10::string_view kernel) {
  const bool avx2 = packed.dim() == 4;
  const bool wide = use_avx512f(kernel, avx2);
  TORCH_CHECK(avx2 || cpu_has_avx512_8bit_linear(),
              "linear_8bit_packed: the avx512 layout needs a CPU with AVX512_BF16 and AVX512_VBMI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "linear_8bit_packed: x must be [M, K] bf16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), blocks = ceil_div(K, 4);
  TORCH_CHECK(K > 0 && N > 0, "linear_8bit_packed: K and N must be positive");
  const std::vector<int64_t> expected =
      avx2 ? std::vector<int64_t>{ceil_div(N, kPackColumns), blocks, kAvx2ByteBlockValues,
                                  kPackColumns}
           : std::vector<int64_t>{ceil_div(N, kPackColumns), blocks, kByteBlockBytes};
  TORCH_CHECK(packed.sizes() == c10::IntArrayRef(expected), "linear_8bit_packed: packed weight ",
              packed.sizes(), " is not ", c10::IntArrayRef(expected), " for N = ", N, ", K = ", K);
  const auto dtype = packed.scalar_type();
  TORCH_CHECK((dtype == at::kChar || (dtype == at::kByte && !avx2) ||
               dtype == at::kFloat8_e4m3fn) &&
                  packed.is_contiguous(),
              "linear_8bit_packed: packed weight must be contiguous int8, uint8 or float8_e4m3fn "
              "(pack_weight_8bit)");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat,
              "linear_8bit_packed: scale must be [", N, "] fp32, got ", scale.sizes(), " ",
              scale.scalar_type());
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_8bit_packed: bias must be [", N,
                "], got ", bias->sizes());
    b32 = bias->to(at::kFloat).contiguous();
  }
  for (const at::Tensor* t : {&x, &packed, &scale}) {
    TORCH_CHECK(t->device().is_cpu(), "linear_8bit_packed: CPU tensors only");
  }
  // The kernel reads x in blocks of 4 along K: zeros past K.
  const at::Tensor xc = K % 4 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 4 * blocks - K});
  const at::Tensor sc = scale.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  PackedLinear args{data_as<bf16_bits>(xc), nullptr,
                    b32.defined() ? b32.data_ptr<float>() : nullptr, M, N, 4 * blocks,
                    out_fp32 ? nullptr : mutable_data_as<bf16_bits>(out),
                    out_fp32 ? out.data_ptr<float>() : nullptr};
  args.scale = sc.data_ptr<float>();
  if (avx2) {
    TORCH_CHECK(dtype != at::kFloat8_e4m3fn || __builtin_cpu_supports("f16c"),
                "linear_8bit_packed: FP8 weights on the avx2 layout need a CPU with F16C");
    linear_8bit_packed_avx2(args, static_cast<const uint8_t*>(packed.data_ptr()),
                            dtype == at::kFloat8_e4m3fn, wide);
    return out;
  }
  const ByteCode code = dtype == at::kChar   ? ByteCode::kInt8
                       : dtype == at::kByte ? ByteCode::kInt8Minus128
                                            : ByteCode::kFp8E4M3;
  linear_8bit_packed_avx512(args, static_cast<const uint8_t*>(packed.data_ptr()), code);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def("pack_weight_8bit(Tensor weight, str kernel='avx512') -> Tensor", &pack_weight_8bit);
  m.def(
      "linear_8bit_packed(Tensor x, Tensor packed, Tensor scale, int out_features, Tensor? bias,"
      " bool out_fp32=False, str kernel='auto') -> Tensor",
      &linear_8bit_packed);
  m.def("has_avx512_8bit_linear() -> bool", [] { return cpu_has_avx512_8bit_linear(); });
}
