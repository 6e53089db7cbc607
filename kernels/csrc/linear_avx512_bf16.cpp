// linear_bf16 for few rows of x on CPUs with AVX512_BF16: y[M,N] = x[M,K] @ w[N,K]^T + b, x and w
// in bf16, products exact and sums in fp32 (vdpbf16ps). Only this file is compiled for that ISA
// (the target pragma below); linear_bf16.cpp calls it after checking the CPU at run time.
//
// Decode steps run a linear over M = 1..tens of rows: memory-bound at M = 1, compute-bound from
// M of a few on this ISA. oneDNN's bf16 GEMM behind at::linear is excellent for large M but slow
// here for small M (2-5x slower at M = 1..16 on a Zen 5 EPYC), so small M comes here.
#include "linear_kernels.h"

namespace tgq_cpu {

// Before the target pragma: this runs on every CPU.
bool cpu_has_avx512_bf16() {
  static const bool supported =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return supported;
}

}  // namespace tgq_cpu

// Everything below may use AVX-512 and runs only where cpu_has_avx512_bf16().
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace tgq_cpu {
namespace {

constexpr int64_t kPairs = 32;  // bf16 values per __m512bh: 16 fp32 lanes, each a pair's sum

inline __m512bh load(const bf16_bits* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// The first `count` (< 32) values from p, zero-filled: the K tail adds nothing.
inline __m512bh load_tail(const bf16_bits* p, int64_t count) {
  const auto mask = static_cast<__mmask32>((1ULL << count) - 1);
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// How far ahead of its loads a kernel prefetches the weights: the hardware prefetcher alone leaves
// the loops waiting on DRAM (measured ~1.5x slower at M = 16 on a Zen 5 EPYC). Lines are fetched
// in address order, into L2 (T1). Prefetching past the end of w is harmless (a hint never faults).
//  - Tiles (M > kMaxStreamRows) read NT rows side by side, so they fetch kPrefetchTiles whole
//    tiles ahead: on a Zen 4 EPYC, where a decode step's weights stream from DRAM, that took the
//    linears of a medium-model step at M = 16 from 19.0 to 13.4 ms (16 rows ahead at the same K
//    into L1, as before: 23.4 ms).
//  - Row streams (M <= kMaxStreamRows) read one row after another, a single sequential stream,
//    and fetch kPrefetchBytes ahead of it: 4 KiB beat 2 and 8 KiB and 1-2 tiles.
constexpr int kPrefetchTiles = 2;
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_l2(const bf16_bits* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// acc[m][n] += pairwise products of x row m and w row n over the 32 values from k; w[n] points at
// row n, pf at this step's NT lines of the weights kPrefetchTiles tiles ahead.
template <int MT, int NT, bool kTail>
inline void dot_step(const bf16_bits* x, const bf16_bits* const (&w)[NT], int64_t K, int64_t k,
                     const bf16_bits* pf, __m512 (&acc)[MT][NT]) {
  const int64_t count = K - k;
  __m512bh wv[NT];
#pragma GCC unroll 8
  for (int n = 0; n < NT; ++n) {
    wv[n] = kTail ? load_tail(w[n] + k, count) : load(w[n] + k);
    prefetch_l2(pf + n * kPairs);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const __m512bh xv = kTail ? load_tail(x + m * K + k, count) : load(x + m * K + k);
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
  }
}

// sums[m * NT + n] = dot(x row m, w row n) for an MT x NT tile. Each step along K loads NT weight
// vectors once and reuses each across the MT rows of x. The tile's NT rows are contiguous, and so
// are consecutive tiles: the prefetch walks the tile kPrefetchTiles ahead, NT lines a step, in
// address order. (Row pointers and the prefetch pointer are kept, not recomputed from k: ~5%
// faster in a standalone loop at K = 768, within noise inside torch.)
template <int MT, int NT>
void dot_tile(const bf16_bits* x, const bf16_bits* w, int64_t K, float* sums) {
  __m512 acc[MT][NT];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const bf16_bits* rows[NT];
  for (int n = 0; n < NT; ++n) rows[n] = w + n * K;
  const bf16_bits* pf = w + kPrefetchTiles * NT * K;
  int64_t k = 0;
  for (; k + kPairs <= K; k += kPairs, pf += NT * kPairs) {
    dot_step<MT, NT, false>(x, rows, K, k, pf, acc);
  }
  if (k < K) dot_step<MT, NT, true>(x, rows, K, k, pf, acc);
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) sums[m * NT + n] = _mm512_reduce_add_ps(acc[m][n]);
}

// sums[m] = dot(x row m, w row 0) for MT rows of x, KU partial sums per row so that enough FMA
// chains are in flight. The weights are read as one sequential stream, every line prefetched.
template <int MT, int KU>
void dot_row(const bf16_bits* x, const bf16_bits* w, int64_t K, float* sums) {
  constexpr int64_t kAhead = kPrefetchBytes / sizeof(bf16_bits);
  __m512 acc[KU][MT];
  for (auto& part : acc)
    for (auto& a : part) a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + KU * kPairs <= K; k += KU * kPairs) {
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) {
      const int64_t at = k + u * kPairs;
      prefetch_l2(w + at + kAhead);
      const __m512bh wv = load(w + at);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_dpbf16_ps(acc[u][m], load(x + m * K + at), wv);
    }
  }
  for (; k < K; k += kPairs) {
    const int64_t count = std::min<int64_t>(kPairs, K - k);
    const __m512bh wv = count == kPairs ? load(w + k) : load_tail(w + k, count);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = count == kPairs ? load(x + m * K + k) : load_tail(x + m * K + k, count);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], xv, wv);
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int u = 1; u < KU; ++u) acc[0][m] = _mm512_add_ps(acc[0][m], acc[u][m]);
    sums[m] = _mm512_reduce_add_ps(acc[0][m]);
  }
}

using TileFn = void (*)(const bf16_bits*, const bf16_bits*, int64_t, float*);

// Tiles of MT rows of x by NT rows of w, as wide as the 32 registers allow: MT * NT accumulators
// + NT weight vectors + 1 x vector <= 32. Up to 8 rows of x share each weight vector load.
constexpr int kMaxMT = 8;
constexpr int kTileSums = 24;  // largest MT * NT
constexpr int64_t kRowUnit = 24;  // weight rows per unit of work: a multiple of every NT

int tile_rows(int mt) { return mt <= 2 ? 8 : mt <= 4 ? 6 : 3; }

template <int NT>
TileFn tile_for(int mt) {
  switch (mt) {
    case 1: return dot_tile<1, NT>;
    case 2: return dot_tile<2, NT>;
    case 3: return dot_tile<3, NT>;
    case 4: return dot_tile<4, NT < 6 ? NT : 6>;
    case 5: return dot_tile<5, NT < 3 ? NT : 3>;
    case 6: return dot_tile<6, NT < 3 ? NT : 3>;
    case 7: return dot_tile<7, NT < 3 ? NT : 3>;
    default: return dot_tile<8, NT < 3 ? NT : 3>;
  }
}

TileFn edge_tile(int mt) { return tile_for<1>(mt); }

// Up to this many rows of x, each weight row is streamed on its own (dot_row): the step is
// memory-bound, and one sequential stream per thread reads DRAM faster than NT rows side by side
// (a medium-model step's linears on a Zen 4 EPYC, timed in turns with the tiles: 4-6% faster
// at M = 1, 3% at M = 2..4).
constexpr int64_t kMaxStreamRows = 4;

TileFn stream_for(int mt) {
  switch (mt) {
    case 1: return dot_row<1, 4>;
    case 2: return dot_row<2, 4>;
    case 3: return dot_row<3, 2>;
    default: return dot_row<4, 2>;
  }
}

// fp32 -> bf16 bits, round to nearest even, a NaN to the quiet NaN 0x7fc0: c10::BFloat16's
// conversion, 16 lanes at a time (vcvtneps2bf16 would flush denormals instead).
inline __m256i to_bf16_rne(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

// out[m0 + m, n : n + nt] = sums[m * nt : (m + 1) * nt] + bias, a row of the tile per vector
// (scalar conversions here cost ~15% of a tile at K = 768).
void store_tile(const SmallLinear& a, const float* sums, int mt, int nt, int64_t m0, int64_t n) {
  const auto lanes = static_cast<__mmask16>((1u << nt) - 1);
  const __m512 bias =
      a.bias != nullptr ? _mm512_maskz_loadu_ps(lanes, a.bias + n) : _mm512_setzero_ps();
  for (int m = 0; m < mt; ++m) {
    const __m256i out = to_bf16_rne(_mm512_add_ps(_mm512_maskz_loadu_ps(lanes, sums + m * nt), bias));
    const int64_t at = (m0 + m) * a.N + n;
    if (a.out_f32 != nullptr) {  // as bf16 output, then .float()
      const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(out), 16));
      _mm512_mask_storeu_ps(a.out_f32 + at, lanes, wide);
    } else {
      _mm256_mask_storeu_epi16(a.out + at, lanes, out);
    }
  }
}

TileFn tile_of(int nt, int mt) {
  return nt == 8 ? tile_for<8>(mt) : nt == 6 ? tile_for<6>(mt) : tile_for<3>(mt);
}

// out[:, n_begin:n_end], one tile of weight rows at a time, every group of up to 8 rows of x in
// turn on that tile: the tile is read from DRAM once and then from L1, and the weights stream in
// one sequential pass, which the prefetch in dot_step stays ahead of. (Looping over x's groups
// outside the tiles instead restarted the weight stream for every group: at M = 16 that ran at
// ~9 GB/s from DRAM on a Zen 4 EPYC.) Every pass uses the first one's tile width, so that all
// rows of x share each tile.
void linear_rows(const SmallLinear& a, int64_t n_begin, int64_t n_end) {
  float sums[kTileSums];
  if (a.M <= kMaxStreamRows) {
    const TileFn row = stream_for(static_cast<int>(a.M));
    for (int64_t n = n_begin; n < n_end; ++n) {
      row(a.x, a.w + n * a.K, a.K, sums);
      store_tile(a, sums, static_cast<int>(a.M), 1, 0, n);
    }
    return;
  }
  const int nt = tile_rows(static_cast<int>(std::min<int64_t>(kMaxMT, a.M)));
  for (int64_t n = n_begin; n < n_end;) {
    const int step = n_end - n >= nt ? nt : 1;
    for (int64_t m0 = 0; m0 < a.M; m0 += kMaxMT) {
      const int mt = static_cast<int>(std::min<int64_t>(kMaxMT, a.M - m0));
      (step == nt ? tile_of(nt, mt) : edge_tile(mt))(a.x + m0 * a.K, a.w + n * a.K, a.K, sums);
      store_tile(a, sums, mt, step, m0, n);
    }
    n += step;
  }
}

}  // namespace

void linear_bf16_avx512(const SmallLinear& a) {
  constexpr int64_t kMinWorkPerTask = 1 << 16;  // multiply-adds below which one thread does it
  const int64_t num_units = (a.N + kRowUnit - 1) / kRowUnit;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (a.M * a.K * kRowUnit));
  at::parallel_for(0, num_units, grain, [&](int64_t u0, int64_t u1) {  // whole tiles per thread
    linear_rows(a, u0 * kRowUnit, std::min(a.N, u1 * kRowUnit));
  });
}

}  // namespace tgq_cpu
