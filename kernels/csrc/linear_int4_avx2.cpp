// linear over grouped 4-bit weights (GPTQ, AWQ, compressed-tensors int4) on AVX2/FMA CPUs, over
// the packed layout the AVX-512 kernel reads (linear_kernels.h): out = sum over k of
// x * (q - zero) * scale + bias, fp32 sums rounded once to bf16.
//
// Decoding: a nibble placed in mantissa bits 19-22 of fp32 16.0 (0x41800000) is the fp32 value
// 16 + q exactly. Each 32 bytes of a block (8 columns x 8 K values) give, per K value, the 8
// columns' nibbles shifted to bits 3-6 of a byte (one shift and one and for 64 nibbles), moved to
// byte 2 of each lane by one vpshufb (the columns come out in order: a word's column is a lane)
// and or'ed into 16.0: 2 instructions beside each 8-weight FMA.
//
// Sums: each group's sums of x * (16 + q) (x widened to fp32 once per call, each product exact;
// per column and row, block by block in K order, each block's as block_sum adds it) are folded at the group's end into the fp32 total
// with sx, the row's sum of x over the group:
//   total += scale * acc - ((zero + 16) * scale) * sx
// as the AVX-512 kernel does. Dequantizing w = (16 + q) * scale - (16 + zero) * scale in
// registers instead would add an FMA to each 8 weights' 2 decoding instructions, where the fold
// costs 2 FMAs per row, column and group: at decode's few rows the kernel is bound by the
// instructions per weight (hot in cache, ~20 cycles per 128 weights at one row), so the fold.
// Its fp32 rounding stays well inside the tests' bound.
//
// A row's sums never depend on the other rows: the same chains, in the same order, whichever
// rows and tiles are processed side by side.
#include "linear_kernels.h"

#include <array>

namespace tgq_cpu {
namespace {

constexpr int kHalves = 2;            // a tile's 16 columns: two 8-lane vectors
constexpr int kValuesPerHalf = 8;     // K values in 32 bytes (half a block)
constexpr int64_t kHalfBytes = 32;
static_assert(kInt4BlockBytes == kHalves * kHalfBytes);
static_assert(kInt4BlockValues == kValuesPerHalf);

constexpr float kOffset = 16.0f;  // the value the nibble 0 decodes to

// Half a packed block (8 columns, words 2c + k % 2) -> 8 vectors, one per K value 0..7 of the
// block, lanes the 8 columns, values 16 + q as fp32 bits.
struct NibbleToF32 {
  __m256i nibble_bits, sixteen;
  // select[p][b]: byte b (0: lines 0, 1; 1: lines 2, 3) of word 2c + p, c = 0..3 of each 128-bit
  // lane (its 4 columns), into byte 2 of lane c; the other bytes zero.
  __m256i select[2][2];

  NibbleToF32() : nibble_bits(_mm256_set1_epi8(0x78)), sixteen(_mm256_set1_epi32(0x41800000)) {
    for (int p = 0; p < 2; ++p) {
      for (int b = 0; b < 2; ++b) {
        alignas(32) int8_t control[32];
        for (int i = 0; i < 32; ++i) {
          const int c = i % 16 / 4;
          control[i] = i % 4 == 2 ? static_cast<int8_t>(2 * (2 * c + p) + b) : int8_t{-128};
        }
        select[p][b] = _mm256_load_si256(reinterpret_cast<const __m256i*>(control));
      }
    }
  }

  void half(const uint8_t* bytes, __m256i (&w)[kValuesPerHalf]) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    // Each byte's low nibble (lines 0 and 2) and high nibble (lines 1 and 3), at bits 3-6.
    const __m256i low = _mm256_and_si256(_mm256_slli_epi16(v, 3), nibble_bits);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 1), nibble_bits);
#pragma GCC unroll 8
    for (int k = 0; k < kValuesPerHalf; ++k) {  // k = 2 * line + parity
      const int line = k / 2;
      const __m256i src = line % 2 == 0 ? low : high;
      w[k] = _mm256_or_si256(_mm256_shuffle_epi8(src, select[k % 2][line / 2]), sixteen);
    }
  }
};

// sum over a block's 8 K values of x[k] * w[k], as (k 0-3) + (k 4-7), each a product and 3 FMAs
// in K order: the running sum waits on one add a block, not on 8 FMAs.
inline __m256 block_sum(const float* x, const __m256i (&w)[kValuesPerHalf]) {
  __m256 part[2];
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p) {
    const int k0 = p * kValuesPerHalf / 2;
    part[p] = _mm256_mul_ps(_mm256_broadcast_ss(x + k0), _mm256_castsi256_ps(w[k0]));
#pragma GCC unroll 3
    for (int k = k0 + 1; k < k0 + kValuesPerHalf / 2; ++k) {
      part[p] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), _mm256_castsi256_ps(w[k]), part[p]);
    }
  }
  return _mm256_add_ps(part[0], part[1]);
}

// The call's inputs as the kernel reads them: x widened to fp32, and sx.
struct Int4Call {
  const Int4Linear& a;
  const float* x;   // [M, x_stride] fp32
  const float* sx;  // [M, G]: each row's sum of x over each group
};

// Per tile and group, the 16 columns' scale and (zero + 16) * scale: [G][2][16] floats.
constexpr int64_t kScaleFloats = 2 * kPackColumns;

// One tile's columns of the [N, G] scales and zeros, gathered group by group (columns past N
// read as zeros: their lanes are never stored).
void tile_scales(const Int4Linear& a, int64_t tile, float* dst) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i rows = _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(a.groups)));
  for (int h = 0; h < kHalves; ++h) {
    const int64_t n = tile * kPackColumns + h * kVec;
    const int columns = static_cast<int>(std::clamp<int64_t>(a.N - n, 0, kVec));
    const __m256 mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(columns), lane));
    for (int64_t g = 0; g < a.groups; ++g) {
      // n past N (no lane loads): an address in bounds all the same.
      const int64_t at = std::min(n, a.N - 1) * a.groups + g;
      const __m256 s = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), a.scale + at, rows, mask, 4);
      const __m256 z = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), a.zero + at, rows, mask, 4);
      float* out = dst + g * kScaleFloats + h * kVec;
      _mm256_storeu_ps(out, s);
      _mm256_storeu_ps(out + kPackColumns,
                       _mm256_mul_ps(_mm256_add_ps(z, _mm256_set1_ps(kOffset)), s));
    }
  }
}

// Row m's 16 columns of tile `tile`: total + bias, in fp32 or rounded to bf16; columns past N
// are not stored.
void store_tile_row(const Int4Linear& a, int64_t tile, int64_t m, const float* total) {
  for (int h = 0; h < kHalves; ++h) {
    const int64_t n = tile * kPackColumns + h * kVec, count = std::min<int64_t>(kVec, a.N - n);
    if (count <= 0) return;
    alignas(32) float v[kVec];
    _mm256_store_ps(v, load8(total + h * kVec));
    if (a.bias != nullptr) {
      for (int64_t i = 0; i < count; ++i) v[i] += a.bias[n + i];
    }
    if (a.out_f32 != nullptr) {
      std::copy(v, v + count, a.out_f32 + m * a.N + n);
    } else if (count == kVec) {
      store8_bf16(a.out + m * a.N + n, load8(v));
    } else {
      for (int64_t i = 0; i < count; ++i) store_out(a.out + m * a.N + n + i, v[i]);
    }
  }
}

// The 4-bit stream is prefetched into L2 this far ahead.
constexpr int64_t kPrefetchBytes = 4096;

// Rows [m0, m0 + MT) of x against tiles [t0, t0 + TT); scales: the TT tiles' tile_scales, one
// after the other. Two group sums per row and tile (one per half) live in registers; the running totals, touched once
// a group, stay in memory (L1).
template <int MT, int TT>
void int4_rows(const Int4Call& call, int64_t t0, int64_t m0, const float* scales) {
  const Int4Linear& a = call.a;
  const int64_t blocks = a.x_stride / kInt4BlockValues, tile_bytes = blocks * kInt4BlockBytes;
  const int64_t per_group = ceil_div(a.group_size, kInt4BlockValues);
  const float* x = call.x + m0 * a.x_stride;
  const NibbleToF32 decode;
  alignas(32) float total[TT][MT][kPackColumns] = {};
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 acc[TT][MT][kHalves];
    for (auto& tile : acc)
      for (auto& row : tile)
        for (auto& v : row) v = _mm256_setzero_ps();
    for (int64_t j = g * per_group; j < std::min(blocks, (g + 1) * per_group); ++j) {
#pragma GCC unroll 4
      for (int tt = 0; tt < TT; ++tt) {
        const uint8_t* block = a.q + (t0 + tt) * tile_bytes + j * kInt4BlockBytes;
        _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T1);
#pragma GCC unroll 2
        for (int h = 0; h < kHalves; ++h) {
          __m256i w[kValuesPerHalf];
          decode.half(block + h * kHalfBytes, w);
#pragma GCC unroll 4
          for (int m = 0; m < MT; ++m) {
            const float* xj = x + m * a.x_stride + j * kInt4BlockValues;
            acc[tt][m][h] = _mm256_add_ps(acc[tt][m][h], block_sum(xj, w));
          }
        }
      }
    }
    for (int tt = 0; tt < TT; ++tt) {
      const float* s = scales + (tt * a.groups + g) * kScaleFloats;
      for (int m = 0; m < MT; ++m) {
        const __m256 row_sum = _mm256_set1_ps(call.sx[(m0 + m) * a.groups + g]);
        for (int h = 0; h < kHalves; ++h) {
          float* t = total[tt][m] + h * kVec;
          const __m256 sum = _mm256_fmadd_ps(load8(s + h * kVec), acc[tt][m][h], load8(t));
          _mm256_store_ps(t, _mm256_fnmadd_ps(load8(s + kPackColumns + h * kVec), row_sum, sum));
        }
      }
    }
  }
  for (int tt = 0; tt < TT; ++tt) {
    for (int m = 0; m < MT; ++m) store_tile_row(a, t0 + tt, m0 + m, total[tt][m]);
  }
}

// Rows per int4_rows call: 2 * MT * TT sums in registers, and the partial sums beside them.
constexpr int kMaxRows = 4;
// Tiles side by side for MT rows, so that 4 or more sums are in flight (each waits on one add a
// block, block_sum): 2 tiles at 1 row, 1 from 2.
template <int MT>
constexpr int kSideBySide = MT == 1 ? 2 : 1;
// Tiles whose scales are gathered together: the widest kSideBySide.
constexpr int64_t kSetTiles = 4;

// Rows [m0, m0 + MT) against the `count` tiles from t0.
template <int MT>
void rows_against_tiles(const Int4Call& call, int64_t t0, int64_t count, int64_t m0,
                        const float* scales) {
  constexpr int TT = kSideBySide<MT>;
  const int64_t scale_stride = call.a.groups * kScaleFloats;
  int64_t u = 0;
  for (; u + TT <= count; u += TT) int4_rows<MT, TT>(call, t0 + u, m0, scales + u * scale_stride);
  for (; u < count; ++u) int4_rows<MT, 1>(call, t0 + u, m0, scales + u * scale_stride);
}

using RowsFn = void (*)(const Int4Call&, int64_t, int64_t, int64_t, const float*);
constexpr std::array<RowsFn, kMaxRows> kRows{rows_against_tiles<1>, rows_against_tiles<2>,
                                             rows_against_tiles<3>, rows_against_tiles<4>};

// x widened to fp32 and sx, both per row; sx sums 8 values at a time (a block never straddles
// two groups), in the same order for every row.
void widen_rows(const Int4Linear& a, float* x32, float* sx) {
  const int64_t blocks = a.x_stride / kInt4BlockValues;
  const int64_t per_group = ceil_div(a.group_size, kInt4BlockValues);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / a.x_stride);
  at::parallel_for(0, a.M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const bf16_bits* row = a.x + m * a.x_stride;
      float* wide = x32 + m * a.x_stride;
      for (int64_t g = 0; g < a.groups; ++g) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = g * per_group; j < std::min(blocks, (g + 1) * per_group); ++j) {
          const __m256 v = load8(row + j * kInt4BlockValues);
          _mm256_storeu_ps(wide + j * kInt4BlockValues, v);
          sum = _mm256_add_ps(sum, v);
        }
        sx[m * a.groups + g] = hsum(sum);
      }
    }
  });
}

}  // namespace

void linear_int4_packed_avx2(const Int4Linear& a, bool wide) {
  std::vector<float> x32(a.M * a.x_stride), sx(a.M * a.groups);
  widen_rows(a, x32.data(), sx.data());
  if (wide) {
    linear_int4_packed_avx512f(a, x32.data(), sx.data());
    return;
  }
  const Int4Call call{a, x32.data(), sx.data()};
  // One pass over the weights: each set of tiles, its weights in L1/L2 after the first rows,
  // against every group of 4 rows.
  const int64_t tiles = ceil_div(a.N, kPackColumns), sets = ceil_div(tiles, kSetTiles);
  at::parallel_for(0, sets, 1, [&](int64_t set0, int64_t set1) {
    std::vector<float> scales(kSetTiles * a.groups * kScaleFloats);
    for (int64_t set = set0; set < set1; ++set) {
      const int64_t t0 = set * kSetTiles, count = std::min(kSetTiles, tiles - t0);
      for (int64_t u = 0; u < count; ++u) {
        tile_scales(a, t0 + u, scales.data() + u * a.groups * kScaleFloats);
      }
      for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
        kRows[std::min<int64_t>(kMaxRows, a.M - m0) - 1](call, t0, count, m0, scales.data());
      }
    }
  });
}

}  // namespace tgq_cpu
