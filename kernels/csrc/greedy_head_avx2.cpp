// The screened greedy lm_head on AVX2/FMA CPUs (kernel "avx2"; greedy_head_avx512.cpp has the
// argument, which carries over with two changes). On these CPUs the lm_head runs linear_bf16's
// AVX2 kernel, whose fp32 sum for a row depends on how many rows share its call (the number of
// partial sums per dot product does). The exact value a row is held to is that of a call of its
// own, linear_bf16(x[m : m + 1], w, path="avx2", out_fp32=True) (linear_avx2_one_row), so a greedy
// row's token does not depend on the batch it runs in.
//
//  - The integer dot product is vpmaddubsw + vpmaddwd (no VNNI): vpmaddubsw adds two products of
//    an unsigned and a signed byte into a saturating int16, so x's integers are held to
//    |xq| <= 63 (stored as xq + 64 <= 127; 2 * 127 * 127 < 2^15, nothing saturates). The sums
//    stay exact; |ex| doubles against the 8-bit rows', which the bound B already carries.
//  - F[n] is the AVX2 kernel's fp32 sum of fp32 x times bf16 w: each product exact inside its
//    FMA, at most K roundings on any product's path to the total (the chains, their sum, the
//    horizontal sum), so the same gamma_K |x| |w[n]| covers it.
// The logit is that sum plus a zero bias, rounded to bf16 and widened, as linear_bf16 returns
// it; the candidates' logits are those very values, and the first largest wins.
#include "greedy_head.h"

#include "linear_kernels.h"  // linear_avx2_one_row, kPackColumns

namespace tgq_cpu {
namespace {

constexpr int kLanes = 8;                   // fp32 / int32 lanes in a __m256
constexpr int kTileColumns = kPackColumns;  // a screen tile: 16 columns, two registers
static_assert(kTileColumns == 2 * kLanes);
constexpr int kMaxRowsPerTile = 4;  // two accumulators a row; the tile stays in L1
constexpr int kXLimit = 63;
constexpr float kMargin = 1.0f / 1024;
constexpr float kTiny = 0x1p-70f;
constexpr int64_t kPrefetchBytes = 4096;

// Lanes [0, count) of 8 set (all bits), the rest clear.
inline __m256i first_lanes(int64_t count) {
  const int32_t n = static_cast<int32_t>(std::clamp<int64_t>(count, 0, kLanes));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Bit j set: column n + j is one row m may take (all of [n, n + 8) below N without masks).
uint32_t allowed_bits(const GreedyHeadArgs& a, int64_t m, int64_t n) {
  const int64_t count = std::min<int64_t>(kLanes, a.N - n);
  if (count <= 0) return 0;
  const uint32_t lanes = (1u << count) - 1;
  if (a.masks == nullptr) return lanes;
  const int64_t word = n / 32;
  if (word >= a.mask_words) return 0;
  return lanes & (a.masks[m * a.mask_words + word] >> (n & 31));
}

struct Bounds {
  __m256 norm_x, norm_ex;
  explicit Bounds(const RowQuant& r)
      : norm_x(_mm256_set1_ps(r.norm_x)), norm_ex(_mm256_set1_ps(r.norm_ex)) {}

  // B for columns [n, n + 8) (lanes past N: zero bounds, never used), given their screen values.
  __m256 at(const GreedyHeadArgs& a, int64_t n, __m256i lanes, __m256 screen) const {
    const __m256 bx = _mm256_maskload_ps(a.bound_x + n, lanes);
    const __m256 bex = _mm256_maskload_ps(a.bound_ex + n, lanes);
    const __m256 b = _mm256_fmadd_ps(norm_x, bx, _mm256_mul_ps(norm_ex, bex));
    const __m256 abs_screen = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), screen);
    const __m256 margin = _mm256_mul_ps(abs_screen, _mm256_set1_ps(kMargin));
    return _mm256_add_ps(_mm256_fmadd_ps(b, _mm256_set1_ps(1.0f + kMargin), margin),
                         _mm256_set1_ps(kTiny));
  }
};

// Row m's screen values over columns [n, n + 8) from its sums acc (xu8 . q[n], the bytes as
// unsigned): stores them; returns the largest lower bound S - B over the columns it may take
// (-inf if none). Under a mask the screen's argument runs over the allowed columns alone.
inline float finish_half(const GreedyHeadArgs& a, const RowQuant& r, int64_t n, int64_t m,
                         __m256i acc, float* screen) {
  const int64_t count = std::min<int64_t>(kLanes, a.N - n);
  if (count <= 0) return -std::numeric_limits<float>::infinity();
  const __m256i lanes = first_lanes(count);
  const __m256i q_sum = _mm256_maskload_epi32(a.q_sum + n, lanes);
  const __m256i dot = _mm256_sub_epi32(acc, _mm256_slli_epi32(q_sum, 6));  // 64 q_sum
  const __m256 scale = _mm256_maskload_ps(a.scale + n, lanes);
  const __m256 factor = _mm256_mul_ps(_mm256_set1_ps(r.sx), scale);
  const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), factor);
  _mm256_maskstore_ps(screen + m * a.N + n, lanes, s);
  alignas(32) float lower[kLanes];
  _mm256_store_ps(lower, _mm256_sub_ps(s, Bounds(r).at(a, n, lanes, s)));
  float best = -std::numeric_limits<float>::infinity();
  for (uint32_t bits = allowed_bits(a, m, n); bits != 0; bits &= bits - 1) {
    best = std::max(best, lower[__builtin_ctz(bits)]);
  }
  return best;
}

// Screen values of rows [m0, m0 + MT) against tile t; each row's largest lower bound over the
// tile goes to tile_max.
template <int MT>
void screen_tile(const GreedyHeadArgs& a, const int32_t* xu8, const RowQuant* rows, int64_t t,
                 int64_t m0, float* screen, float* tile_max) {
  const int64_t quads = a.K / kScreenQuad, tiles = ceil_div(a.N, kTileColumns);
  const int8_t* tile = a.q + t * quads * 64;
  const int32_t* xr[MT];  // each row's quads of bytes
  for (int m = 0; m < MT; ++m) xr[m] = xu8 + (m0 + m) * quads;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MT][2];
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_si256();
  for (int64_t j = 0; j < quads; ++j) {
    const int8_t* line = tile + j * 64;
    _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchBytes), _MM_HINT_T1);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32));
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      const __m256i xb = _mm256_set1_epi32(xr[m][j]);
      const __m256i sum_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(xb, lo), ones);
      const __m256i sum_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(xb, hi), ones);
      acc[m][0] = _mm256_add_epi32(acc[m][0], sum_lo);
      acc[m][1] = _mm256_add_epi32(acc[m][1], sum_hi);
    }
  }
  for (int m = 0; m < MT; ++m) {
    const RowQuant& r = rows[m0 + m];
    const int64_t n = t * kTileColumns;
    const float lo = finish_half(a, r, n, m0 + m, acc[m][0], screen);
    const float hi = finish_half(a, r, n + kLanes, m0 + m, acc[m][1], screen);
    tile_max[(m0 + m) * tiles + t] = std::max(lo, hi);
  }
}

using ScreenTileFn = void (*)(const GreedyHeadArgs&, const int32_t*, const RowQuant*, int64_t,
                              int64_t, float*, float*);

ScreenTileFn screen_tile_for(int64_t rows) {
  switch (rows) {
    case 1: return screen_tile<1>;
    case 2: return screen_tile<2>;
    case 3: return screen_tile<3>;
    default: return screen_tile<4>;
  }
}

// Row m's allowed columns whose bf16(S + B) reaches bf16(Lmax); false when there are more than
// the cap.
bool candidates_of(const GreedyHeadArgs& a, const RowQuant& r, const float* screen, float lmax,
                   int64_t m, std::vector<int32_t>& out) {
  out.clear();
  const __m256 threshold = round8_bf16(_mm256_set1_ps(lmax));
  const Bounds bounds(r);
  for (int64_t n = 0; n < a.N; n += kLanes) {
    const uint32_t allowed = allowed_bits(a, m, n);
    if (allowed == 0) continue;
    const __m256i lanes = first_lanes(a.N - n);
    const __m256 s = _mm256_maskload_ps(screen + n, lanes);
    const __m256 upper = _mm256_add_ps(s, bounds.at(a, n, lanes, s));
    const auto reach = static_cast<uint32_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(round8_bf16(upper), threshold, _CMP_GE_OQ)));
    for (uint32_t hit = reach & allowed; hit != 0; hit &= hit - 1) {
      if (static_cast<int64_t>(out.size()) == a.max_candidates) return false;
      out.push_back(static_cast<int32_t>(n + __builtin_ctz(hit)));
    }
  }
  return true;
}

// The first column with the largest exact logit: linear_bf16's value for row x alone (its fp32
// sum plus the zero bias, rounded to bf16); the columns ascend, so a tie keeps the earlier one.
int64_t best_candidate(const GreedyHeadArgs& a, const float* x, const std::vector<int32_t>& cols) {
  int64_t best = -1;
  float best_value = 0.f;
  for (const int32_t n : cols) {
    const float sum = linear_avx2_one_row(x, a.w + n * a.K, a.K) + 0.0f;
    const float value = to_f32(c10::BFloat16(sum).x);
    if (best < 0 || value > best_value) {
      best = n;
      best_value = value;
    }
  }
  return best;
}

// Work below this many multiply-adds per task stays on one thread (as in the bf16 kernel).
constexpr int64_t kMinWorkPerTask = 1 << 16;

}  // namespace

void greedy_head_avx2(const GreedyHeadArgs& a) {
  TORCH_CHECK(!a.amx, "greedy_head_avx2: no AMX screen");
  const int64_t M = a.M, N = a.N, K = a.K, tiles = ceil_div(N, kTileColumns);
  std::vector<int32_t> xu8(M * K / kScreenQuad);
  std::vector<float> x32(M * K);
  std::vector<RowQuant> rows(M);
  for (int64_t m = 0; m < M; ++m) {
    rows[m] = quantize_row(a.x + m * K, K, kXLimit,
                           reinterpret_cast<uint8_t*>(xu8.data() + m * K / kScreenQuad));
    for (int64_t k = 0; k < K; ++k) x32[m * K + k] = to_f32(a.x[m * K + k]);
  }
  // Unusable rows are screened anyway (their output is ignored): one code path.
  std::vector<float> screen(M * N), tile_max(M * tiles);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (M * K * kTileColumns));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m = 0; m < M; m += kMaxRowsPerTile) {
        screen_tile_for(std::min<int64_t>(kMaxRowsPerTile, M - m))(
            a, xu8.data(), rows.data(), t, m, screen.data(), tile_max.data());
      }
    }
  });
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<int32_t> cols;
    for (int64_t m = m0; m < m1; ++m) {
      const float* maxima = tile_max.data() + m * tiles;
      const float lmax = *std::max_element(maxima, maxima + tiles);
      const bool ok = rows[m].usable &&
                      candidates_of(a, rows[m], screen.data() + m * N, lmax, m, cols) &&
                      !cols.empty();
      a.out[m] = ok ? best_candidate(a, x32.data() + m * K, cols) : -1;
    }
  });
}

}  // namespace tgq_cpu
