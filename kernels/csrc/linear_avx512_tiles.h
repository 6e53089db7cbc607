// The AVX-512 bf16 linear kernel's output tiles and constants, shared by the kernels over packed
// bf16 weights (linear_avx512_bf16.cpp) and over packed 8-bit weights (linear_8bit_avx512.cpp).
// Include it after the file's `#pragma GCC target(... avx512bf16 ...)`.
#pragma once
#include "avx512_common.h"
#include "linear_kernels.h"

namespace tgq_cpu {

constexpr int kLanes = 16;  // fp32 lanes of a __m512; also kPackColumns and the rows of an x line
static_assert(kPackColumns == kLanes);
constexpr int64_t kLine = kLineValues;  // bf16 values in a packed line: 16 pairs

// The weight stream is prefetched into L2 this far ahead: the hardware prefetcher alone leaves the
// loops waiting on DRAM (a decode step's weights do not fit in any cache). A hint never faults, so
// running past the end of the weights is harmless.
constexpr int64_t kPrefetchValues = 4096 / sizeof(bf16_bits);

// Work below this many multiply-adds stays on one thread.
constexpr int64_t kMinWorkPerTask = 1 << 16;

inline void prefetch_l2(const bf16_bits* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// One tile's columns [n, n + 16) of the output row m: sums (times the columns' scales, 8-bit
// weights) + bias, rounded to bf16 (and widened back for out_f32, i.e. linear(...).float());
// columns past N are masked off.
struct TileOut {
  const PackedLinear& a;
  int64_t n;
  __mmask16 lanes;
  __m512 bias, scale;

  TileOut(const PackedLinear& args, int64_t tile) : a(args), n(tile * kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, a.N - n);
    lanes = static_cast<__mmask16>((1u << count) - 1);
    bias = a.bias != nullptr ? _mm512_maskz_loadu_ps(lanes, a.bias + n) : _mm512_setzero_ps();
    scale = a.scale != nullptr ? _mm512_maskz_loadu_ps(lanes, a.scale + n) : _mm512_set1_ps(1.0f);
  }

  void store(int64_t m, __m512 sums) const {
    const __m256i out = to_bf16_rne(_mm512_add_ps(_mm512_mul_ps(sums, scale), bias));
    const int64_t at = m * a.N + n;
    if (a.out_f32 != nullptr) {
      const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(out), 16));
      _mm512_mask_storeu_ps(a.out_f32 + at, lanes, wide);
    } else {
      _mm256_mask_storeu_epi16(a.out + at, lanes, out);
    }
  }
};

}  // namespace tgq_cpu
