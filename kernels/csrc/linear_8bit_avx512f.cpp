// linear_8bit_avx2.cpp's kernel at 16 lanes, for CPUs with AVX-512F (and BW, VL) whether or not
// they have AVX512_BF16 (Skylake-SP to Ice Lake servers): the same layout, each tile's 16 columns
// one vector, and the same sums bit for bit (each lane is one column's FMA chain in K order, then
// fma(sum, scale, bias)). Twice the lanes per FMA and twice the registers: at decode's few rows
// the weights stream at the memory's rate with less work beside them, at 16 rows and more the
// FMAs run at up to twice the AVX2 kernel's rate.
#include "linear_kernels.h"

#include <array>
#include <utility>

namespace tgq_cpu {

// Before the target pragma: this runs on every CPU.
bool cpu_has_avx512f_kernels() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
  return supported;
}

}  // namespace tgq_cpu

#pragma GCC target("avx512f,avx512bw,avx512vl,f16c")

namespace tgq_cpu {
namespace {

constexpr int64_t kKPerBlock = kAvx2ByteBlockValues;  // K values per 64-byte block
constexpr int kLanes = 16;
static_assert(kPackColumns == kLanes);

// One K value's 16 column bytes -> 16 fp32 lanes.
struct Int8ToF32x16 {
  static constexpr float kScale = 1.0f;
  __m512 operator()(const uint8_t* bytes) const {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  }
};

// The E4M3 byte as the high byte of an fp16 word, shifted right once (sign kept, its copy at
// bit 14 cleared): the fp16 of value / 2^8, widened exactly.
struct E4m3ToF32x16 {
  static constexpr float kScale = 256.0f;
  __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
  __m512 operator()(const uint8_t* bytes) const {
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(wide, 8), 1), keep);
    return _mm512_cvtph_ps(half);
  }
};

struct ByteCall {
  const PackedLinear& a;
  const uint8_t* q;
  const float* x;  // [M, x_stride] fp32
};

constexpr int64_t kPrefetchBytes = 4096;

template <class Decode>
void store_tile_row(const PackedLinear& a, int64_t tile, int64_t m, __m512 sums) {
  const int64_t n = tile * kPackColumns, count = std::min<int64_t>(kLanes, a.N - n);
  alignas(64) float v[kLanes];
  _mm512_store_ps(v, sums);
  for (int64_t i = 0; i < count; ++i) {  // as linear_8bit_avx2.cpp: an FMA with the bias
    const float scale = a.scale[n + i] * Decode::kScale;
    v[i] = a.bias != nullptr ? std::fma(v[i], scale, a.bias[n + i]) : v[i] * scale;
  }
  if (a.out_f32 != nullptr) {
    std::copy(v, v + count, a.out_f32 + m * a.N + n);
  } else {
    for (int64_t i = 0; i < count; ++i) store_out(a.out + m * a.N + n + i, v[i]);
  }
}

// Rows [m0, m0 + MT) against tiles [t0, t0 + TT): MT * TT sums in registers.
template <class Decode, int MT, int TT>
void byte_rows(const ByteCall& call, int64_t t0, int64_t m0) {
  const PackedLinear& a = call.a;
  const int64_t blocks = a.x_stride / kKPerBlock, tile_bytes = blocks * kAvx2ByteBlockBytes;
  const float* x = call.x + m0 * a.x_stride;
  const Decode decode;
  __m512 acc[TT][MT];
  for (auto& tile : acc)
    for (auto& v : tile) v = _mm512_setzero_ps();
  for (int64_t j = 0; j < blocks; ++j) {
#pragma GCC unroll 8
    for (int tt = 0; tt < TT; ++tt) {
      const uint8_t* block = call.q + (t0 + tt) * tile_bytes + j * kAvx2ByteBlockBytes;
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T1);
#pragma GCC unroll 4
      for (int k = 0; k < kKPerBlock; ++k) {
        const __m512 w = decode(block + k * kPackColumns);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m512 xk = _mm512_set1_ps(x[m * a.x_stride + j * kKPerBlock + k]);
          acc[tt][m] = _mm512_fmadd_ps(xk, w, acc[tt][m]);
        }
      }
    }
  }
  for (int tt = 0; tt < TT; ++tt) {
    for (int m = 0; m < MT; ++m) store_tile_row<Decode>(a, t0 + tt, m0 + m, acc[tt][m]);
  }
}

// Rows per byte_rows call, and tiles side by side: 8 sums in flight at 1, 2, 4 and 8 rows (FMA
// latency 4, two a cycle). (The loops over them unroll fully, so the sums stay in registers.)
constexpr int kMaxRows = 8;
template <int MT>
constexpr int kSideBySide = MT == 1 ? 8 : MT == 2 ? 4 : MT <= 4 ? 2 : 1;
constexpr int64_t kSetTiles = 8;

template <class Decode, int MT>
void rows_against_tiles(const ByteCall& call, int64_t t0, int64_t count, int64_t m0) {
  constexpr int TT = kSideBySide<MT>;
  int64_t u = 0;
  for (; u + TT <= count; u += TT) byte_rows<Decode, MT, TT>(call, t0 + u, m0);
  for (; u < count; ++u) byte_rows<Decode, MT, 1>(call, t0 + u, m0);
}

template <class Decode, size_t... I>
constexpr auto rows_table(std::index_sequence<I...>) {
  using RowsFn = void (*)(const ByteCall&, int64_t, int64_t, int64_t);
  return std::array<RowsFn, sizeof...(I)>{rows_against_tiles<Decode, I + 1>...};
}

template <class Decode>
void linear_8bit(const ByteCall& call) {
  constexpr auto rows = rows_table<Decode>(std::make_index_sequence<kMaxRows>{});
  const PackedLinear& a = call.a;
  const int64_t tiles = ceil_div(a.N, kPackColumns), sets = ceil_div(tiles, kSetTiles);
  at::parallel_for(0, sets, 1, [&](int64_t set0, int64_t set1) {
    for (int64_t set = set0; set < set1; ++set) {
      const int64_t t0 = set * kSetTiles, count = std::min(kSetTiles, tiles - t0);
      for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
        rows[std::min<int64_t>(kMaxRows, a.M - m0) - 1](call, t0, count, m0);
      }
    }
  });
}

}  // namespace

void linear_8bit_packed_avx512f(const PackedLinear& args, const float* x32, const uint8_t* codes,
                                bool fp8) {
  const ByteCall call{args, codes, x32};
  if (fp8) {
    linear_8bit<E4m3ToF32x16>(call);
  } else {
    linear_8bit<Int8ToF32x16>(call);
  }
}

}  // namespace tgq_cpu
