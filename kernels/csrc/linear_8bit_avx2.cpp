// linear over 8-bit weights with one fp32 scale per output column (`--quantize int8|fp8`,
// checkpoints) on AVX2/FMA CPUs: out = bf16((x @ w^T) * scale + bias), x in bf16, w int8 or FP8
// E4M3, over the AVX2 layout (pack_weight_8bit(..., "avx2"), linear_kernels.h): per tile of 16
// columns and block of 4 K values, each K value's 16 column bytes in column order.
//
// Decoding, per 8 weights: int8 is vpmovsxbd + vcvtdq2ps (exact). An E4M3 byte s.eeee.mmm is the
// fp16 s.0eeee.mmm0000000 divided by 2^8 (fp16's exponent bias is 8 more than E4M3's, and its
// subnormals cover E4M3's at the same ratio): the byte goes to the high byte of a 16-bit word
// (vpunpck{l,h}bw with zeros, 16 at a time), one arithmetic shift right puts the exponent and
// mantissa in place while the sign stays at bit 15 (one and clears its copy at bit 14), and
// vcvtph2ps widens 8 at a time. The 2^8 goes into the column's scale, which stays exact.
//
// Sums: per row and column, x * w in K order, one FMA each (every product of a bf16 and an 8-bit
// value is exact in fp32), then fma(sum, scale, bias) (or sum * scale), rounded to bf16. A row's sums never
// depend on the other rows: the same chains whichever rows and tiles are processed side by side.
#include "linear_kernels.h"

#include <array>

// vcvtph2ps (F16C: every AVX2 CPU has it; linear_8bit.cpp checks before an E4M3 call).
#pragma GCC target("f16c")

namespace tgq_cpu {
namespace {

constexpr int64_t kKPerBlock = kAvx2ByteBlockValues;  // K values per 64-byte block
constexpr int64_t kPairBytes = 32;                     // two K values x 16 columns
static_assert(kAvx2ByteBlockBytes == 2 * kPairBytes && kPackColumns == 2 * kVec);

// Two K values' 16 columns -> w[0..1]: the first K value's columns 0-7, 8-15; w[2..3]: the
// second's.
struct Int8ToF32 {
  static constexpr float kScale = 1.0f;
  void pair(const uint8_t* bytes, __m256 (&w)[4]) const {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i * kVec));
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
  }
};

struct E4m3ToF32 {
  static constexpr float kScale = 256.0f;  // the values come out divided by 2^8
  __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));

  void pair(const uint8_t* bytes, __m256 (&w)[4]) const {
    // 128-bit lane 0: the first K value's 16 columns, lane 1: the second's.
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m256i zero = _mm256_setzero_si256();
    const __m256i low = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, v), 1), keep);
    const __m256i high =
        _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, v), 1), keep);
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(low));
    w[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(high));
    w[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(low, 1));
    w[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(high, 1));
  }
};

// The call's inputs as the kernel reads them: x widened to fp32.
struct ByteCall {
  const PackedLinear& a;
  const uint8_t* q;
  const float* x;  // [M, x_stride] fp32
};

// The 8-bit stream is prefetched into L2 this far ahead.
constexpr int64_t kPrefetchBytes = 4096;

// Row m's 16 columns of tile `tile`: sums * scale (* the decoding's factor) + bias, in fp32 or
// rounded to bf16; columns past N are not stored.
template <class Decode>
void store_tile_row(const PackedLinear& a, int64_t tile, int64_t m, const __m256 (&sums)[2]) {
  for (int h = 0; h < 2; ++h) {
    const int64_t n = tile * kPackColumns + h * kVec, count = std::min<int64_t>(kVec, a.N - n);
    if (count <= 0) return;
    alignas(32) float v[kVec];
    _mm256_store_ps(v, sums[h]);
    for (int64_t i = 0; i < count; ++i) {  // one rounding with the bias: an FMA
      const float scale = a.scale[n + i] * Decode::kScale;
      v[i] = a.bias != nullptr ? std::fma(v[i], scale, a.bias[n + i]) : v[i] * scale;
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

// Rows [m0, m0 + MT) against tiles [t0, t0 + TT): 2 * MT * TT sums in registers.
template <class Decode, int MT, int TT>
void byte_rows(const ByteCall& call, int64_t t0, int64_t m0) {
  const PackedLinear& a = call.a;
  const int64_t blocks = a.x_stride / kKPerBlock, tile_bytes = blocks * kAvx2ByteBlockBytes;
  const float* x = call.x + m0 * a.x_stride;
  const Decode decode;
  __m256 acc[TT][MT][2];
  for (auto& tile : acc)
    for (auto& row : tile)
      for (auto& v : row) v = _mm256_setzero_ps();
  for (int64_t j = 0; j < blocks; ++j) {
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) {
      const uint8_t* block = call.q + (t0 + tt) * tile_bytes + j * kAvx2ByteBlockBytes;
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T1);
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
        __m256 w[4];
        decode.pair(block + p * kPairBytes, w);
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) {
#pragma GCC unroll 4
          for (int m = 0; m < MT; ++m) {
            const __m256 xk = _mm256_broadcast_ss(x + m * a.x_stride + j * kKPerBlock + 2 * p + k);
            acc[tt][m][0] = _mm256_fmadd_ps(xk, w[2 * k], acc[tt][m][0]);
            acc[tt][m][1] = _mm256_fmadd_ps(xk, w[2 * k + 1], acc[tt][m][1]);
          }
        }
      }
    }
  }
  for (int tt = 0; tt < TT; ++tt) {
    for (int m = 0; m < MT; ++m) store_tile_row<Decode>(a, t0 + tt, m0 + m, acc[tt][m]);
  }
}

// Rows per byte_rows call, and tiles side by side for MT rows: 8 sums in flight (FMA latency 4,
// two a cycle), 4 decoded vectors and a broadcast beside them in the 16 registers.
constexpr int kMaxRows = 4;
template <int MT>
constexpr int kSideBySide = MT == 1 ? 4 : MT == 2 ? 2 : 1;
// Tiles a thread takes at a time: their weights stay in L2 while every group of rows reads them.
constexpr int64_t kSetTiles = 4;

template <class Decode, int MT>
void rows_against_tiles(const ByteCall& call, int64_t t0, int64_t count, int64_t m0) {
  constexpr int TT = kSideBySide<MT>;
  int64_t u = 0;
  for (; u + TT <= count; u += TT) byte_rows<Decode, MT, TT>(call, t0 + u, m0);
  for (; u < count; ++u) byte_rows<Decode, MT, 1>(call, t0 + u, m0);
}

template <class Decode>
void linear_8bit(const ByteCall& call) {
  using RowsFn = void (*)(const ByteCall&, int64_t, int64_t, int64_t);
  constexpr std::array<RowsFn, kMaxRows> rows{
      rows_against_tiles<Decode, 1>, rows_against_tiles<Decode, 2>,
      rows_against_tiles<Decode, 3>, rows_against_tiles<Decode, 4>};
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

// x widened to fp32, row by row (zeros past K stay zeros).
std::vector<float> widen_rows(const PackedLinear& a) {
  std::vector<float> wide(a.M * a.x_stride);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / a.x_stride);
  at::parallel_for(0, a.M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const bf16_bits* row = a.x + m * a.x_stride;
      float* out = wide.data() + m * a.x_stride;
      int64_t k = 0;
      for (; k + kVec <= a.x_stride; k += kVec) _mm256_storeu_ps(out + k, load8(row + k));
      for (; k < a.x_stride; ++k) out[k] = to_f32(row[k]);
    }
  });
  return wide;
}

}  // namespace

void linear_8bit_packed_avx2(const PackedLinear& args, const uint8_t* codes, bool fp8,
                             bool wide) {
  const std::vector<float> x32 = widen_rows(args);
  if (wide) {
    linear_8bit_packed_avx512f(args, x32.data(), codes, fp8);
    return;
  }
  const ByteCall call{args, codes, x32.data()};
  if (fp8) {
    linear_8bit<E4m3ToF32>(call);
  } else {
    linear_8bit<Int8ToF32>(call);
  }
}

}  // namespace tgq_cpu
