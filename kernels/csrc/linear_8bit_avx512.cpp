// linear over 8-bit weights with one fp32 scale per output column (`--quantize int8|fp8`), on CPUs
// with AVX512_BF16 and AVX512_VBMI: out = bf16((x @ w^T) * scale + bias), x in bf16, w int8
// (symmetric) or FP8 E4M3.
//
// Every int8 weight (|q| <= 128) and every E4M3 weight (3 mantissa bits, exponents
// 2^-9..2^8) is exactly a bf16 value, so the kernel turns each packed block of weights into the
// bf16 lines of pack_weight_bf16's layout in registers and multiplies them with vdpbf16ps as the
// bf16 kernel does: each product exact, each column's sum the same chain in K order for every
// batch size. Half the bytes of bf16 weights cross the memory bus, at the price of the
// conversion: the 7-bit magnitude code looked up in two 128-entry byte tables (the low and high
// bytes of its bf16 value, vpermt2b; one pair of tables per format), the sign put back into the
// high byte, and the two bytes interleaved (vpunpck{l,h}bw), 6 instructions per 64 weights.
// The blocks are converted as they stream and each converted line multiplies up to 16 rows of
// x (lanes = the tile's 16 columns, as the bf16 kernel's few-rows form): at 1-4 rows 2-4 tiles go
// side by side so that enough independent sums are in flight; past 16 rows each tile runs group
// after group of 16 rows while its weights stay in L1/L2.
#include "linear_kernels.h"

#include <array>
#include <utility>

namespace tgq_cpu {

// Before the target pragma: this runs on every CPU.
bool cpu_has_avx512_8bit_linear() {
  static const bool supported = cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512vbmi");
  return supported;
}

}  // namespace tgq_cpu

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi")
#include "e4m3_avx512.h"
#include "linear_avx512_tiles.h"

namespace tgq_cpu {
namespace {

static_assert(kByteBlockBytes == 2 * kLine);

// The bf16 lines of a packed block: the format's byte tables (e4m3_avx512.h), and int8's -128.
struct ByteToBf16 {
  Bf16ByteTables tables;
  __m512i sign, minus128_high;
  bool has_minus128;  // the byte 0x80 is -128 (bf16 0xC300), not -0

  explicit ByteToBf16(ByteCode code)
      : tables([code](int c) {
          return code == ByteCode::kFp8E4M3 ? e4m3_magnitude(c) : static_cast<float>(c);
        }),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))),
        minus128_high(_mm512_set1_epi8(static_cast<char>(0xC3))),
        has_minus128(code == ByteCode::kInt8Minus128) {}

  // One packed block (64 weights) -> its two bf16 lines (pairs 2j and 2j + 1 of the tile).
  void lines(const uint8_t* block, __m512i& first, __m512i& second) const {
    const __m512i q = _mm512_loadu_si512(block);
    __m512i low, high;
    tables.bytes(q, low, high);
    if (has_minus128) {  // the low byte of bf16(-128) is table[0]'s, 0
      high = _mm512_mask_mov_epi8(high, _mm512_cmpeq_epi8_mask(q, sign), minus128_high);
    }
    first = _mm512_unpacklo_epi8(low, high);
    second = _mm512_unpackhi_epi8(low, high);
  }
};

// The 8-bit stream is prefetched into L2 this far ahead (the bf16 kernel's distance in weights).
constexpr int64_t kPrefetchBytes = 4096;

// Rows [m0, m0 + MT) of x against tiles [t0, t0 + TT), converting as the blocks stream.
template <int MT, int TT>
void byte_few_rows(const PackedLinear& a, const uint8_t* q, int64_t t0, int64_t m0,
                   const ByteToBf16& to_bf16) {
  const int64_t pairs = a.x_stride / 2, tile_bytes = pairs / 2 * kByteBlockBytes;
  const bf16_bits* x = a.x + m0 * a.x_stride;
  __m512 acc[TT][MT];
  for (auto& tile : acc)
    for (auto& v : tile) v = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 2) {
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) {
      const uint8_t* block = q + (t0 + tt) * tile_bytes + p / 2 * kByteBlockBytes;
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T1);
      __m512i first, second;
      to_bf16.lines(block, first, second);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const bf16_bits* row = x + m * a.x_stride + 2 * p;
        acc[tt][m] = _mm512_dpbf16_ps(acc[tt][m], broadcast_pair(row), (__m512bh)first);
        acc[tt][m] = _mm512_dpbf16_ps(acc[tt][m], broadcast_pair(row + 2), (__m512bh)second);
      }
    }
  }
  for (int tt = 0; tt < TT; ++tt) {
    const TileOut out(a, t0 + tt);
    for (int m = 0; m < MT; ++m) out.store(m0 + m, acc[tt][m]);
  }
}

using ByteFewRowsFn = void (*)(const PackedLinear&, const uint8_t*, int64_t, int64_t,
                               const ByteToBf16&);

// Rows per call of byte_few_rows: up to 16 sums (a register each) in flight.
constexpr int64_t kMaxRows = 16;

// For MT rows, tiles side by side: 4 at 1-2 rows, 2 at 3-4, 1 from 5.
template <int MT>
constexpr int kSideBySide = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;

template <std::size_t... I>
constexpr auto few_rows_table(std::index_sequence<I...>) {
  return std::array<ByteFewRowsFn, sizeof...(I)>{byte_few_rows<I + 1, 1>...};
}
constexpr auto kOneTile = few_rows_table(std::make_index_sequence<kMaxRows>());

// M <= kMaxRows: one pass over the weights, kSideBySide<MT> tiles at a time.
template <int MT>
void few_rows_pass(const PackedLinear& a, const uint8_t* q, const ByteToBf16& to_bf16) {
  constexpr int TT = kSideBySide<MT>;
  const int64_t tiles = ceil_div(a.N, kLanes), groups = ceil_div(tiles, TT);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t = g * TT;
      if (t + TT <= tiles) {
        byte_few_rows<MT, TT>(a, q, t, 0, to_bf16);
      } else {
        for (int64_t u = t; u < tiles; ++u) byte_few_rows<MT, 1>(a, q, u, 0, to_bf16);
      }
    }
  });
}

template <std::size_t... I>
constexpr auto pass_table(std::index_sequence<I...>) {
  using PassFn = void (*)(const PackedLinear&, const uint8_t*, const ByteToBf16&);
  return std::array<PassFn, sizeof...(I)>{few_rows_pass<I + 1>...};
}
constexpr auto kPasses = pass_table(std::make_index_sequence<kMaxRows>());

}  // namespace

void linear_8bit_packed_avx512(const PackedLinear& a, const uint8_t* q, ByteCode code) {
  static const ByteToBf16 int8_table(ByteCode::kInt8), full_table(ByteCode::kInt8Minus128),
      fp8_table(ByteCode::kFp8E4M3);
  const ByteToBf16& to_bf16 = code == ByteCode::kInt8           ? int8_table
                              : code == ByteCode::kInt8Minus128 ? full_table
                                                                : fp8_table;
  if (a.M <= kMaxRows) {
    kPasses[a.M - 1](a, q, to_bf16);
    return;
  }
  // Each tile, its weights in L1/L2, against every group of 16 rows (the blocks are
  // converted again for each group: ~6 instructions beside each group's 32 vdpbf16ps).
  const int64_t tiles = ceil_div(a.N, kLanes);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (a.M * a.x_stride * kLanes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m = 0; m < a.M; m += kMaxRows) {
        kOneTile[std::min(kMaxRows, a.M - m) - 1](a, q, t, m, to_bf16);
      }
    }
  });
}

}  // namespace tgq_cpu
