// linear_int4_avx2.cpp's kernel at 16 lanes, for CPUs with AVX512F/BW/VL whether or not they have
// AVX512_BF16 (Skylake-SP to Ice Lake servers): the same packed weights, a whole block (16
// columns x 8 K values) decoded at once, each tile's 16 columns one vector, and the same sums bit
// for bit (each lane is one column: the same block sums, group folds and rounding as the AVX2
// kernel's lanes). Every 128-bit lane of a block holds 4 columns' words, as each of the AVX2
// kernel's lanes does, so its vpshufb controls serve each of the four lanes here.
#include "linear_kernels.h"

#include <array>
#include <utility>

#pragma GCC target("avx512f,avx512bw,avx512vl")

namespace tgq_cpu {
namespace {

constexpr int kValues = kInt4BlockValues;  // K values per block
constexpr int kLanes = 16;
static_assert(kPackColumns == kLanes);
constexpr float kOffset = 16.0f;  // the value the nibble 0 decodes to

// A packed block -> 8 vectors, one per K value 0..7 of the block, lanes the 16 columns, values
// 16 + q as fp32 bits.
struct NibbleToF32x16 {
  __m512i nibble_bits = _mm512_set1_epi8(0x78), sixteen = _mm512_set1_epi32(0x41800000);
  // select[p][b]: byte b (0: lines 0, 1; 1: lines 2, 3) of word 2c + p, c = 0..3 of each 128-bit
  // lane (its 4 columns), into byte 2 of lane c; the other bytes zero.
  __m512i select[2][2];

  NibbleToF32x16() {
    for (int p = 0; p < 2; ++p) {
      for (int b = 0; b < 2; ++b) {
        alignas(64) int8_t control[64];
        for (int i = 0; i < 64; ++i) {
          const int c = i % 16 / 4;
          control[i] = i % 4 == 2 ? static_cast<int8_t>(2 * (2 * c + p) + b) : int8_t{-128};
        }
        select[p][b] = _mm512_load_si512(control);
      }
    }
  }

  void block(const uint8_t* bytes, __m512 (&w)[kValues]) const {
    const __m512i v = _mm512_loadu_si512(bytes);
    const __m512i low = _mm512_and_si512(_mm512_slli_epi16(v, 3), nibble_bits);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 1), nibble_bits);
#pragma GCC unroll 8
    for (int k = 0; k < kValues; ++k) {  // k = 2 * line + parity
      const int line = k / 2;
      const __m512i src = line % 2 == 0 ? low : high;
      w[k] = _mm512_castsi512_ps(
          _mm512_or_si512(_mm512_shuffle_epi8(src, select[k % 2][line / 2]), sixteen));
    }
  }
};

// As the AVX2 kernel's block_sum: (k 0-3) + (k 4-7), each a product and 3 FMAs in K order.
inline __m512 block_sum(const float* x, const __m512 (&w)[kValues]) {
  __m512 part[2];
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p) {
    const int k0 = p * kValues / 2;
    part[p] = _mm512_mul_ps(_mm512_set1_ps(x[k0]), w[k0]);
#pragma GCC unroll 3
    for (int k = k0 + 1; k < k0 + kValues / 2; ++k) {
      part[p] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), w[k], part[p]);
    }
  }
  return _mm512_add_ps(part[0], part[1]);
}

struct Int4Call {
  const Int4Linear& a;
  const float* x;   // [M, x_stride] fp32
  const float* sx;  // [M, G]
};

// Per tile and group, the 16 columns' scale and (zero + 16) * scale: [G][2][16] floats (columns
// past N: zeros, never stored).
constexpr int64_t kScaleFloats = 2 * kPackColumns;

void tile_scales(const Int4Linear& a, int64_t tile, float* dst) {
  for (int64_t g = 0; g < a.groups; ++g) {
    float* out = dst + g * kScaleFloats;
    for (int c = 0; c < kLanes; ++c) {
      const int64_t n = tile * kPackColumns + c;
      const float s = n < a.N ? a.scale[n * a.groups + g] : 0.0f;
      const float z = n < a.N ? a.zero[n * a.groups + g] : 0.0f;
      out[c] = s;
      out[kPackColumns + c] = (z + kOffset) * s;  // as the AVX2 kernel: one add, one multiply
    }
  }
}

void store_tile_row(const Int4Linear& a, int64_t tile, int64_t m, const float* total) {
  const int64_t n = tile * kPackColumns, count = std::min<int64_t>(kLanes, a.N - n);
  for (int64_t i = 0; i < count; ++i) {
    const float v = a.bias != nullptr ? total[i] + a.bias[n + i] : total[i];
    if (a.out_f32 != nullptr) {
      a.out_f32[m * a.N + n + i] = v;
    } else {
      store_out(a.out + m * a.N + n + i, v);
    }
  }
}

constexpr int64_t kPrefetchBytes = 4096;

// Rows [m0, m0 + MT) of x against tiles [t0, t0 + TT): one group sum per row and tile in
// registers; the running totals, touched once a group, in memory (L1).
template <int MT, int TT>
void int4_rows(const Int4Call& call, int64_t t0, int64_t m0, const float* scales) {
  const Int4Linear& a = call.a;
  const int64_t blocks = a.x_stride / kValues, tile_bytes = blocks * kInt4BlockBytes;
  const int64_t per_group = ceil_div(a.group_size, kValues);
  const float* x = call.x + m0 * a.x_stride;
  const NibbleToF32x16 decode;
  alignas(64) float total[TT][MT][kLanes] = {};
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 acc[TT][MT];
    for (auto& tile : acc)
      for (auto& v : tile) v = _mm512_setzero_ps();
    for (int64_t j = g * per_group; j < std::min(blocks, (g + 1) * per_group); ++j) {
#pragma GCC unroll 8
      for (int tt = 0; tt < TT; ++tt) {
        const uint8_t* block = a.q + (t0 + tt) * tile_bytes + j * kInt4BlockBytes;
        _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T1);
        __m512 w[kValues];
        decode.block(block, w);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          acc[tt][m] = _mm512_add_ps(acc[tt][m], block_sum(x + m * a.x_stride + j * kValues, w));
        }
      }
    }
    for (int tt = 0; tt < TT; ++tt) {
      const float* s = scales + (tt * a.groups + g) * kScaleFloats;
      for (int m = 0; m < MT; ++m) {
        const __m512 row_sum = _mm512_set1_ps(call.sx[(m0 + m) * a.groups + g]);
        float* t = total[tt][m];
        const __m512 sum = _mm512_fmadd_ps(_mm512_loadu_ps(s), acc[tt][m], _mm512_load_ps(t));
        _mm512_store_ps(
            t, _mm512_fnmadd_ps(_mm512_loadu_ps(s + kPackColumns), row_sum, sum));
      }
    }
  }
  for (int tt = 0; tt < TT; ++tt) {
    for (int m = 0; m < MT; ++m) store_tile_row(a, t0 + tt, m0 + m, total[tt][m]);
  }
}

// Rows per int4_rows call (the loops over them unroll fully, so the sums stay in registers),
// and tiles side by side so that 4 or more block sums are in flight.
constexpr int kMaxRows = 8;
template <int MT>
constexpr int kSideBySide = MT == 1 ? 4 : MT == 2 ? 2 : 1;
constexpr int64_t kSetTiles = 4;

template <int MT>
void rows_against_tiles(const Int4Call& call, int64_t t0, int64_t count, int64_t m0,
                        const float* scales) {
  constexpr int TT = kSideBySide<MT>;
  const int64_t scale_stride = call.a.groups * kScaleFloats;
  int64_t u = 0;
  for (; u + TT <= count; u += TT) int4_rows<MT, TT>(call, t0 + u, m0, scales + u * scale_stride);
  for (; u < count; ++u) int4_rows<MT, 1>(call, t0 + u, m0, scales + u * scale_stride);
}

template <size_t... I>
constexpr auto rows_table(std::index_sequence<I...>) {
  using RowsFn = void (*)(const Int4Call&, int64_t, int64_t, int64_t, const float*);
  return std::array<RowsFn, sizeof...(I)>{rows_against_tiles<I + 1>...};
}

}  // namespace

void linear_int4_packed_avx512f(const Int4Linear& a, const float* x32, const float* sx) {
  constexpr auto rows = rows_table(std::make_index_sequence<kMaxRows>{});
  const Int4Call call{a, x32, sx};
  const int64_t tiles = ceil_div(a.N, kPackColumns), sets = ceil_div(tiles, kSetTiles);
  at::parallel_for(0, sets, 1, [&](int64_t set0, int64_t set1) {
    std::vector<float> scales(kSetTiles * a.groups * kScaleFloats);
    for (int64_t set = set0; set < set1; ++set) {
      const int64_t t0 = set * kSetTiles, count = std::min(kSetTiles, tiles - t0);
      for (int64_t u = 0; u < count; ++u) {
        tile_scales(a, t0 + u, scales.data() + u * a.groups * kScaleFloats);
      }
      for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
        rows[std::min<int64_t>(kMaxRows, a.M - m0) - 1](call, t0, count, m0, scales.data());
      }
    }
  });
}

}  // namespace tgq_cpu
