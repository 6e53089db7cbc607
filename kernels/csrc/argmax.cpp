// argmax_rows: the index of each row's largest value, as torch.argmax(x, -1) picks it (the first
// of equal maxima; a NaN counts as the largest, so the first NaN wins). torch's CPU argmax is
// scalar: over a [16, 32000] fp32 logits block it took ~220 us of a ~20 ms decode step.
#include "avx2_common.h"

namespace {

using tgq_cpu::kVec;

// Row maximum, 4 x 8 lanes, plus whether any value was NaN.
float row_max(const float* x, int64_t n, bool* has_nan) {
  constexpr int kChains = 4;
  __m256 best[kChains], nan[kChains];
  for (int c = 0; c < kChains; ++c) {
    best[c] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    nan[c] = _mm256_setzero_ps();
  }
  int64_t i = 0;
  for (; i + kChains * kVec <= n; i += kChains * kVec) {
    for (int c = 0; c < kChains; ++c) {
      const __m256 v = _mm256_loadu_ps(x + i + c * kVec);
      best[c] = _mm256_max_ps(best[c], v);
      nan[c] = _mm256_or_ps(nan[c], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  for (int c = 1; c < kChains; ++c) {
    best[0] = _mm256_max_ps(best[0], best[c]);
    nan[0] = _mm256_or_ps(nan[0], nan[c]);
  }
  alignas(32) float lanes[kVec];
  _mm256_store_ps(lanes, best[0]);
  float m = *std::max_element(lanes, lanes + kVec);
  bool any_nan = _mm256_movemask_ps(nan[0]) != 0;
  for (; i < n; ++i) {
    any_nan = any_nan || std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  *has_nan = any_nan;
  return m;
}

// The first index where x equals m (NaN: the first NaN).
int64_t first_match(const float* x, int64_t n, float m, bool nan) {
  const __m256 target = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                            : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; i < n; ++i) {
    if (nan ? std::isnan(x[i]) : x[i] == m) return i;
  }
  return 0;  // unreachable: m is one of the values
}

int64_t row_argmax(const float* x, int64_t n) {
  bool has_nan = false;
  const float m = row_max(x, n, &has_nan);
  return first_match(x, n, m, has_nan);
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "argmax_rows: x must be a 2-d fp32 CPU tensor, got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = xc.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  constexpr int64_t kValuesPerTask = 1 << 14;
  const int64_t grain = std::max<int64_t>(1, kValuesPerTask / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) { m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows); }
