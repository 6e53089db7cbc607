// The grouped 4-bit-weight linear's ops (GPTQ, AWQ and compressed-tensors int4 checkpoints):
// pack_weight_int4 and linear_int4_packed over weights packed once at load, whose kernel is
// linear_int4_avx512.cpp's on CPUs with AVX512_BF16, linear_int4_avx512f.cpp's on other
// AVX512F/BW/VL CPUs and linear_int4_avx2.cpp's elsewhere (one packed layout, so packing does not
// depend on the CPU). The zeros and scales stay the checkpoint's [N, G] fp32 tensors: the kernels
// read them as they are, one tile's 16 rows at a time.
#include <ATen/ops/constant_pad_nd.h>
#include <algorithm>
#include <string_view>

#include "linear_kernels.h"

namespace {

using namespace tgq_cpu;

// Groups of input columns that a 64-byte block never straddles: a multiple of 8, or all of K.
void check_group_size(const char* op, int64_t group_size, int64_t K) {
  TORCH_CHECK(group_size > 0 && (group_size % kInt4BlockValues == 0 || group_size == K), op,
              ": group_size must be a positive multiple of 8 or K (", K, "), got ", group_size);
}

// q[n, k] of the [N, K] source, 0 past N and K (the layout's padding).
uint8_t nibble(const uint8_t* src, int64_t N, int64_t K, int64_t n, int64_t k) {
  return n < N && k < K ? src[n * K + k] : 0;
}

at::Tensor pack_weight_int4(const at::Tensor& q, int64_t group_size) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte,
              "pack_weight_int4: q must be [N, K] uint8, got ", q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(q.device().is_cpu(), "pack_weight_int4: CPU tensors only");
  const at::Tensor w = q.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = ceil_div(K, kInt4BlockValues);
  TORCH_CHECK(K > 0 && N > 0, "pack_weight_int4: K and N must be positive");
  check_group_size("pack_weight_int4", group_size, K);
  const auto* src = w.data_ptr<uint8_t>();
  TORCH_CHECK(std::all_of(src, src + w.numel(), [](uint8_t v) { return v <= 15; }),
              "pack_weight_int4: q values must be in 0..15 (4 bits), got ", w.max().item<int>());
  at::Tensor packed = at::empty({ceil_div(N, kPackColumns), blocks, kInt4BlockBytes}, w.options());
  auto* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < blocks; ++j) {
        uint8_t* block = dst + (t * blocks + j) * kInt4BlockBytes;
        for (int i = 0; i < 2 * kPackColumns; ++i) {  // word i: column i / 2, k % 2 = i % 2
          const int64_t n = t * kPackColumns + i / 2, k = j * kInt4BlockValues + i % 2;
          // Little-endian words: lines 0 and 1 in the low byte, 2 and 3 in the high one.
          for (int h = 0; h < 2; ++h) {
            block[2 * i + h] = static_cast<uint8_t>(nibble(src, N, K, n, k + 4 * h) |
                                                    nibble(src, N, K, n, k + 4 * h + 2) << 4);
          }
        }
      }
    }
  });
  return packed;
}

// The zeros or scales: [N, G] fp32 on the CPU.
void check_group_params(const char* name, const at::Tensor& t, int64_t N, int64_t G) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == G && t.scalar_type() == at::kFloat,
              "linear_int4_packed: ", name, " must be [", N, ", ", G, "] fp32, got ", t.sizes(),
              " ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "linear_int4_packed: CPU tensors only");
}

enum class Int4Kernel { kAvx512, kAvx512f, kAvx2 };

// kernel: "auto" (avx512 where the CPU has AVX512_BF16, else avx512f where it has AVX512F/BW/VL,
// else avx2), "avx512", "avx512f" or "avx2".
Int4Kernel pick_kernel(c10::string_view name) {
  const std::string_view kernel(name.data(), name.size());
  TORCH_CHECK(kernel == "auto" || kernel == "avx512" || kernel == "avx512f" || kernel == "avx2",
              "linear_int4_packed: unknown kernel '", kernel, "' (auto, avx2, avx512, avx512f)");
  TORCH_CHECK(kernel != "avx512" || cpu_has_avx512_bf16(),
              "linear_int4_packed: kernel 'avx512' needs a CPU with AVX512_BF16");
  TORCH_CHECK(kernel != "avx512f" || cpu_has_avx512f_kernels(),
              "linear_int4_packed: kernel 'avx512f' needs a CPU with AVX512F, BW and VL");
  if (kernel == "avx512" || (kernel == "auto" && cpu_has_avx512_bf16())) return Int4Kernel::kAvx512;
  if (kernel == "avx512f" || (kernel == "auto" && cpu_has_avx512f_kernels())) {
    return Int4Kernel::kAvx512f;
  }
  return Int4Kernel::kAvx2;
}

at::Tensor linear_int4_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale, const at::Tensor& zero, int64_t group_size,
                              int64_t N, const std::optional<at::Tensor>& bias, bool out_fp32,
                              c10::string_view kernel) {
  const Int4Kernel chosen = pick_kernel(kernel);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "linear_int4_packed: x must be [M, K] bf16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), blocks = ceil_div(K, kInt4BlockValues);
  TORCH_CHECK(K > 0 && N > 0, "linear_int4_packed: K and N must be positive");
  check_group_size("linear_int4_packed", group_size, K);
  const int64_t G = ceil_div(K, group_size);
  const std::vector<int64_t> expected{ceil_div(N, kPackColumns), blocks, kInt4BlockBytes};
  TORCH_CHECK(packed.sizes() == c10::IntArrayRef(expected), "linear_int4_packed: packed weight ",
              packed.sizes(), " is not ", c10::IntArrayRef(expected), " for N = ", N, ", K = ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "linear_int4_packed: packed weight must be contiguous uint8 (pack_weight_int4)");
  check_group_params("scale", scale, N, G);
  check_group_params("zero", zero, N, G);
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_int4_packed: bias must be [", N,
                "], got ", bias->sizes());
    b32 = bias->to(at::kFloat).contiguous();
  }
  for (const at::Tensor* t : {&x, &packed}) {
    TORCH_CHECK(t->device().is_cpu(), "linear_int4_packed: CPU tensors only");
  }
  // The kernel reads x in blocks of 8 along K: zeros past K.
  const int64_t x_stride = blocks * kInt4BlockValues;
  const at::Tensor xc = K == x_stride ? x.contiguous() : at::constant_pad_nd(x, {0, x_stride - K});
  const at::Tensor sc = scale.contiguous(), zc = zero.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const Int4Linear args{data_as<bf16_bits>(xc),
                        packed.data_ptr<uint8_t>(),
                        sc.data_ptr<float>(),
                        zc.data_ptr<float>(),
                        b32.defined() ? b32.data_ptr<float>() : nullptr,
                        M,
                        N,
                        x_stride,
                        group_size,
                        G,
                        out_fp32 ? nullptr : mutable_data_as<bf16_bits>(out),
                        out_fp32 ? out.data_ptr<float>() : nullptr};
  if (chosen == Int4Kernel::kAvx512) {
    linear_int4_packed_avx512(args);
  } else {
    linear_int4_packed_avx2(args, chosen == Int4Kernel::kAvx512f);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def("pack_weight_int4(Tensor q, int group_size) -> Tensor", &pack_weight_int4);
  m.def(
      "linear_int4_packed(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group_size,"
      " int out_features, Tensor? bias, bool out_fp32=False, str kernel='auto') -> Tensor",
      &linear_int4_packed);
}
