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

// Weight tiles ahead that dot_step prefetches: the hardware prefetcher alone leaves the tile loop
// waiting on DRAM (measured ~1.5x slower at M = 16 on a Zen 5 EPYC). The lines are fetched in
// address order and into L2 (T1): on a Zen 4 EPYC, where the weights of a decode step stream from
// DRAM, that took the linears of a medium-model step at M = 16 from 19.0 to 13.4 ms (16 rows
// ahead at the same K into L1, as before: 23.4 ms). Prefetching past the end of w is harmless (a
// hint never faults).
constexpr int kPrefetchTiles = 2;

// acc[m][n] += pairwise products of x row m and w row n over the 32 values from k.
template <int MT, int NT, bool kTail>
inline void dot_step(const bf16_bits* x, const bf16_bits* w, int64_t K, int64_t k,
                     __m512 (&acc)[MT][NT]) {
  const int64_t count = K - k;
  __m512bh wv[NT];
#pragma GCC unroll 8
  for (int n = 0; n < NT; ++n) {
    wv[n] = kTail ? load_tail(w + n * K + k, count) : load(w + n * K + k);
    // The tile's NT rows are contiguous, so are consecutive tiles: line n of this step's NT
    // lines, in address order, kPrefetchTiles tiles ahead.
    const bf16_bits* ahead = w + kPrefetchTiles * NT * K + (k / kPairs * NT + n) * kPairs;
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const __m512bh xv = kTail ? load_tail(x + m * K + k, count) : load(x + m * K + k);
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
  }
}

// sums[m * NT + n] = dot(x row m, w row n) for an MT x NT tile. Each step along K loads NT weight
// vectors once and reuses each across the MT rows of x.
template <int MT, int NT>
void dot_tile(const bf16_bits* x, const bf16_bits* w, int64_t K, float* sums) {
  __m512 acc[MT][NT];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kPairs <= K; k += kPairs) dot_step<MT, NT, false>(x, w, K, k, acc);
  if (k < K) dot_step<MT, NT, true>(x, w, K, k, acc);
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) sums[m * NT + n] = _mm512_reduce_add_ps(acc[m][n]);
}

using TileFn = void (*)(const bf16_bits*, const bf16_bits*, int64_t, float*);

// Tiles of MT rows of x by NT rows of w, as wide as the 32 registers allow: MT * NT accumulators
// + NT weight vectors + 1 x vector <= 32. Up to 8 rows of x share each weight vector load.
constexpr int kMaxMT = 8;
constexpr int kTileSums = 24;  // largest MT * NT
constexpr int64_t kGroupRows = 24;  // weight rows per unit of work: a multiple of every NT

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

void store_tile(const SmallLinear& a, const float* sums, int mt, int nt, int64_t m0, int64_t n) {
  for (int m = 0; m < mt; ++m) {
    for (int j = 0; j < nt; ++j) {
      const float v = sums[m * nt + j] + (a.bias != nullptr ? a.bias[n + j] : 0.0f);
      const int64_t at = (m0 + m) * a.N + n + j;
      if (a.out_f32 != nullptr) {
        a.out_f32[at] = static_cast<float>(c10::BFloat16(v));  // as bf16 output, then .float()
      } else {
        store_out(a.out + at, v);
      }
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
  constexpr int64_t kRowUnit = kGroupRows;  // thread boundaries keep whole tiles
  constexpr int64_t kMinWorkPerTask = 1 << 16;  // multiply-adds below which one thread does it
  const int64_t num_units = (a.N + kRowUnit - 1) / kRowUnit;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (a.M * a.K * kRowUnit));
  at::parallel_for(0, num_units, grain, [&](int64_t u0, int64_t u1) {
    linear_rows(a, u0 * kRowUnit, std::min(a.N, u1 * kRowUnit));
  });
}

}  // namespace tgq_cpu
