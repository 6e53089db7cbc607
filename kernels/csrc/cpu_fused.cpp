// Fused elementwise ops for bf16 on CPU: RMSNorm (optionally after the residual add), the rotary
// embedding applied in place to the q and k heads of a fused qkv row, and the MLP's act(gate) * up
// over a fused gate_up row (SiLU, or GeGLU's tanh-approximated GELU).
//
// At batch 1 a decode step runs ~25 norms and 12 rotary embeddings over 768 values each; as
// chains of torch ops they cost more in dispatch than in arithmetic. Each op here rounds to bf16
// exactly where the torch expression it replaces does, so outputs are bit-identical to it.
#include "fused_kernels.h"
#include "linear_kernels.h"  // cpu_has_avx512_bf16

#include <type_traits>

namespace {

using c10::BFloat16;
using tgq_cpu::bf16_bits;
using tgq_cpu::kVec;

inline float round_bf16(float v) { return static_cast<float>(BFloat16(v)); }

// Values per parallel task: a batch-16 decode step's norms (16 x 768) split over two threads, a
// batch-1 step's stay on one (waking a thread costs more than the row).
constexpr int64_t kValuesPerTask = 4096;

int64_t rows_per_task(int64_t values_per_row) {
  return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_row));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name,
              " must be a bf16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden], rows contiguous");
}

void check_weight(const at::Tensor& weight, int64_t hidden) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous() && weight.numel() == hidden,
              "weight must be a contiguous bf16 CPU tensor of ", hidden, " values");
}

// Offset = false (Llama): out = w * bf16(x * rsqrt(mean(x^2) + eps)), the product rounded to bf16
// as torch does. Offset = true (Gemma): out = bf16(x * rsqrt(...) * (1 + w)), all in fp32 and
// rounded once. The sum of squares runs in 8 lanes, as torch's vectorised reduction does (so
// differs from it, at most, in its last bits' order of addition).
template <bool Offset>
void norm_row(const BFloat16* x, const BFloat16* w, int64_t hidden, float eps, BFloat16* out) {
  using tgq_cpu::load8;
  const auto* xb = reinterpret_cast<const bf16_bits*>(x);
  const auto* wb = reinterpret_cast<const bf16_bits*>(w);
  auto* ob = reinterpret_cast<bf16_bits*>(out);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kVec <= hidden; i += kVec) {
    const __m256 v = load8(xb + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum_sq = tgq_cpu::hsum(acc);
  for (int64_t j = i; j < hidden; ++j) {
    const float v = static_cast<float>(x[j]);
    sum_sq += v * v;
  }
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
  const __m256 inv8 = _mm256_set1_ps(inv);
  if constexpr (Offset) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (i = 0; i + kVec <= hidden; i += kVec) {
      const __m256 normed = _mm256_mul_ps(load8(xb + i), inv8);
      tgq_cpu::store8_bf16(ob + i, _mm256_mul_ps(normed, _mm256_add_ps(one, load8(wb + i))));
    }
    for (; i < hidden; ++i) {
      out[i] = BFloat16(static_cast<float>(x[i]) * inv * (1.f + static_cast<float>(w[i])));
    }
    return;
  }
  for (i = 0; i + kVec <= hidden; i += kVec) {
    const __m256 normed = tgq_cpu::round8_bf16(_mm256_mul_ps(load8(xb + i), inv8));
    tgq_cpu::store8_bf16(ob + i, _mm256_mul_ps(load8(wb + i), normed));
  }
  for (; i < hidden; ++i) {
    const float normed = round_bf16(static_cast<float>(x[i]) * inv);
    out[i] = BFloat16(static_cast<float>(w[i]) * normed);
  }
}

template <bool Offset>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_weight(weight, hidden);
  at::Tensor out = at::empty_like(x, x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto* xp = x.const_data_ptr<BFloat16>();
  const auto* wp = weight.const_data_ptr<BFloat16>();
  auto* op = out.mutable_data_ptr<BFloat16>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row<Offset>(xp + r * stride, wp, hidden, static_cast<float>(eps), op + r * hidden);
    }
  });
  return out;
}

// x += delta (rounded to bf16, in place), then returns rms_norm(x).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(x.is_contiguous() && x.sizes() == delta.sizes(),
              "x must be contiguous and the same shape as delta");
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_weight(weight, hidden);
  at::Tensor out = at::empty_like(x);
  auto* xp = x.mutable_data_ptr<BFloat16>();
  const auto* dp = delta.const_data_ptr<BFloat16>();
  const auto* wp = weight.const_data_ptr<BFloat16>();
  auto* op = out.mutable_data_ptr<BFloat16>();
  const int64_t delta_stride = delta.stride(0);
  at::parallel_for(0, rows, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      BFloat16* row = xp + r * hidden;
      const BFloat16* d = dp + r * delta_stride;
      auto* rb = reinterpret_cast<bf16_bits*>(row);
      const auto* db = reinterpret_cast<const bf16_bits*>(d);
      int64_t i = 0;
      for (; i + kVec <= hidden; i += kVec) {
        tgq_cpu::store8_bf16(rb + i, _mm256_add_ps(tgq_cpu::load8(rb + i), tgq_cpu::load8(db + i)));
      }
      for (; i < hidden; ++i) {
        row[i] = BFloat16(static_cast<float>(row[i]) + static_cast<float>(d[i]));
      }
      norm_row<false>(row, wp, hidden, static_cast<float>(eps), op + r * hidden);
    }
  });
  return out;
}

// The rotation of rotary_qk_ below for the first half / 8 * 8 pairs of one head, 8 lanes at a
// time, with the same roundings (the scalar loop there finishes the rest).
inline void rotate_head_vec(bf16_bits* x, const bf16_bits* c, const bf16_bits* s, int64_t half) {
  using tgq_cpu::load8;
  using tgq_cpu::round8_bf16;
  for (int64_t i = 0; i + kVec <= half; i += kVec) {
    const __m256 x1 = load8(x + i), x2 = load8(x + i + half);
    // bf16(-x2 * s) == -bf16(x2 * s): rounding to nearest even is symmetric.
    const __m256 lo = _mm256_sub_ps(round8_bf16(_mm256_mul_ps(x1, load8(c + i))),
                                    round8_bf16(_mm256_mul_ps(x2, load8(s + i))));
    const __m256 hi = _mm256_add_ps(round8_bf16(_mm256_mul_ps(x2, load8(c + i + half))),
                                    round8_bf16(_mm256_mul_ps(x1, load8(s + i + half))));
    tgq_cpu::store8_bf16(x + i, lo);
    tgq_cpu::store8_bf16(x + i + half, hi);
  }
}

// In place on qkv[t, h * D : (h + 1) * D] for the first `num_heads` heads of each row (q heads
// then k heads): x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16.
void rotary_qk_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                int64_t head_dim) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = qkv.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1),
              "num_heads * head_dim must fit in a qkv row, head_dim even");
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "cos and sin must be [rows, head_dim]");
  auto* xp = qkv.mutable_data_ptr<BFloat16>();
  const auto* cp = cos.const_data_ptr<BFloat16>();
  const auto* sp = sin.const_data_ptr<BFloat16>();
  const int64_t stride = qkv.stride(0), cs_stride = cos.stride(0), sn_stride = sin.stride(0);
  at::parallel_for(0, rows, rows_per_task(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BFloat16* c = cp + r * cs_stride;
      const BFloat16* s = sp + r * sn_stride;
      for (int64_t h = 0; h < num_heads; ++h) {
        BFloat16* x = xp + r * stride + h * head_dim;
        rotate_head_vec(reinterpret_cast<bf16_bits*>(x), reinterpret_cast<const bf16_bits*>(c),
                        reinterpret_cast<const bf16_bits*>(s), half);
        for (int64_t i = half / kVec * kVec; i < half; ++i) {
          float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          float lo = round_bf16(x1 * static_cast<float>(c[i])) +
                     round_bf16(-x2 * static_cast<float>(s[i]));
          float hi = round_bf16(x2 * static_cast<float>(c[i + half])) +
                     round_bf16(x1 * static_cast<float>(s[i + half]));
          x[i] = BFloat16(lo);
          x[i + half] = BFloat16(hi);
        }
      }
    }
  });
}

// g * sigmoid(z), with e = e^-|z| <= 1 so the exponential never overflows: sigmoid(z) = 1 / (1 + e)
// for z >= 0, e / (1 + e) for z < 0.
inline __m256 times_sigmoid(__m256 g, __m256 z) {
  const __m256 e = tgq_cpu::exp_nonpositive(_mm256_or_ps(z, _mm256_set1_ps(-0.0f)));  // e^-|z|
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 numerator = _mm256_blendv_ps(one, e, z);  // sign of z picks e
  return _mm256_mul_ps(g, _mm256_div_ps(numerator, _mm256_add_ps(one, e)));
}

// The gate activations as g * sigmoid(z(g)): SiLU's z = g; the tanh-approximated GELU's
// 0.5 g (1 + tanh(y)) = g * sigmoid(2y), y = sqrt(2 / pi) (g + 0.044715 g^3), so z = 2y.
struct Silu {
  static __m256 z(__m256 g) { return g; }
  static float z(float g) { return g; }
};

struct GeluTanh {
  static constexpr float kLinear = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  static constexpr float kCubic = kLinear * 0.044715f;
  static __m256 z(__m256 g) {
    const __m256 g2 = _mm256_mul_ps(g, g);
    return _mm256_mul_ps(g, _mm256_fmadd_ps(g2, _mm256_set1_ps(kCubic), _mm256_set1_ps(kLinear)));
  }
  static float z(float g) { return g * (g * g * kCubic + kLinear); }
};

// out[t, :] = act(gate) * up for gate_up[t] = [gate | up], each of `inter` values; act rounded
// to bf16 before the product, as torch's act(gate) * up in bf16 does (act itself agrees with
// torch's to fp32 rounding, so outputs match it up to rare 1-ulp bf16 differences).
template <typename Act>
at::Tensor act_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const auto* gp = reinterpret_cast<const bf16_bits*>(gate_up.const_data_ptr<BFloat16>());
  auto* op = reinterpret_cast<bf16_bits*>(out.mutable_data_ptr<BFloat16>());
  const int64_t stride = gate_up.stride(0);
  const bool wide = tgq_cpu::cpu_has_avx512_bf16();
  constexpr bool kGelu = std::is_same_v<Act, GeluTanh>;
  at::parallel_for(0, rows, rows_per_task(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16_bits* g = gp + r * stride;
      const bf16_bits* u = g + inter;
      bf16_bits* o = op + r * inter;
      int64_t i = !wide ? 0
                  : kGelu ? tgq_cpu::gelu_tanh_mul_row_avx512(g, u, inter, o)
                          : tgq_cpu::silu_mul_row_avx512(g, u, inter, o);
      for (; i + kVec <= inter; i += kVec) {
        const __m256 gv = tgq_cpu::load8(g + i);
        const __m256 a = tgq_cpu::round8_bf16(times_sigmoid(gv, Act::z(gv)));
        tgq_cpu::store8_bf16(o + i, _mm256_mul_ps(a, tgq_cpu::load8(u + i)));
      }
      for (; i < inter; ++i) {
        const float gv = tgq_cpu::to_f32(g[i]);
        const float a = round_bf16(gv / (1.0f + std::exp(-Act::z(gv))));
        o[i] = BFloat16(a * tgq_cpu::to_f32(u[i])).x;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm<false>);
  m.def("offset_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm<true>);
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor",
        &add_rms_norm);
  m.def("rotary_qk_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()",
        &rotary_qk_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &act_mul<Silu>);
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &act_mul<GeluTanh>);
}
