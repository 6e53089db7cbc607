// linear_bf16: y[M,N] = x[M,K] @ w[N,K]^T + b with w in bf16 and fp32 accumulation.
//
// On CPUs with AVX512_BF16 the model packs its weights once (pack_weight_bf16) and calls
// linear_bf16_packed, the kernel in linear_avx512_bf16.cpp, for every M: at the decode steps' M it
// beats oneDNN 1.5-2x, at prefill's it is level. linear_bf16 itself takes [N, K] weights and
// picks per call ("auto"):
//  - AVX512_BF16 CPUs, bf16 x: at::linear, i.e. oneDNN's bf16 GEMM;
//  - every other case: the AVX2/FMA kernel below, which widens bf16 to fp32 in registers (torch's
//    bf16 matmul is very slow on CPUs without avx512_bf16/AMX);
//  - "avx512", named only: the packed kernel, packing the weights for that call.
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/linear.h>

#include <string_view>

#include "linear_kernels.h"

namespace {

using namespace tgq_cpu;

// ----------------------------------------------------------------------------------------------
// linear_bf16
//
// Both x and w are row-major along K, so each output is a dot product of two contiguous rows. The
// micro-kernel computes an MT x NT tile of outputs: per step of 8 along K it loads NT weight
// vectors once and reuses each across MT rows of x, keeping MT*NT 8-lane partial sums in
// registers. KU > 1 splits each sum into KU interleaved partial sums along K, for independent FMA
// chains when MT*NT alone is too few. The partial sums are reduced horizontally once at the end,
// where the K % 8 tail is added in scalar. Registers: MT*NT*KU + min(MT, NT) + 1 <= 16.
//
// Large M reaches ~80% of the FMA peak, level with torch's fp32 GEMM (MKL) on pre-widened weights
// (measured at M = 512..8192), so there is no separate path that widens w and calls at::mm.

template <int MT, int NT, typename WT>
inline void fma_step(const float* x, const WT* w, int64_t K, int64_t k, __m256 (&acc)[MT][NT]) {
  __m256 wv[NT];
#pragma GCC unroll 8
  for (int n = 0; n < NT; ++n) wv[n] = load8(w + n * K + k);
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const __m256 xv = load8(x + m * K + k);
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
  }
}

template <int MT, int NT, int KU, typename WT>
void dot_tile(const float* x, const WT* w, int64_t K, float* sums /* [MT, NT] */) {
  __m256 acc[KU][MT][NT];
  for (auto& part : acc)
    for (auto& row : part)
      for (auto& a : row) a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + KU * kVec <= K; k += KU * kVec) {
#pragma GCC unroll 4
    for (int u = 0; u < KU; ++u) fma_step<MT, NT>(x, w, K, k + u * kVec, acc[u]);
  }
  for (; k + kVec <= K; k += kVec) fma_step<MT, NT>(x, w, K, k, acc[0]);
  for (int m = 0; m < MT; ++m) {
    for (int n = 0; n < NT; ++n) {
      __m256 total = acc[0][m][n];
      for (int u = 1; u < KU; ++u) total = _mm256_add_ps(total, acc[u][m][n]);
      float s = hsum(total);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * to_f32(w[n * K + kk]);
      sums[m * NT + n] = s;
    }
  }
}

template <typename WT>
using TileFn = void (*)(const float*, const WT*, int64_t, float*);

constexpr int kMaxMT = 4;
constexpr int kTileSums = 12;  // largest MT * NT

// Tile shapes per weight type and number of x rows (1..4).
//  - bf16 weights, streamed from memory (small M): one weight row at a time, so the whole
//    thread's range of w is read as a single sequential stream (measured ~20% more bandwidth
//    than interleaving 4-8 rows), with KU partial sums to keep enough FMA chains in flight.
//  - fp32 panels, cache-resident (large M): the widest tile that fits the registers, 1x8, 2x6,
//    3x4, 4x3, reusing each loaded vector as often as possible; single rows for the N tail.
template <typename WT>
struct Tiles;

template <>
struct Tiles<bf16_bits> {
  static constexpr int nt(int) { return 1; }
  static TileFn<bf16_bits> full(int mt) {
    switch (mt) {
      case 1: return dot_tile<1, 1, 4, bf16_bits>;
      case 2: return dot_tile<2, 1, 4, bf16_bits>;
      case 3: return dot_tile<3, 1, 4, bf16_bits>;
      default: return dot_tile<4, 1, 3, bf16_bits>;
    }
  }
  static TileFn<bf16_bits> edge(int mt) { return full(mt); }
};

template <>
struct Tiles<float> {
  static constexpr int nt(int mt) { return mt == 1 ? 8 : mt == 2 ? 6 : mt == 3 ? 4 : 3; }
  static TileFn<float> full(int mt) {
    switch (mt) {
      case 1: return dot_tile<1, 8, 1, float>;
      case 2: return dot_tile<2, 6, 1, float>;
      case 3: return dot_tile<3, 4, 1, float>;
      default: return dot_tile<4, 3, 1, float>;
    }
  }
  static TileFn<float> edge(int mt) {
    switch (mt) {
      case 1: return dot_tile<1, 1, 1, float>;
      case 2: return dot_tile<2, 1, 1, float>;
      case 3: return dot_tile<3, 1, 1, float>;
      default: return dot_tile<4, 1, 1, float>;
    }
  }
};

}  // namespace

namespace tgq_cpu {

// A call of one row runs the bf16-weight tile for one row (gemm_rows: one row does not widen).
float linear_avx2_one_row(const float* x, const bf16_bits* w, int64_t K) {
  float sum;
  Tiles<bf16_bits>::full(1)(x, w, K, &sum);
  return sum;
}

}  // namespace tgq_cpu

namespace {

struct GemmArgs {
  const float* x;     // [M, K]
  const float* bias;  // [N] or nullptr
  int64_t M, N, K;
};

// out[m0:m0+mt, n:n+nt] = sums + bias
template <typename OutT>
void store_tile(const GemmArgs& a, const float* sums, int mt, int nt, int64_t m0, int64_t n,
                OutT* out) {
  for (int m = 0; m < mt; ++m) {
    for (int j = 0; j < nt; ++j) {
      float v = sums[m * nt + j] + (a.bias != nullptr ? a.bias[n + j] : 0.0f);
      store_out(out + (m0 + m) * a.N + n + j, v);
    }
  }
}

// out[:, n0:n1] for all M rows; w holds weight rows n0..n1, K apart.
template <typename WT, typename OutT>
void gemm_panel(const GemmArgs& a, const WT* w, int64_t n0, int64_t n1, OutT* out) {
  float sums[kTileSums];
  for (int64_t m0 = 0; m0 < a.M; m0 += kMaxMT) {
    const int mt = static_cast<int>(std::min<int64_t>(kMaxMT, a.M - m0));
    const int nt = Tiles<WT>::nt(mt);
    const TileFn<WT> full = Tiles<WT>::full(mt), edge = Tiles<WT>::edge(mt);
    for (int64_t n = n0; n < n1;) {
      const int step = n1 - n >= nt ? nt : 1;
      (step == nt ? full : edge)(a.x + m0 * a.K, w + (n - n0) * a.K, a.K, sums);
      store_tile(a, sums, mt, step, m0, n, out);
      n += step;
    }
  }
}

// Weight rows per panel: the panel stays in L2 while every row of x streams past it, so each
// weight byte comes from DRAM once. A multiple of every tile's NT so panels split into full tiles.
constexpr int64_t kPanelBytes = 96 * 1024;
constexpr int64_t kRowUnit = 24;

int64_t panel_rows(int64_t K, int64_t elem_bytes) {
  int64_t rows = kPanelBytes / (K * elem_bytes) / kRowUnit * kRowUnit;
  return std::max(rows, kRowUnit);
}

// From this many rows of x on, each weight panel is first widened to fp32 in a thread-local
// buffer and read by the wide fp32 tiles. Measured on an AMD EPYC (family 17h): ~8% faster at
// M = 24, even at 16, ~15% slower at 8. Below it the kernel converts bf16 as it streams w once.
constexpr int64_t kWidenPanelMinM = 16;

template <typename OutT>
void gemm_rows(const GemmArgs& a, const bf16_bits* w, int64_t n_begin, int64_t n_end,
               OutT* out) {
  const bool widen = a.M >= kWidenPanelMinM;
  const int64_t rows = panel_rows(a.K, widen ? sizeof(float) : sizeof(bf16_bits));
  std::vector<float> panel(widen ? rows * a.K : 0);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += rows) {
    const int64_t n1 = std::min(n_end, n0 + rows);
    const bf16_bits* wp = w + n0 * a.K;
    if (!widen) {
      gemm_panel<bf16_bits, OutT>(a, wp, n0, n1, out);
      continue;
    }
    const int64_t count = (n1 - n0) * a.K;
    int64_t i = 0;
    for (; i + kVec <= count; i += kVec) _mm256_storeu_ps(panel.data() + i, load8(wp + i));
    for (; i < count; ++i) panel[i] = to_f32(wp[i]);
    gemm_panel<float, OutT>(a, panel.data(), n0, n1, out);
  }
}

// Rows of x per pass over the weights. Each panel re-reads all the pass's rows of x, so a pass
// must stay cache-resident; long prefills go in several passes, widening each panel once per pass.
constexpr int64_t kRowsPerPass = 512;

template <typename OutT>
void gemm_rows_in_passes(const GemmArgs& a, const bf16_bits* w, int64_t n_begin, int64_t n_end,
                         OutT* out) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowsPerPass) {
    const GemmArgs pass{a.x + m0 * a.K, a.bias, std::min(kRowsPerPass, a.M - m0), a.N, a.K};
    gemm_rows<OutT>(pass, w, n_begin, n_end, out + m0 * a.N);
  }
}

// Work below this many multiply-adds stays on one thread.
constexpr int64_t kMinWorkPerTask = 1 << 16;

template <typename OutT>
void linear_dispatch(const GemmArgs& a, const bf16_bits* w, OutT* out) {
  // Parallel units are groups of kRowUnit weight rows so thread boundaries keep full tiles.
  const int64_t num_units = (a.N + kRowUnit - 1) / kRowUnit;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (a.M * a.K * kRowUnit));
  at::parallel_for(0, num_units, grain, [&](int64_t u0, int64_t u1) {
    gemm_rows_in_passes<OutT>(a, w, u0 * kRowUnit, std::min(a.N, u1 * kRowUnit), out);
  });
}

// Inputs already checked by linear_bf16.
at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  GemmArgs args{x32.data_ptr<float>(), b32.defined() ? b32.data_ptr<float>() : nullptr, M, N, K};
  const bf16_bits* w = data_as<bf16_bits>(weight);
  if (x.scalar_type() == at::kFloat) {
    linear_dispatch<float>(args, w, out.data_ptr<float>());
  } else {
    linear_dispatch<bf16_bits>(args, w, mutable_data_as<bf16_bits>(out));
  }
  return out;
}

// w [N, K] -> the packed layout of linear_kernels.h.
at::Tensor pack_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_weight_bf16: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "pack_weight_bf16: weight must be bf16, got ",
              weight.scalar_type());
  TORCH_CHECK(weight.device().is_cpu(), "pack_weight_bf16: CPU tensors only");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), pairs = ceil_div(K, 2);
  at::Tensor packed = at::empty({ceil_div(N, kPackColumns), pairs, kPackColumns, 2}, w.options());
  const bf16_bits* src = data_as<bf16_bits>(w);
  bf16_bits* dst = mutable_data_as<bf16_bits>(packed);
  at::parallel_for(0, packed.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      bf16_bits* tile = dst + t * pairs * kPackColumns * 2;
      for (int c = 0; c < kPackColumns; ++c) {
        const int64_t n = t * kPackColumns + c;
        for (int64_t k = 0; k < 2 * pairs; ++k) {
          tile[(k / 2 * kPackColumns + c) * 2 + k % 2] = n < N && k < K ? src[n * K + k] : 0;
        }
      }
    }
  });
  return packed;
}

// out_fp32: the bf16 result widened to fp32 (= linear(...).float()), stored in the same pass.
// kernel: "avx512" or "amx" (AMX tiles; K a multiple of 32), both over the same packed weights.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, bool out_fp32,
                         c10::string_view kernel) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "linear_bf16_packed: needs a CPU with AVX512_BF16");
  const bool amx = kernel == "amx";
  TORCH_CHECK(amx || kernel == "avx512", "linear_bf16_packed: unknown kernel '",
              std::string_view(kernel.data(), kernel.size()), "' (avx512, amx)");
  TORCH_CHECK(!amx || cpu_has_amx_bf16(),
              "linear_bf16_packed: kernel 'amx' needs a CPU with AMX-BF16 that Linux lets us use");
  TORCH_CHECK(x.dim() == 2, "linear_bf16_packed: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_bf16_packed: x must be bf16, got ",
              x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), pairs = ceil_div(K, 2);
  TORCH_CHECK(K > 0, "linear_bf16_packed: K must be positive");
  TORCH_CHECK(!amx || K % 32 == 0, "linear_bf16_packed: kernel 'amx' needs K % 32 == 0, got ", K);
  TORCH_CHECK(N > 0, "linear_bf16_packed: N must be positive");
  const std::vector<int64_t> expected{ceil_div(N, kPackColumns), pairs, kPackColumns, 2};
  TORCH_CHECK(packed.sizes() == c10::IntArrayRef(expected), "linear_bf16_packed: packed weight ",
              packed.sizes(), " is not ", c10::IntArrayRef(expected), " for N = ", N, ", K = ", K);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear_bf16_packed: packed weight must be contiguous bf16 (pack_weight_bf16)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(),
              "linear_bf16_packed: CPU tensors only");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_bf16_packed: bias must be [", N,
                "], got ", bias->sizes());
    TORCH_CHECK(bias->device().is_cpu(), "linear_bf16_packed: CPU tensors only");
    b32 = bias->to(at::kFloat).contiguous();
  }
  // The kernel reads x in pairs along K: an odd K gets a zero column.
  at::Tensor xc = K % 2 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 1});
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const PackedLinear args{
      data_as<bf16_bits>(xc), data_as<bf16_bits>(packed),
      b32.defined() ? b32.data_ptr<float>() : nullptr, M, N, 2 * pairs,
      out_fp32 ? nullptr : mutable_data_as<bf16_bits>(out), out_fp32 ? out.data_ptr<float>() : nullptr};
  if (amx) {
    linear_bf16_packed_amx(args);
  } else {
    linear_bf16_packed_avx512(args);
  }
  return out;
}

// The experts of a sparse MoE block in one call (moe_experts_bf16_avx512, linear_kernels.h):
// gate_up [E, ...] and down [E, ...] are each expert's pack_weight_bf16 layout, stacked.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t intermediate) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "moe_experts_bf16: needs a CPU with AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "moe_experts_bf16: x must be [T, K] bf16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t T = x.size(0), K = x.size(1), I = intermediate;
  TORCH_CHECK(K > 0 && K % 2 == 0, "moe_experts_bf16: K must be even, got ", K);
  TORCH_CHECK(I > 0 && I % 16 == 0, "moe_experts_bf16: the intermediate size must be a multiple "
              "of 16, got ", I);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == T && experts.scalar_type() == at::kLong,
              "moe_experts_bf16: experts must be [T, k] int64, got ", experts.sizes(), " ",
              experts.scalar_type());
  TORCH_CHECK(weights.sizes() == experts.sizes(), "moe_experts_bf16: weights ", weights.sizes(),
              " do not match experts ", experts.sizes());
  const int64_t E = gate_up.size(0);
  const std::vector<int64_t> gate_up_shape{E, ceil_div(2 * I, kPackColumns), K / 2, kPackColumns, 2};
  const std::vector<int64_t> down_shape{E, ceil_div(K, kPackColumns), I / 2, kPackColumns, 2};
  TORCH_CHECK(gate_up.sizes() == c10::IntArrayRef(gate_up_shape), "moe_experts_bf16: gate_up ",
              gate_up.sizes(), " is not ", c10::IntArrayRef(gate_up_shape));
  TORCH_CHECK(down.sizes() == c10::IntArrayRef(down_shape), "moe_experts_bf16: down ",
              down.sizes(), " is not ", c10::IntArrayRef(down_shape));
  for (const at::Tensor* t : {&gate_up, &down}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                "moe_experts_bf16: packed experts must be contiguous bf16");
  }
  for (const at::Tensor* t : {&x, &experts, &weights, &gate_up, &down}) {
    TORCH_CHECK(t->device().is_cpu(), "moe_experts_bf16: CPU tensors only");
  }
  const at::Tensor ids = experts.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < E, "moe_experts_bf16: expert id ", id[i], " not in [0, ",
                E, ")");
  }
  const at::Tensor xc = x.contiguous(), w32 = weights.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({T, K}, x.options());
  if (T == 0) return out;
  moe_experts_bf16_avx512({data_as<bf16_bits>(xc), id, w32.data_ptr<float>(),
                           data_as<bf16_bits>(gate_up), data_as<bf16_bits>(down), T,
                           experts.size(1), E, K, I, mutable_data_as<bf16_bits>(out)});
  return out;
}

at::Tensor linear_native(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_bf16: path 'native' needs bf16 x");
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(at::kBFloat16);
  return at::linear(x, weight, b);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, std::string_view path,
                       bool out_fp32) {
  TORCH_CHECK(x.dim() == 2, "linear_bf16: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 2, "linear_bf16: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_bf16: K mismatch, x ", x.sizes(),
              " vs weight ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_bf16: x must be bf16 or fp32, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_bf16: weight must be bf16, got ",
              weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "linear_bf16: weight must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_bf16: CPU tensors only");
  TORCH_CHECK(x.size(1) > 0, "linear_bf16: K must be positive");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0),
                "linear_bf16: bias must be [", weight.size(0), "], got ", bias->sizes());
    TORCH_CHECK(bias->device().is_cpu(), "linear_bf16: CPU tensors only");
  }
  if (path == "auto") {
    path = cpu_has_avx512_bf16() && x.scalar_type() == at::kBFloat16 ? "native" : "avx2";
  }
  // "avx512" packs the weights for this one call: for tests and one-off calls (the model packs
  // its weights once, at load, and calls linear_bf16_packed).
  if (path == "avx512") {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_bf16: path 'avx512' needs bf16 x");
    TORCH_CHECK(cpu_has_avx512_bf16(), "linear_bf16: path 'avx512' needs a CPU with AVX512_BF16");
    return linear_packed(x, pack_weight_bf16(weight), weight.size(0), bias, out_fp32, "avx512");
  }
  // out_fp32: the result as x's dtype would round it, widened to fp32 (= linear(...).float()).
  at::Tensor out;
  if (path == "avx2") out = linear_avx2(x, weight, bias);
  if (path == "native") out = linear_native(x, weight, bias);
  if (out.defined()) return out_fp32 ? out.to(at::kFloat) : out;
  TORCH_CHECK(false, "linear_bf16: unknown path '", path, "' (auto, avx2, avx512, native)");
}

at::Tensor linear_bf16_op(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, c10::string_view path,
                          bool out_fp32) {
  return linear_bf16(x, weight, bias, std::string_view(path.data(), path.size()), out_fp32);
}

}  // namespace

TORCH_LIBRARY(tgq_cpu_ops, m) {
  m.def(
      "linear_bf16(Tensor x, Tensor weight, Tensor? bias, str path='auto', bool out_fp32=False)"
      " -> Tensor",
      &linear_bf16_op);
  m.def("pack_weight_bf16(Tensor weight) -> Tensor", &pack_weight_bf16);
  m.def(
      "linear_bf16_packed(Tensor x, Tensor packed, int out_features, Tensor? bias,"
      " bool out_fp32=False, str kernel='avx512') -> Tensor",
      &linear_packed);
  m.def(
      "moe_experts_bf16(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down,"
      " int intermediate) -> Tensor",
      &moe_experts);
  m.def("has_amx_bf16() -> bool", [] { return cpu_has_amx_bf16(); });
}
