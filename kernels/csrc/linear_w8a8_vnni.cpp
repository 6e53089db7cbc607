// linear_w8a8_vnni: an INT8 W8A8 linear (compressed-tensors int8 weights and int8 inputs) as an
// integer matmul on AVX512_VNNI: each input row quantized to int8 codes (input_quant.cpp, the
// codes the format's own forward rounds), the sums of code x weight exact in int32, then
//   out = bf16 or fp32 of (float(sum) * w_scale[n]) * x_scale[m] (+ bias[n])
// which is what vLLM's int8 scaled matmul computes; the dequantize-then-bf16 path multiplies each
// code back by its scale in the model's dtype first, a rounding this path does not have.
//
// vpdpbusd multiplies unsigned bytes by signed ones, four to a 32-bit lane: the inputs go in as
// code + 128 and each column's 128 * sum(w) is taken off the sum afterwards. A lane can hold a
// row of up to 65,536 products of 255 x 128.
//
// Weights packed once (pack_weight_vnni): tiles of 16 columns, [ceil(N / 16)][ceil(K / 4)][16][4]
// int8, each lane's four consecutive K values side by side, zeros past N and K. One instruction
// does 64 multiply-adds where vdpbf16ps does 32: the gain is at batch sizes where the bf16 kernels
// are bound by arithmetic, not by the weights' bytes.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include "greedy_head.h"  // cpu_has_avx512_vnni_bf16
#include "input_quant.h"
#include "linear_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")
#include <immintrin.h>

namespace tgq_cpu {
namespace {

constexpr int64_t kLanes = 16;  // columns a tile: one int32 lane each
constexpr int64_t kQuad = 4;    // K values a lane takes per vpdpbusd
constexpr int64_t kTileBytes = kLanes * kQuad;
constexpr int kMaxRows = 8;  // rows a pass; 2 tiles x 8 rows of sums in registers
constexpr int64_t kMaxK = 65536;

struct VnniLinear {
  const uint8_t* x;  // [M, ld] codes + 128
  int64_t ld;        // 4 * quads
  const float* x_scale;
  const int8_t* w;  // packed
  const int32_t* offset;  // [N]: 128 * sum over k of w[n, k]
  const float* w_scale;   // [N]
  const float* bias;      // [N] fp32 or nullptr
  int64_t M, N, quads;
  void* out;  // [M, N] bf16 or fp32
  bool out_fp32;
};

template <int R, int T>
void rows_of_tiles(const VnniLinear& a, int64_t tile0, int64_t row0) {
  __m512i acc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
  }
  const int8_t* w = a.w + tile0 * a.quads * kTileBytes;
  const uint8_t* x = a.x + row0 * a.ld;
  for (int64_t q = 0; q < a.quads; ++q) {
    __m512i wv[T];
    for (int t = 0; t < T; ++t) wv[t] = _mm512_loadu_si512(w + (t * a.quads + q) * kTileBytes);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * a.ld + q * kQuad, sizeof(four));
      const __m512i xv = _mm512_set1_epi32(four);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], xv, wv[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t n0 = (tile0 + t) * kLanes, columns = std::min<int64_t>(kLanes, a.N - n0);
    const auto mask = static_cast<__mmask16>((1u << columns) - 1);
    const __m512i offset = _mm512_maskz_loadu_epi32(mask, a.offset + n0);
    const __m512 w_scale = _mm512_maskz_loadu_ps(mask, a.w_scale + n0);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t m = row0 + r;
      __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][t], offset));
      v = _mm512_mul_ps(_mm512_mul_ps(v, w_scale), _mm512_set1_ps(a.x_scale[m]));
      if (a.bias) v = _mm512_add_ps(v, bias);
      if (a.out_fp32) {
        _mm512_mask_storeu_ps(static_cast<float*>(a.out) + m * a.N + n0, mask, v);
      } else {
        const __m256i bf = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + m * a.N + n0, mask, bf);
      }
    }
  }
}

template <int T>
void rows_dispatch(const VnniLinear& a, int64_t tile0, int64_t row0, int rows) {
  switch (rows) {
    case 1: return rows_of_tiles<1, T>(a, tile0, row0);
    case 2: return rows_of_tiles<2, T>(a, tile0, row0);
    case 3: return rows_of_tiles<3, T>(a, tile0, row0);
    case 4: return rows_of_tiles<4, T>(a, tile0, row0);
    case 5: return rows_of_tiles<5, T>(a, tile0, row0);
    case 6: return rows_of_tiles<6, T>(a, tile0, row0);
    case 7: return rows_of_tiles<7, T>(a, tile0, row0);
    default: return rows_of_tiles<8, T>(a, tile0, row0);
  }
}

void linear_vnni(const VnniLinear& a) {
  const int64_t tiles = ceil_div(a.N, kLanes), pairs = ceil_div(tiles, 2);
  // Each pair of tiles against every group of 8 rows: its weights (K * 32 bytes) stay in L1/L2
  // between the groups.
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t tile0 = 2 * p;
      for (int64_t row0 = 0; row0 < a.M; row0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, a.M - row0));
        if (tile0 + 1 < tiles) {
          rows_dispatch<2>(a, tile0, row0, rows);
        } else {
          rows_dispatch<1>(a, tile0, row0, rows);
        }
      }
    }
  });
}

// The codes of input_quant.cpp's int8_input_codes (the same values, tested), 16 at a time: x
// widened to fp32, divided by the scale, rounded to x's dtype where the scale is dynamic (bf16:
// to nearest even in integer arithmetic, as c10::BFloat16 rounds), clamped, rounded to the
// nearest integer (ties to even), plus 128.
template <bool kBf16>
__m512 load16(const void* x, int64_t i, __mmask16 mask) {
  if constexpr (kBf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(x) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(x) + i);
  }
}

inline __m512 round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <bool kBf16>
float row_amax(const void* x, int64_t n) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const auto mask = static_cast<__mmask16>(n - i >= kLanes ? 0xFFFF : (1u << (n - i)) - 1);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(load16<kBf16>(x, i, mask)));
  }
  return _mm512_reduce_max_ps(largest);
}

template <bool kBf16>
void row_codes(const void* x, int64_t n, float scale, bool round_divided, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale), low = _mm512_set1_ps(-128.0f),
               high = _mm512_set1_ps(127.0f);
  const __m512i bias = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < n; i += kLanes) {
    const auto mask = static_cast<__mmask16>(n - i >= kLanes ? 0xFFFF : (1u << (n - i)) - 1);
    __m512 v = _mm512_div_ps(load16<kBf16>(x, i, mask), s);
    if (kBf16 && round_divided) v = round_to_bf16(v);
    v = _mm512_min_ps(_mm512_max_ps(v, low), high);
    const __m512i q = _mm512_cvtps_epi32(
        _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_mask_storeu_epi8(out + i, mask, _mm512_cvtepi32_epi8(_mm512_add_epi32(q, bias)));
  }
}

// x [M, K] contiguous -> codes + 128 at out + r * ld and scales[r] (int8_input_codes' values).
template <bool kBf16>
void input_codes(const at::Tensor& x, bool per_token, std::optional<float> static_scale,
                 uint8_t* out, int64_t ld, float* scales) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto* data = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = K * (kBf16 ? 2 : 4);
  // The dtype's epsilon for an all-zero input; 127.5 = (127 - -128) / 2, exact in bf16 too.
  const float eps = kBf16 ? 0.0078125f : std::numeric_limits<float>::epsilon();
  auto scale_of = [&](float largest) {
    float scale = largest / 127.5f;
    if (kBf16) scale = _mm512_cvtss_f32(round_to_bf16(_mm512_set1_ps(scale)));
    return scale == 0 ? eps : scale;
  };
  float whole = static_scale ? *static_scale : 0.0f;
  if (!static_scale && !per_token) {
    float largest = 0;
    for (int64_t m = 0; m < M; ++m) largest = std::max(largest, row_amax<kBf16>(data + m * row_bytes, K));
    whole = scale_of(largest);
  }
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const void* row = data + m * row_bytes;
      const float scale = !static_scale && per_token ? scale_of(row_amax<kBf16>(row, K)) : whole;
      scales[m] = scale;
      row_codes<kBf16>(row, K, scale, !static_scale, out + m * ld);
    }
  });
}

at::Tensor pack_weight_vnni(const at::Tensor& w) {
  TORCH_CHECK(cpu_has_avx512_vnni_bf16(),
              "pack_weight_vnni: needs a CPU with AVX512_VNNI and AVX512_BF16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.device().is_cpu(),
              "pack_weight_vnni: w must be [N, K] int8 on CPU");
  const int64_t N = w.size(0), K = w.size(1), quads = ceil_div(K, kQuad);
  TORCH_CHECK(K >= 1 && K <= kMaxK, "pack_weight_vnni: K must be 1 to ", kMaxK, ", got ", K);
  const at::Tensor wc = w.contiguous();
  const int64_t tiles = ceil_div(N, kLanes);
  at::Tensor packed = at::zeros({tiles, quads, kLanes, kQuad}, w.options());
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t lane = 0; lane < kLanes && t * kLanes + lane < N; ++lane) {
        const int8_t* row = src + (t * kLanes + lane) * K;
        for (int64_t k = 0; k < K; ++k) {
          dst[((t * quads + k / kQuad) * kLanes + lane) * kQuad + k % kQuad] = row[k];
        }
      }
    }
  });
  return packed;
}

at::Tensor linear_w8a8_vnni(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& w_offset, const at::Tensor& w_scale,
                            int64_t out_features, const std::optional<at::Tensor>& bias,
                            bool per_token, const std::optional<at::Tensor>& static_scale) {
  TORCH_CHECK(cpu_has_avx512_vnni_bf16(),
              "linear_w8a8_vnni: needs a CPU with AVX512_VNNI and AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "linear_w8a8_vnni: x must be [M, K] bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, quads = ceil_div(K, kQuad);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar &&
                  packed.size(0) == ceil_div(N, kLanes) && packed.size(1) == quads &&
                  packed.size(2) == kLanes && packed.size(3) == kQuad,
              "linear_w8a8_vnni: packed must be pack_weight_vnni of an [", N, ", ", K,
              "] weight");
  TORCH_CHECK(w_offset.scalar_type() == at::kInt && w_offset.numel() == N &&
                  w_scale.scalar_type() == at::kFloat && w_scale.numel() == N,
              "linear_w8a8_vnni: w_offset must be [N] int32 and w_scale [N] fp32");
  TORCH_CHECK(!bias || (bias->numel() == N), "linear_w8a8_vnni: bias must be [N]");
  std::optional<float> fixed;
  if (static_scale) {
    TORCH_CHECK(static_scale->numel() == 1 && static_scale->scalar_type() == at::kFloat,
                "linear_w8a8_vnni: the static scale must be one fp32 value");
    fixed = static_scale->item<float>();
  }
  const bool out_fp32 = x.scalar_type() == at::kFloat;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xc = x.contiguous();
  const int64_t ld = quads * kQuad;
  at::Tensor codes = at::empty({M, ld}, x.options().dtype(at::kByte));
  at::Tensor x_scale = at::empty({M}, x.options().dtype(at::kFloat));
  uint8_t* code_data = codes.data_ptr<uint8_t>();
  if (out_fp32) {
    input_codes<false>(xc, per_token, fixed, code_data, ld, x_scale.data_ptr<float>());
  } else {
    input_codes<true>(xc, per_token, fixed, code_data, ld, x_scale.data_ptr<float>());
  }
  for (int64_t m = 0; m < M; ++m) std::memset(code_data + m * ld + K, 128, ld - K);
  const at::Tensor offset = w_offset.contiguous(), scale = w_scale.contiguous();
  at::Tensor bias_f32;
  if (bias) bias_f32 = bias->to(at::kFloat).contiguous();
  const VnniLinear args{code_data,
                        ld,
                        x_scale.data_ptr<float>(),
                        packed.data_ptr<int8_t>(),
                        offset.data_ptr<int32_t>(),
                        scale.data_ptr<float>(),
                        bias ? bias_f32.data_ptr<float>() : nullptr,
                        M,
                        N,
                        quads,
                        out.data_ptr(),
                        out_fp32};
  linear_vnni(args);
  return out;
}

// The codes and scales alone (tests: they are what quantize_inputs rounds).
std::tuple<at::Tensor, at::Tensor> int8_codes(const at::Tensor& x, bool per_token,
                                              const std::optional<at::Tensor>& static_scale) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int8_codes: x must be [M, K] bf16 or fp32");
  std::optional<float> fixed;
  if (static_scale) fixed = static_scale->item<float>();
  const at::Tensor xc = x.contiguous();
  at::Tensor codes = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.numel()) {
    int8_input_codes(xc, per_token, fixed, codes.data_ptr<uint8_t>(), x.size(1),
                     scales.data_ptr<float>());
  }
  return {codes.to(at::kShort).sub_(128).to(at::kChar), scales};
}

}  // namespace
}  // namespace tgq_cpu

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def("pack_weight_vnni(Tensor w) -> Tensor", &tgq_cpu::pack_weight_vnni);
  m.def(
      "linear_w8a8_vnni(Tensor x, Tensor packed, Tensor w_offset, Tensor w_scale, int "
      "out_features, Tensor? bias, bool per_token, Tensor? static_scale) -> Tensor",
      &tgq_cpu::linear_w8a8_vnni);
  m.def("int8_codes(Tensor x, bool per_token, Tensor? static_scale) -> (Tensor, Tensor)",
        &tgq_cpu::int8_codes);
}
