// linear over grouped 4-bit weights (GPTQ, AWQ, compressed-tensors int4) on CPUs with
// AVX512_BF16: out = bf16(sum over k of x * (q - zero) * scale + bias), q in 0..15, one zero and
// one scale per column and group of group_size input columns.
//
// A nibble q placed in mantissa bits 3-6 of bf16 16.0 (0x4180) is the bf16 value 16 + q exactly:
// one shift and one vpternlogd turn a packed block into a 32-value line, with no table lookup and
// no byte interleave. So each group's sums are of x * (16 + q), made with vdpbf16ps as the bf16
// kernel makes its sums (each product exact, one chain per output in K order), and at the group's
// end folded into the output's fp32 total with sx, the row's sum of x over the group (made once
// per call, before the weights stream):
//   total += scale * acc - ((zero + 16) * scale) * sx
// The offset makes the summed terms at most 31 |x| where q alone would be 15 |x|: about twice the
// fp32 rounding of the sums (still far below bf16's), for 2 instructions a line.
//
// A quarter of the bf16 weights' bytes crosses the memory bus (plus the [N, G] zeros and scales:
// an eighth more at group 128). The forms are the 8-bit kernel's: at 1-16 rows one pass over the
// weights, 1-8 tiles side by side so that enough independent sums are in flight; past 16 rows
// each tile, its weights in L1/L2, against group after group of 16 rows.
#include "linear_kernels.h"

#include <array>
#include <utility>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include "linear_avx512_tiles.h"

namespace tgq_cpu {
namespace {

constexpr int kLinesPerBlock = 4;
static_assert(kInt4BlockBytes * 2 == kLinesPerBlock * kLine);  // 128 nibbles, 4 lines
static_assert(kInt4BlockValues == 2 * kLinesPerBlock);

// The value the nibble 0 decodes to.
constexpr float kOffset = 16.0f;

// One packed block (128 weights) -> its four bf16 lines (pairs 4j..4j+3 of the tile) of 16 + q.
struct NibbleToBf16 {
  __m512i mantissa, sixteen;

  NibbleToBf16() : mantissa(_mm512_set1_epi16(0x0078)), sixteen(_mm512_set1_epi16(0x4180)) {}

  // Bits 3-6 of t, into 16.0's mantissa: (t & mantissa) | sixteen.
  __m512i with_mantissa(__m512i t) const {
    return _mm512_ternarylogic_epi32(t, mantissa, sixteen, 0xEA);
  }

  void lines(const uint8_t* block, __m512i (&line)[kLinesPerBlock]) const {
    const __m512i v = _mm512_loadu_si512(block);  // nibble l of each word: line l
    line[0] = with_mantissa(_mm512_slli_epi16(v, 3));
    line[1] = with_mantissa(_mm512_srli_epi16(v, 1));
    line[2] = with_mantissa(_mm512_srli_epi16(v, 5));
    line[3] = with_mantissa(_mm512_srli_epi16(v, 9));
  }
};

// The 4-bit stream is prefetched into L2 this far ahead (the 8-bit kernel's distance).
constexpr int64_t kPrefetchBytes = 4096;

// Per tile and group, the 16 columns' scale and (zero + 16) * scale: [G][2][16] floats.
constexpr int64_t kScaleFloats = 2 * kLanes;

// One tile's columns of the [N, G] scales and zeros, transposed 16 groups at a time (columns past
// N read as zeros: their lanes are never stored).
void tile_scales(const Int4Linear& a, int64_t tile, float* dst) {
  const int64_t n0 = tile * kLanes, columns = std::min<int64_t>(kLanes, a.N - n0);
  for (int64_t g0 = 0; g0 < a.groups; g0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, a.groups - g0);
    const auto mask = static_cast<__mmask16>((1u << count) - 1);
    __m512 s[kLanes], z[kLanes];  // s[i]: column n0 + i's scales of groups g0..
    for (int i = 0; i < kLanes; ++i) {
      const int64_t at = (n0 + i) * a.groups + g0;
      s[i] = i < columns ? _mm512_maskz_loadu_ps(mask, a.scale + at) : _mm512_setzero_ps();
      z[i] = i < columns ? _mm512_maskz_loadu_ps(mask, a.zero + at) : _mm512_setzero_ps();
    }
    transpose16(s);  // s[j]: group g0 + j's scales of the 16 columns
    transpose16(z);
    for (int64_t j = 0; j < count; ++j) {
      float* out = dst + (g0 + j) * kScaleFloats;
      _mm512_storeu_ps(out, s[j]);
      _mm512_storeu_ps(out + kLanes, _mm512_mul_ps(_mm512_add_ps(z[j], _mm512_set1_ps(kOffset)),
                                                   s[j]));
    }
  }
}

// sx[m, g]: row m's sum of x over group g in fp32, 8 values at a time (a block never straddles
// two groups); the same order for every row, whatever M.
std::vector<float> group_sums(const Int4Linear& a) {
  const int64_t blocks = a.x_stride / kInt4BlockValues;
  const int64_t per_group = ceil_div(a.group_size, kInt4BlockValues);
  std::vector<float> sx(a.M * a.groups);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / a.x_stride);
  at::parallel_for(0, a.M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const bf16_bits* row = a.x + m * a.x_stride;
      for (int64_t g = 0; g < a.groups; ++g) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = g * per_group; j < std::min(blocks, (g + 1) * per_group); ++j) {
          sum = _mm256_add_ps(sum, load8(row + j * kInt4BlockValues));
        }
        sx[m * a.groups + g] = hsum(sum);
      }
    }
  });
  return sx;
}

// One tile's columns [n, n + 16) of an output row: total + bias, in fp32 or rounded to bf16;
// columns past N masked off.
struct Int4TileOut {
  const Int4Linear& a;
  int64_t n;
  __mmask16 lanes;
  __m512 bias;

  Int4TileOut(const Int4Linear& args, int64_t tile) : a(args), n(tile * kLanes) {
    lanes = static_cast<__mmask16>((1u << std::min<int64_t>(kLanes, a.N - n)) - 1);
    bias = a.bias != nullptr ? _mm512_maskz_loadu_ps(lanes, a.bias + n) : _mm512_setzero_ps();
  }

  void store(int64_t m, __m512 total) const {
    const __m512 v = _mm512_add_ps(total, bias);
    if (a.out_f32 != nullptr) {
      _mm512_mask_storeu_ps(a.out_f32 + m * a.N + n, lanes, v);
    } else {
      _mm256_mask_storeu_epi16(a.out + m * a.N + n, lanes, to_bf16_rne(v));
    }
  }
};

// Rows [m0, m0 + MT) of x against tiles [t0, t0 + TT), decoding as the blocks stream; scales:
// the TT tiles' tile_scales, one after the other. Only the group's sums live in registers: the
// running totals, touched once a group, stay in memory (L1), leaving the registers to the sums,
// the decoded lines and the broadcast x pairs.
template <int MT, int TT>
void int4_few_rows(const Int4Linear& a, int64_t t0, int64_t m0, const float* scales,
                   const float* sx) {
  const int64_t blocks = a.x_stride / kInt4BlockValues, tile_bytes = blocks * kInt4BlockBytes;
  const int64_t per_group = ceil_div(a.group_size, kInt4BlockValues);
  const bf16_bits* x = a.x + m0 * a.x_stride;
  const NibbleToBf16 to_bf16;
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
        __m512i line[kLinesPerBlock];
        to_bf16.lines(block, line);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) {
          const bf16_bits* pairs = x + m * a.x_stride + j * kInt4BlockValues;
#pragma GCC unroll 4
          for (int l = 0; l < kLinesPerBlock; ++l) {
            acc[tt][m] = _mm512_dpbf16_ps(acc[tt][m], broadcast_pair(pairs + 2 * l),
                                          (__m512bh)line[l]);
          }
        }
      }
    }
    for (int tt = 0; tt < TT; ++tt) {
      const float* s = scales + (tt * a.groups + g) * kScaleFloats;
      const __m512 scale = _mm512_loadu_ps(s), zero_scale = _mm512_loadu_ps(s + kLanes);
      for (int m = 0; m < MT; ++m) {
        const __m512 row_sum = _mm512_set1_ps(sx[(m0 + m) * a.groups + g]);
        const __m512 sum = _mm512_fmadd_ps(scale, acc[tt][m], _mm512_load_ps(total[tt][m]));
        _mm512_store_ps(total[tt][m], _mm512_fnmadd_ps(zero_scale, row_sum, sum));
      }
    }
  }
  for (int tt = 0; tt < TT; ++tt) {
    const Int4TileOut out(a, t0 + tt);
    for (int m = 0; m < MT; ++m) out.store(m0 + m, _mm512_load_ps(total[tt][m]));
  }
}

using Int4FewRowsFn = void (*)(const Int4Linear&, int64_t, int64_t, const float*, const float*);

// Rows per call of int4_few_rows: up to 16 sums (a register each) in flight.
constexpr int64_t kMaxRows = 16;

// For MT rows, tiles side by side, so that 8 or more sums are in flight: each takes a block's 4
// lines one after the other, i.e. waits 4 vdpbf16ps latencies a block (twice the 8-bit kernel's
// wait per byte), which few sums would not hide. 8 tiles at 1 row, 4 at 2, 2 at 3-8, 1 from 9.
template <int MT>
constexpr int kSideBySide = MT == 1 ? 8 : MT == 2 ? 4 : MT <= 8 ? 2 : 1;

template <std::size_t... I>
constexpr auto few_rows_table(std::index_sequence<I...>) {
  return std::array<Int4FewRowsFn, sizeof...(I)>{int4_few_rows<I + 1, 1>...};
}
constexpr auto kOneTile = few_rows_table(std::make_index_sequence<kMaxRows>());

// M <= kMaxRows: one pass over the weights, kSideBySide<MT> tiles at a time.
template <int MT>
void few_rows_pass(const Int4Linear& a, const float* sx) {
  constexpr int TT = kSideBySide<MT>;
  const int64_t tiles = ceil_div(a.N, kLanes), sets = ceil_div(tiles, TT);
  at::parallel_for(0, sets, 1, [&](int64_t set0, int64_t set1) {
    std::vector<float> scales(TT * a.groups * kScaleFloats);
    for (int64_t set = set0; set < set1; ++set) {
      const int64_t t = set * TT;
      if (t + TT <= tiles) {
        for (int tt = 0; tt < TT; ++tt) {
          tile_scales(a, t + tt, scales.data() + tt * a.groups * kScaleFloats);
        }
        int4_few_rows<MT, TT>(a, t, 0, scales.data(), sx);
      } else {
        for (int64_t u = t; u < tiles; ++u) {
          tile_scales(a, u, scales.data());
          int4_few_rows<MT, 1>(a, u, 0, scales.data(), sx);
        }
      }
    }
  });
}

template <std::size_t... I>
constexpr auto pass_table(std::index_sequence<I...>) {
  using PassFn = void (*)(const Int4Linear&, const float*);
  return std::array<PassFn, sizeof...(I)>{few_rows_pass<I + 1>...};
}
constexpr auto kPasses = pass_table(std::make_index_sequence<kMaxRows>());

}  // namespace

void linear_int4_packed_avx512(const Int4Linear& a) {
  const std::vector<float> sx = group_sums(a);
  if (a.M <= kMaxRows) {
    kPasses[a.M - 1](a, sx.data());
    return;
  }
  // Each tile, its weights in L1/L2, against every group of 16 rows (the blocks are decoded
  // again for each group: 8 instructions beside each group's 64 vdpbf16ps).
  const int64_t tiles = ceil_div(a.N, kLanes);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (a.M * a.x_stride * kLanes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scales(a.groups * kScaleFloats);
    for (int64_t t = t0; t < t1; ++t) {
      tile_scales(a, t, scales.data());
      for (int64_t m = 0; m < a.M; m += kMaxRows) {
        kOneTile[std::min(kMaxRows, a.M - m) - 1](a, t, m, scales.data(), sx.data());
      }
    }
  });
}

}  // namespace tgq_cpu
