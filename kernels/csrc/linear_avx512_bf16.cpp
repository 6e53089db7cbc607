// linear_bf16 on CPUs with AVX512_BF16, over weights packed once at load: y[M,N] = x[M,K] @ w^T + b,
// x and w in bf16, each product exact and the sums in fp32 (vdpbf16ps). Only this file is compiled
// for that ISA (the target pragma below); linear_bf16.cpp calls it after checking the CPU.
//
// The packed layout (pack_weight_bf16, linear_kernels.h) stores the weights as tiles of 16 output
// columns: for each pair of K values, the 16 columns' two values side by side, one 64-byte line.
// Two register forms use it, neither needing a horizontal sum:
//  - few rows of x (M <= 8): 16 lanes = the tile's 16 columns. Each step loads one line of weights
//    and multiplies it by each row's pair of x values, broadcast. The weights stream through once,
//    in address order.
//  - 9 to 16 rows: 16 lanes = 16 rows of x, x packed the same way (one line per pair: the 16 rows'
//    two values). Each step loads one line of x and multiplies it by each column's weight pair,
//    broadcast: 16 accumulators, one per column, transposed once at the end of the tile.
// A decode step of the medium model at M = 16 spends ~0.77x the time of the earlier kernel over
// the plain [N, K] layout, which needed a horizontal sum per output and reloaded every row of x for
// each 3 weight rows (measured in turns on a Zen 4 EPYC, weights from DRAM); at M = 1-8 0.96-1.0x.
#include "linear_kernels.h"

#include "fused_kernels.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace tgq_cpu {

// Before the target pragma: this runs on every CPU.
bool cpu_has_avx512_bf16() {
  static const bool supported =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return supported;
}

namespace {

// AMX-TILE (CPUID leaf 7: EDX bit 24) and the data type's bit (AMX-BF16: 22, AMX-INT8: 25), on
// an AVX512_BF16 CPU, and the kernels' permission for this process to use the tile registers
// (Linux asks for it once per process, with arch_prctl; asking again is harmless).
bool cpu_has_amx(int type_bit) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!cpu_has_avx512_bf16() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (((edx >> 24) & 1) == 0 || ((edx >> type_bit) & 1) == 0) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool cpu_has_amx_bf16() {
  static const bool supported = cpu_has_amx(22);
  return supported;
}

bool cpu_has_amx_int8() {
  static const bool supported = cpu_has_amx(25);
  return supported;
}

}  // namespace tgq_cpu

// Everything below may use AVX-512 and runs only where cpu_has_avx512_bf16().
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include "linear_avx512_tiles.h"

namespace tgq_cpu {
namespace {

// Rows [m0, m0 + MT) of x against one weight tile, 16 lanes = the tile's columns. One chain per
// output, in K order, as in tile_16_rows: every output's sum is the same whichever form and batch
// it runs in, so a request's tokens do not depend on what else is in the step. (Splitting the
// chains along K, for more FMAs in flight at M = 1, measured no faster: the step waits on DRAM.)
template <int MT>
void tile_few_rows(const PackedLinear& a, const bf16_bits* tile, int64_t m0, const TileOut& out) {
  const int64_t pairs = a.x_stride / 2;
  const bf16_bits* x = a.x + m0 * a.x_stride;
  __m512 acc[MT];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16_bits* line = tile + p * kLine;
    prefetch_l2(line + kPrefetchValues);
    const __m512bh w = load_pairs(line);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm512_dpbf16_ps(acc[m], broadcast_pair(x + m * a.x_stride + 2 * p), w);
    }
  }
  for (int m = 0; m < MT; ++m) out.store(m0 + m, acc[m]);
}

using FewRowsFn = void (*)(const PackedLinear&, const bf16_bits*, int64_t, const TileOut&);

FewRowsFn few_rows_for(int64_t mt) {
  switch (mt) {
    case 1: return tile_few_rows<1>;
    case 2: return tile_few_rows<2>;
    case 3: return tile_few_rows<3>;
    case 4: return tile_few_rows<4>;
    case 5: return tile_few_rows<5>;
    case 6: return tile_few_rows<6>;
    case 7: return tile_few_rows<7>;
    default: return tile_few_rows<8>;
  }
}

// One group of 16 rows of x, packed ([pairs][16 rows][2]), against one weight tile: 16 lanes =
// the rows, one accumulator per column; rows [m0, m0 + rows) of the output are stored.
void tile_16_rows(const bf16_bits* xg, const bf16_bits* tile, int64_t pairs, int64_t m0, int rows,
                  const TileOut& out) {
  __m512 acc[kLanes];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16_bits* line = tile + p * kLine;
    prefetch_l2(line + kPrefetchValues);
    const __m512bh xv = load_pairs(xg + p * kLine);
#pragma GCC unroll 16
    for (int c = 0; c < kLanes; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], xv, broadcast_pair(line + 2 * c));
  }
  transpose16(acc);  // acc[r]: row m0 + r, the tile's 16 columns
  for (int r = 0; r < rows; ++r) out.store(m0 + r, acc[r]);
}

// x rows [m0, m0 + rows) (rows <= 16; the rest of the group zeros) as one packed group.
void pack_x_group(const PackedLinear& a, int64_t m0, int rows, bf16_bits* xg) {
  const int64_t pairs = a.x_stride / 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += kLanes) {
    const int count = static_cast<int>(std::min<int64_t>(kLanes, pairs - p0));
    const auto mask = static_cast<__mmask16>((1u << count) - 1);
    __m512 r[kLanes];  // r[i]: the pairs p0.. of row m0 + i, as 32-bit lanes
    for (int i = 0; i < kLanes; ++i) {
      r[i] = i < rows ? _mm512_maskz_loadu_ps(mask, a.x + (m0 + i) * a.x_stride + 2 * p0)
                      : _mm512_setzero_ps();
    }
    transpose16(r);  // r[j]: pair p0 + j of the 16 rows
    for (int j = 0; j < count; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(xg + (p0 + j) * kLine), r[j]);
  }
}

// Rows of x per pass over the weights: a pass's packed x (the groups of 16 rows every tile re-reads)
// stays within ~half of a 1 MiB L2.
constexpr int64_t kPassBytes = 512 * 1024;

void linear_pass(const PackedLinear& a, int64_t m_begin, int64_t m_end,
                 const std::vector<bf16_bits>& xs, int64_t dense_rows) {
  const int64_t pairs = a.x_stride / 2;
  const int64_t tiles = (a.N + kLanes - 1) / kLanes;
  const int64_t rows = m_end - m_begin;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (rows * a.x_stride * kLanes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bf16_bits* tile = a.w + t * pairs * kLine;
      const TileOut out(a, t);
      for (int64_t m = m_begin; m < m_begin + dense_rows; m += kLanes) {
        const int group_rows = static_cast<int>(std::min<int64_t>(kLanes, m_end - m));
        tile_16_rows(xs.data() + (m - m_begin) * pairs * 2, tile, pairs, m, group_rows, out);
      }
      for (int64_t m = m_begin + dense_rows; m < m_end; m += 8) {
        few_rows_for(std::min<int64_t>(8, m_end - m))(a, tile, m, out);
      }
    }
  });
}

}  // namespace

void linear_bf16_packed_avx512(const PackedLinear& a) {
  const int64_t pairs = a.x_stride / 2;
  const int64_t pass_rows =
      std::max<int64_t>(kLanes, kPassBytes / (pairs * kLine * sizeof(bf16_bits)) * kLanes);
  std::vector<bf16_bits> xs;
  for (int64_t m0 = 0; m0 < a.M; m0 += pass_rows) {
    const int64_t m1 = std::min(a.M, m0 + pass_rows);
    // Groups of 16 rows go through tile_16_rows (a last group of 9-15 rows padded with zeros);
    // up to 8 rows left over, or M <= 8, go through tile_few_rows on x as it is.
    const int64_t rows = m1 - m0, tail = rows % kLanes;
    const int64_t dense_rows = rows - (tail <= 8 ? tail : 0);
    const int64_t groups = (dense_rows + kLanes - 1) / kLanes;
    xs.resize(groups * pairs * kLine);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m = m0 + g * kLanes;
      pack_x_group(a, m, static_cast<int>(std::min<int64_t>(kLanes, m1 - m)), xs.data() + g * pairs * kLine);
    }
    linear_pass(a, m0, m1, xs, dense_rows);
  }
}

namespace {

// One unit of an experts pass: one packed tile of output columns of one expert's linear.
struct ExpertTile {
  int64_t expert, tile;
};

// Every (expert, tile) of one of the experts' linears over the rows grouped by expert (rows
// offsets[e]..offsets[e + 1] of x and out are expert e's), all in one parallel loop: each expert
// is only a few rows and a few hundred KiB of weights, so a loop per expert would spend more on
// the threads' start and join than on the weights.
void experts_pass(const bf16_bits* x, int64_t x_stride, const bf16_bits* packed, int64_t N,
                  const std::vector<int64_t>& offsets, bf16_bits* out) {
  const int64_t pairs = x_stride / 2, tiles = (N + kLanes - 1) / kLanes;
  const int64_t expert_values = tiles * pairs * kLine;
  std::vector<ExpertTile> units;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (int64_t t = 0; t < tiles; ++t) units.push_back({e, t});
  }
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t e = units[u].expert, row = offsets[e], rows = offsets[e + 1] - row;
      const PackedLinear a{x + row * x_stride, packed + e * expert_values, nullptr, rows, N,
                           x_stride, out + row * N, nullptr};
      const bf16_bits* tile = a.w + units[u].tile * pairs * kLine;
      const TileOut tile_out(a, units[u].tile);
      for (int64_t m = 0; m < rows; m += 8) {
        few_rows_for(std::min<int64_t>(8, rows - m))(a, tile, m, tile_out);
      }
    }
  });
}

// bf16 bits in each 32-bit lane -> fp32 (exact).
inline __m512 widen_bits(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }

}  // namespace

void moe_experts_bf16_avx512(const PackedExperts& p) {
  const int64_t picks = p.T * p.top_k, K = p.K, I = p.I;
  // Group the picks by expert, each group in (token, choice) order.
  std::vector<int64_t> offsets(p.E + 1, 0);
  for (int64_t i = 0; i < picks; ++i) ++offsets[p.experts[i] + 1];
  std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
  std::vector<int64_t> pick_row(picks);
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < picks; ++i) pick_row[i] = next[p.experts[i]]++;
  }
  std::vector<bf16_bits> xs(picks * K), gate_up(picks * 2 * I), hidden(picks * I), ys(picks * K);
  for (int64_t i = 0; i < picks; ++i) {
    std::memcpy(xs.data() + pick_row[i] * K, p.x + i / p.top_k * K, K * sizeof(bf16_bits));
  }
  experts_pass(xs.data(), K, p.gate_up, 2 * I, offsets, gate_up.data());
  at::parallel_for(0, picks, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16_bits* g = gate_up.data() + r * 2 * I;
      silu_mul_row_avx512(g, g + I, I, hidden.data() + r * I);
    }
  });
  experts_pass(hidden.data(), I, p.down, K, offsets, ys.data());
  // Each token's picks in expert order, as index_add_ over the grouped rows adds them.
  at::parallel_for(0, p.T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> order(p.top_k);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t* chosen = p.experts + t * p.top_k;
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return chosen[a] < chosen[b];
      });
      for (int64_t c = 0; c < K; c += kLanes) {
        const auto lanes = static_cast<__mmask16>((1u << std::min<int64_t>(kLanes, K - c)) - 1);
        __m512 sum = _mm512_setzero_ps();
        for (const int64_t j : order) {
          const bf16_bits* y = ys.data() + pick_row[t * p.top_k + j] * K + c;
          const __m512 v = widen_bits(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, y)));
          const __m512 scaled = widen_bits(
              bf16_bits_rne16(_mm512_mul_ps(v, _mm512_set1_ps(p.weights[t * p.top_k + j]))));
          sum = widen_bits(bf16_bits_rne16(_mm512_add_ps(sum, scaled)));
        }
        _mm256_mask_storeu_epi16(p.out + t * K + c, lanes, to_bf16_rne(sum));
      }
    }
  });
}

}  // namespace tgq_cpu

// ----------------------------------------------------------------------------------------------
// The same packed weights through AMX tiles (runs only where cpu_has_amx_bf16()). A packed tile's
// 16 pairs x 16 columns x 2 values are one 1 KiB B tile of TDPBF16PS as they lie (64-byte rows,
// one per pair of K), so the layout needs no change: A tiles are 16 rows of x x 32 values, C tiles
// 16 x 16 fp32. Each block of 32 rows x 32 columns keeps its four C tiles in the tile registers
// for all of K. Needs K % 32 == 0 (whole A tiles); rows past M read a zero-padded copy of x.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#include "amx_common.h"

namespace tgq_cpu {
namespace {

constexpr int kTileRows = kAmxTileRows;
constexpr int64_t kTilePairs = 16;  // pairs of K per A/B tile (64 bytes per row)
// Pairs of K per chunk: a block's two A tiles for a chunk take 2 * 128 * 64 B = 16 KiB of L1.
constexpr int64_t kChunkPairs = 128;
// Packed tiles per group of output columns: 16 tiles' weights take 16 * K * 32 B (768 KiB at
// K = 1,536) of L2.
constexpr int64_t kGroupTiles = 16;

// Tiles 0-3: C (row block r, column block c at 2 * r + c); 4-5: A (row blocks); 6-7: B.
// Rows [m, m + 16 * MB) of x (at x) against packed tiles [t, t + NB), pairs [p0, p1) of K: the
// sums go on from those in acc (fp32 rows of acc_stride values; C tile (r, c) at rows 16r..,
// columns 16c..), or from zero when `first`, and go back there.
template <int MB, int NB>
void amx_block(const PackedLinear& a, const bf16_bits* x, int64_t t, int64_t p0, int64_t p1,
               float* acc, int64_t acc_stride, bool first) {
  const int64_t pairs = a.x_stride / 2;
  const int64_t x_bytes = a.x_stride * static_cast<int64_t>(sizeof(bf16_bits));
  const bf16_bits* w = a.w + t * pairs * kLine;
  const int64_t stride = acc_stride * static_cast<int64_t>(sizeof(float));
  float* lower = acc + kTileRows * acc_stride;
  if (first) {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (MB > 1) _tile_zero(2);
    if constexpr (MB > 1 && NB > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, acc, stride);
    if constexpr (NB > 1) _tile_loadd(1, acc + kLanes, stride);
    if constexpr (MB > 1) _tile_loadd(2, lower, stride);
    if constexpr (MB > 1 && NB > 1) _tile_loadd(3, lower + kLanes, stride);
  }
  for (int64_t p = p0; p < p1; p += kTilePairs) {
    _tile_loadd(4, x + 2 * p, x_bytes);
    if constexpr (MB > 1) _tile_loadd(5, x + kTileRows * a.x_stride + 2 * p, x_bytes);
    _tile_loadd(6, w + p * kLine, 64);
    if constexpr (NB > 1) _tile_loadd(7, w + (pairs + p) * kLine, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MB > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, stride);
  if constexpr (NB > 1) _tile_stored(1, acc + kLanes, stride);
  if constexpr (MB > 1) _tile_stored(2, lower, stride);
  if constexpr (MB > 1 && NB > 1) _tile_stored(3, lower + kLanes, stride);
}

using AmxBlockFn = void (*)(const PackedLinear&, const bf16_bits*, int64_t, int64_t, int64_t,
                            float*, int64_t, bool);

AmxBlockFn amx_block_for(int64_t rows, int64_t tiles) {
  if (rows > kTileRows) return tiles > 1 ? amx_block<2, 2> : amx_block<2, 1>;
  return tiles > 1 ? amx_block<1, 2> : amx_block<1, 1>;
}

}  // namespace

// The output columns are cut into one or more groups per thread, each at most kGroupTiles packed
// tiles wide (their weights stay in L2). For each group, each block of 32 rows, and each chunk of
// K (kChunkPairs: the block's A tiles for it stay in L1), the group's tiles two by two; the sums
// wait in `acc` between chunks, and each block of rows is stored once its sums are complete, row
// by row along the output (stores that went down a column block touched a page per row).
void linear_bf16_packed_amx(const PackedLinear& a) {
  const int64_t pairs = a.x_stride / 2;
  TORCH_CHECK(pairs % kTilePairs == 0, "linear_bf16_packed (amx): K must be a multiple of 32");
  // x with its rows padded to a multiple of 16 (zeros), so that every A tile lies in it.
  const int64_t padded_rows = (a.M + kTileRows - 1) / kTileRows * kTileRows;
  std::vector<bf16_bits> padded;
  const bf16_bits* x = a.x;
  if (padded_rows != a.M) {
    padded.assign(padded_rows * a.x_stride, 0);
    std::memcpy(padded.data(), a.x, a.M * a.x_stride * sizeof(bf16_bits));
    x = padded.data();
  }
  const int64_t tiles = (a.N + kLanes - 1) / kLanes;
  // Groups of whole pairs of tiles, as many per thread (their sizes differ by at most a pair):
  // groups of equal tiles could leave one thread a group more than the other (the medium
  // model's qkv, 144 tiles: 9 groups of 16, 5 against 4).
  const int64_t tile_pairs = (tiles + 1) / 2;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t groups = std::min(
      tile_pairs,
      threads * ((2 * tile_pairs + threads * kGroupTiles - 1) / (threads * kGroupTiles)));
  const int64_t group_tiles = 2 * ((tile_pairs + groups - 1) / groups);  // the largest
  constexpr int64_t kBlockRows = 2 * kTileRows;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    load_amx_tile_config();
    std::vector<float> acc_rows(static_cast<size_t>(kBlockRows * group_tiles * kLanes));
    float* acc = acc_rows.data();
    const int64_t acc_stride = group_tiles * kLanes;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = 2 * (g * tile_pairs / groups);
      const int64_t t1 = std::min(tiles, 2 * ((g + 1) * tile_pairs / groups));
      for (int64_t m = 0; m < a.M; m += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, a.M - m);
        for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
          const int64_t p1 = std::min(pairs, p0 + kChunkPairs);
          for (int64_t t = t0; t < t1; t += 2) {
            amx_block_for(rows, t1 - t)(a, x + m * a.x_stride, t, p0, p1,
                                        acc + (t - t0) * kLanes, acc_stride, p0 == 0);
          }
        }
        for (int64_t t = t0; t < t1; ++t) {
          const TileOut out(a, t);
          for (int64_t r = 0; r < rows; ++r) {
            out.store(m + r, _mm512_loadu_ps(acc + r * acc_stride + (t - t0) * kLanes));
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace tgq_cpu

#pragma GCC pop_options

