// The screened greedy lm_head on AVX512_BF16 + AVX512_VNNI CPUs: for each row of x, the index of
// its largest logit, exactly as argmax(linear_bf16_packed(x, w, out_fp32=True)) picks it (the
// first of equal maxima), reading the int8 screen (1 byte per weight) instead of w (2 bytes). At
// batch 1 the lm_head is a fifth of a decode step's weight traffic, and the step waits on DRAM.
//
// Per row: x = sx * xq + ex, xq integers in [-127, 127]; w[n] = s[n] * q[n] + e[n] (the screen).
// Then x . w[n] = sx * s[n] * (xq . q[n]) + sx * xq . e[n] + ex . w[n], so the screen's value
// S[n] = sx * s[n] * (xq . q[n]) (one exact integer dot product, vpdpbusd) is within
//   (|x| + |ex|) |e[n]| + |ex| |w[n]|                                      (Cauchy-Schwarz)
// of the true dot product, and the kernel's fp32 sum F[n] within gamma_K |x| |w[n]| of that
// (K roundings of a sum of exact bf16 products, each within an ulp), plus denormal flushes far
// below 2^-70. The
// packer folds the per-column factors into bound_x[n] = |e[n]| + gamma_K |w[n]| and
// bound_ex[n] = |e[n]| + |w[n]| (rounded up): B[n] = |x| bound_x[n] + |ex| bound_ex[n], widened
// by 2^-10 for the roundings of this very computation, brackets F[n] in [S - B, S + B].
//
// The logit is bf16(F[n]), and rounding is monotone: with Lmax the largest lower bound S - B (at
// some column b), a column whose bf16(S + B) < bf16(Lmax) has bf16(F[n]) < bf16(F[b]), so it can
// neither be the maximum nor tie it. The rest, the candidates (10-30 over a 32k vocabulary for a
// random model), get their exact F[n]: the packed kernel's chain of vdpbf16ps in K order, lane
// for lane, over w's rows (1.5 KB per candidate at K = 768; from the packed tiles, whose lines
// each hold one pair of 16 columns, a column would cost a whole 24 KB tile of traffic: at batch
// 16 that took a third of the op's time); the first largest wins.
#include "greedy_head.h"

#include "linear_kernels.h"  // cpu_has_avx512_bf16, kPackColumns

namespace tgq_cpu {

// Before the target pragma: this runs on every CPU.
bool cpu_has_avx512_vnni_bf16() {
  static const bool supported = cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512vnni");
  return supported;
}

}  // namespace tgq_cpu

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")
#include "avx512_common.h"

namespace tgq_cpu {
namespace {

constexpr int kLanes = 16;
static_assert(kPackColumns == kLanes);
constexpr int kMaxRowsPerTile = 8;  // accumulators per pass over a tile (it stays in L1)
constexpr float kMargin = 1.0f / 1024;
constexpr float kTiny = 0x1p-70f;
// The screen is read this far ahead into L2, as the bf16 kernel reads its weights.
constexpr int64_t kPrefetchBytes = 4096;

// x's bytes: |xq| <= 127, stored as xq + 128.
constexpr int kXLimit = 127;

struct Bounds {
  __m512 norm_x, norm_ex;
  Bounds(const RowQuant& r) : norm_x(_mm512_set1_ps(r.norm_x)), norm_ex(_mm512_set1_ps(r.norm_ex)) {}

  // B for columns [n, n + 16), given their screen values.
  __m512 at(const GreedyHeadArgs& a, int64_t n, __mmask16 lanes, __m512 screen) const {
    const __m512 bx = _mm512_maskz_loadu_ps(lanes, a.bound_x + n);
    const __m512 bex = _mm512_maskz_loadu_ps(lanes, a.bound_ex + n);
    const __m512 b = _mm512_fmadd_ps(norm_x, bx, _mm512_mul_ps(norm_ex, bex));
    const __m512 margin = _mm512_mul_ps(_mm512_abs_ps(screen), _mm512_set1_ps(kMargin));
    return _mm512_add_ps(_mm512_fmadd_ps(b, _mm512_set1_ps(1.0f + kMargin), margin),
                         _mm512_set1_ps(kTiny));
  }
};

__mmask16 tile_lanes(int64_t N, int64_t n) {
  const int64_t count = std::min<int64_t>(kLanes, N - n);
  return static_cast<__mmask16>((1u << count) - 1);
}

// Row m's allowed columns among [n, n + 16) (all of them without masks); n is a multiple of 16.
__mmask16 allowed_lanes(const GreedyHeadArgs& a, int64_t m, int64_t n) {
  const __mmask16 lanes = tile_lanes(a.N, n);
  if (a.masks == nullptr) return lanes;
  const int64_t word = n / 32;
  if (word >= a.mask_words) return 0;
  return lanes & static_cast<__mmask16>(a.masks[m * a.mask_words + word] >> (n & 16));
}

// Row m's screen values over tile t from its sums acc (16 lanes: xu8 . q[n], the bytes as
// unsigned): stores them and the row's largest lower bound over the tile's columns it may take.
// Under a mask, Lmax is thus the largest lower bound S - B over the allowed columns: the screen's
// argument runs over them alone (a column outside cannot win, so it cannot bound either).
inline void finish_row(const GreedyHeadArgs& a, const RowQuant& r, int64_t t, int64_t m,
                       __m512i acc, float* screen, float* tile_max) {
  const int64_t n = t * kLanes, tiles = (a.N + kLanes - 1) / kLanes;
  const __mmask16 lanes = tile_lanes(a.N, n);
  // 128 q_sum
  const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(lanes, a.q_sum + n), 7);
  const __m512 scale = _mm512_maskz_loadu_ps(lanes, a.scale + n);
  const __m512i dot = _mm512_sub_epi32(acc, offset);  // xq . q[n]
  const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(r.sx), scale));
  _mm512_mask_storeu_ps(screen + m * a.N + n, lanes, s);
  const __m512 lower = _mm512_sub_ps(s, Bounds(r).at(a, n, lanes, s));
  tile_max[m * tiles + t] = _mm512_mask_reduce_max_ps(allowed_lanes(a, m, n), lower);
}

// Screen values of rows [m0, m0 + MT) against tile t (finish_row stores them).
template <int MT>
void screen_tile(const GreedyHeadArgs& a, const int32_t* xu8, const RowQuant* rows, int64_t t,
                 int64_t m0, float* screen, float* tile_max) {
  const int64_t quads = a.K / kScreenQuad;
  const int8_t* tile = a.q + t * quads * 64;
  const int32_t* xr[MT];  // each row's quads of bytes
  for (int m = 0; m < MT; ++m) xr[m] = xu8 + (m0 + m) * quads;
  __m512i acc[MT];
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (int64_t j = 0; j < quads; ++j) {
    const int8_t* line = tile + j * 64;
    _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchBytes), _MM_HINT_T1);
    const __m512i w = _mm512_loadu_si512(line);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      // Inline asm, not _mm512_dpbusd_epi32: GCC 12 copies every accumulator at each step of
      // the intrinsic (two register moves per multiply-add; batch 16: 1.65 -> 1.35 ms).
      __m512i sum = acc[m];
      asm("vpdpbusd %2, %1, %0" : "+v"(sum) : "v"(_mm512_set1_epi32(xr[m][j])), "v"(w));
      acc[m] = sum;
    }
  }
  for (int m = 0; m < MT; ++m) finish_row(a, rows[m0 + m], t, m0 + m, acc[m], screen, tile_max);
}

using ScreenTileFn = void (*)(const GreedyHeadArgs&, const int32_t*, const RowQuant*, int64_t,
                              int64_t, float*, float*);

ScreenTileFn screen_tile_for(int64_t rows) {
  switch (rows) {
    case 1: return screen_tile<1>;
    case 2: return screen_tile<2>;
    case 3: return screen_tile<3>;
    case 4: return screen_tile<4>;
    case 5: return screen_tile<5>;
    case 6: return screen_tile<6>;
    case 7: return screen_tile<7>;
    default: return screen_tile<8>;
  }
}

// v rounded to bf16 as the packed kernel's fp32 output (its bf16 result, widened).
inline __m512 as_logit(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits_rne16(v), 16));
}

// Row m's allowed columns whose bf16(S + B) reaches bf16(Lmax); false when there are more than
// the cap.
bool candidates_of(const GreedyHeadArgs& a, const RowQuant& r, const float* screen, float lmax,
                   int64_t m, std::vector<int32_t>& out) {
  out.clear();
  const __m512 threshold = as_logit(_mm512_set1_ps(lmax));
  const Bounds bounds(r);
  for (int64_t n = 0; n < a.N; n += kLanes) {
    const __mmask16 lanes = allowed_lanes(a, m, n);
    if (lanes == 0) continue;
    const __m512 s = _mm512_maskz_loadu_ps(lanes, screen + n);
    const __m512 upper = _mm512_add_ps(s, bounds.at(a, n, lanes, s));
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, as_logit(upper), threshold, _CMP_GE_OQ);
    if (hit == 0) continue;
    const int count = __builtin_popcount(hit);
    if (static_cast<int64_t>(out.size()) + count > a.max_candidates) return false;
    const size_t at = out.size();
    out.resize(at + count);
    const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(n)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                           12, 13, 14, 15));
    _mm512_mask_compressstoreu_epi32(out.data() + at, hit, ids);
  }
  return true;
}

// The exact logits of up to 16 candidate columns for row x: tile_few_rows' chain (one vdpbf16ps
// per pair of K values, in K order, from zero), lane c for column cols[c]. The columns' rows of w
// are read 16 pairs at a time and transposed, so that each step has pair p of every column.
__m512 exact_logits(const GreedyHeadArgs& a, const bf16_bits* x, const int32_t* cols, int count) {
  const int64_t pairs = a.K / 2;
  const bf16_bits* rows[kLanes];
  for (int c = 0; c < kLanes; ++c) rows[c] = a.w + cols[std::min(c, count - 1)] * a.K;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += kLanes) {
    const int step = static_cast<int>(std::min<int64_t>(kLanes, pairs - p0));
    const auto mask = static_cast<__mmask16>((1u << step) - 1);
    __m512 r[kLanes];  // r[c]: pairs p0.. of column c, as 32-bit lanes
    for (int c = 0; c < kLanes; ++c) r[c] = _mm512_maskz_loadu_ps(mask, rows[c] + 2 * p0);
    transpose16(r);  // r[j]: pair p0 + j of the 16 columns
    for (int j = 0; j < step; ++j) {
      acc = _mm512_dpbf16_ps(acc, broadcast_pair(x + 2 * (p0 + j)),
                             reinterpret_cast<__m512bh>(_mm512_castps_si512(r[j])));
    }
  }
  // + 0: the packed kernel adds its (zero) bias before rounding.
  return as_logit(_mm512_add_ps(acc, _mm512_setzero_ps()));
}

int64_t best_candidate(const GreedyHeadArgs& a, const bf16_bits* x,
                       const std::vector<int32_t>& cols) {
  int64_t best = -1;
  float best_value = 0.f;
  alignas(64) float values[kLanes];
  for (size_t i = 0; i < cols.size(); i += kLanes) {
    const int count = static_cast<int>(std::min<size_t>(kLanes, cols.size() - i));
    _mm512_store_ps(values, exact_logits(a, x, cols.data() + i, count));
    for (int c = 0; c < count; ++c) {  // columns ascend: a tie keeps the earlier one
      if (best < 0 || values[c] > best_value) {
        best = cols[i + c];
        best_value = values[c];
      }
    }
  }
  return best;
}

// Work below this many multiply-adds per task stays on one thread (as in the bf16 kernel).
constexpr int64_t kMinWorkPerTask = 1 << 16;

}  // namespace

}  // namespace tgq_cpu

// ----------------------------------------------------------------------------------------------
// The screen through AMX-INT8 tiles (runs only where cpu_has_amx_int8()): a screen tile's K / 4
// lines of 16 columns x 4 bytes are TDPBUSD's B operand as they lie (16 lines, 1 KiB, per 64
// values of K), the rows' unsigned bytes its A operand (16 rows x 64 values), and the integer
// sums are exactly vpdpbusd's, so both paths screen alike. Blocks of 32 rows x 32 columns keep
// four C tiles for all of K; needs K % 64 == 0.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")
#include "amx_common.h"

namespace tgq_cpu {
namespace {

constexpr int64_t kTileValues = 64;  // K values per A/B tile

// Tiles 0-3: C (row block r, column block c at 2 * r + c); 4-5: A (row blocks); 6-7: B. Rows
// [m, m + 16 * MB) (their bytes at x, a row every K bytes) against screen tiles [t, t + NB); the
// sums go to sums (rows of 32 int32: row block r at row 16 r, column block c at column 16 c).
template <int MB, int NB>
void amx_screen_block(const GreedyHeadArgs& a, const uint8_t* x, int64_t t, int32_t* sums) {
  const int64_t quads = a.K / kScreenQuad;
  const int8_t* w = a.q + t * quads * 64;
  constexpr int64_t kSumsStride = 2 * kLanes * sizeof(int32_t);
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MB > 1) _tile_zero(2);
  if constexpr (MB > 1 && NB > 1) _tile_zero(3);
  for (int64_t k = 0; k < a.K; k += kTileValues) {
    _tile_loadd(4, x + k, a.K);
    if constexpr (MB > 1) _tile_loadd(5, x + kAmxTileRows * a.K + k, a.K);
    _tile_loadd(6, w + k / kScreenQuad * 64, 64);
    if constexpr (NB > 1) _tile_loadd(7, w + (quads + k / kScreenQuad) * 64, 64);
    _tile_dpbusd(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbusd(1, 4, 7);
    if constexpr (MB > 1) _tile_dpbusd(2, 5, 6);
    if constexpr (MB > 1 && NB > 1) _tile_dpbusd(3, 5, 7);
  }
  int32_t* lower = sums + kAmxTileRows * 2 * kLanes;
  _tile_stored(0, sums, kSumsStride);
  if constexpr (NB > 1) _tile_stored(1, sums + kLanes, kSumsStride);
  if constexpr (MB > 1) _tile_stored(2, lower, kSumsStride);
  if constexpr (MB > 1 && NB > 1) _tile_stored(3, lower + kLanes, kSumsStride);
}

using AmxScreenFn = void (*)(const GreedyHeadArgs&, const uint8_t*, int64_t, int32_t*);

AmxScreenFn amx_screen_block_for(int64_t rows, int64_t tiles) {
  if (rows > kAmxTileRows) return tiles > 1 ? amx_screen_block<2, 2> : amx_screen_block<2, 1>;
  return tiles > 1 ? amx_screen_block<1, 2> : amx_screen_block<1, 1>;
}

// Every row's screen over tiles [t0, t1); xu8 has the rows' bytes padded to a multiple of 16
// rows (A tiles read whole).
void screen_tiles_amx(const GreedyHeadArgs& a, const int32_t* xu8, const RowQuant* rows,
                      int64_t t0, int64_t t1, float* screen, float* tile_max) {
  const auto* x = reinterpret_cast<const uint8_t*>(xu8);
  alignas(64) int32_t sums[2 * kAmxTileRows * 2 * kLanes];
  load_amx_tile_config();
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t columns = std::min<int64_t>(2, t1 - t);
    for (int64_t m = 0; m < a.M; m += 2 * kAmxTileRows) {
      const int64_t count = std::min<int64_t>(2 * kAmxTileRows, a.M - m);
      amx_screen_block_for(count, columns)(a, x + m * a.K, t, sums);
      for (int64_t r = 0; r < count; ++r) {
        for (int64_t c = 0; c < columns; ++c) {
          const __m512i acc = _mm512_load_si512(sums + r * 2 * kLanes + c * kLanes);
          finish_row(a, rows[m + r], t + c, m + r, acc, screen, tile_max);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace
}  // namespace tgq_cpu

#pragma GCC pop_options

namespace tgq_cpu {

void greedy_head_avx512(const GreedyHeadArgs& a) {
  const int64_t M = a.M, N = a.N, K = a.K, tiles = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(!a.amx || K % kTileValues == 0, "greedy_head_argmax (amx): K must be a multiple of ",
              kTileValues, ", got ", K);
  // The rows' bytes, written as bytes (which may alias anything) and read as quads; AMX reads
  // whole tiles of 16 rows (the padding is never used).
  const int64_t padded_rows = a.amx ? (M + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows : M;
  std::vector<int32_t> xu8(padded_rows * K / kScreenQuad);
  std::vector<RowQuant> rows(M);
  for (int64_t m = 0; m < M; ++m) {
    rows[m] = quantize_row(a.x + m * K, K, kXLimit,
                           reinterpret_cast<uint8_t*>(xu8.data() + m * K / kScreenQuad));
  }
  // Unusable rows are screened anyway (their output is ignored): one code path.
  std::vector<float> screen(M * N), tile_max(M * tiles);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (M * K * kLanes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    if (a.amx) {
      screen_tiles_amx(a, xu8.data(), rows.data(), t0, t1, screen.data(), tile_max.data());
      return;
    }
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
      const float* row_screen = screen.data() + m * N;
      const float lmax = *std::max_element(maxima, maxima + tiles);
      const bool ok = rows[m].usable && candidates_of(a, rows[m], row_screen, lmax, m, cols) &&
                      !cols.empty();
      a.out[m] = ok ? best_candidate(a, a.x + m * K, cols) : -1;
    }
  });
}

}  // namespace tgq_cpu
