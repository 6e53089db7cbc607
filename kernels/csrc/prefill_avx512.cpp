// paged_prefill_attention's bf16 kernel for CPUs with AVX512_BF16: one sequence's prefill chunk
// against its paged K/V (cached prefix included), causal, optionally within a sliding window.
//
// Flash-style: per query head and tile of 16 queries, the keys go by in chunks of 16, with an
// online softmax. Both products are vdpbf16ps with 16 lanes = the tile's queries, so the softmax's
// max and sum over a chunk's keys are 15 plain vector ops, with no horizontal reduction:
//  - scores: the tile's queries are transposed once into lines of (query, pair of head values);
//    each key's pair of values is broadcast from the cache row itself;
//  - p * v: p rounded to bf16 (as torch's CPU flash attention and flash-attn do) in lines of
//    (query, pair of keys); the values of each pair of keys are interleaved once per call (`Vp`
//    below) so that one broadcast carries both.
// Chunks entirely above the diagonal, or before the window, are skipped. An fp8 cache reaches both
// kernels decoded to bf16 (paged_attention.cpp), its scales in `scale` and `v_scale`.
//
// Against the torch backend's gather + SDPA (2 threads, Zen 4, in turns): a 512-token prompt of
// 12 heads x 64 4.8x faster, 2,048 tokens 3.2x, 256 tokens after 768 cached 3.1x, 512 tokens of
// 32 query / 8 kv heads x 128 6.5x.
#include "attention_kernels.h"
#include "scratch.h"

#include <memory>
#include <vector>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include "avx512_common.h"

namespace tgq_cpu {
namespace {

constexpr int kLanes = 16;      // queries per tile, keys per chunk
constexpr int kMaxPairs = 128;  // head_dim / 2 for the largest head served (256)

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// The cache row of token `pos`, kv head h.
inline const bf16_bits* cache_row(const PrefillArgs& a, const bf16_bits* cache, int64_t pos,
                                  int64_t h) {
  return cache + cache_row_offset(a.block_ids[pos / a.block_size], pos % a.block_size, h,
                                  a.block_size, a.num_kv_heads, a.head_dim);
}

// permutex2var indices that interleave two rows of 32 bf16 values: word 2i of `lo`'s output is
// x[i], word 2i + 1 is y[i] (y's words are 32+); `hi` the same for i + 16.
struct InterleaveIndices {
  __m512i lo, hi;
  InterleaveIndices() {
    alignas(64) int16_t lo_idx[32], hi_idx[32];
    for (int w = 0; w < 32; ++w) {
      lo_idx[w] = static_cast<int16_t>((w % 2) * 32 + w / 2);
      hi_idx[w] = static_cast<int16_t>((w % 2) * 32 + 16 + w / 2);
    }
    lo = _mm512_load_si512(lo_idx);
    hi = _mm512_load_si512(hi_idx);
  }
};

// Keys [16c, 16c + 16) of kv head h as Vp lays them out (below), at `out` (16 x d values).
void interleave_value_chunk(const PrefillArgs& a, const InterleaveIndices& ix, int64_t h,
                            int64_t c, bf16_bits* out) {
  const int64_t d = a.head_dim;
  for (int64_t i = 0; i < kLanes / 2; ++i) {
    const int64_t k0 = c * kLanes + 2 * i, k1 = k0 + 1;
    const bf16_bits* r0 = k0 < a.kv_len ? cache_row(a, a.v_cache, k0, h) : nullptr;
    const bf16_bits* r1 = k1 < a.kv_len ? cache_row(a, a.v_cache, k1, h) : nullptr;
    for (int64_t l = 0; l < d / kLineValues; ++l) {
      const __m512i x = r0 ? _mm512_loadu_si512(r0 + l * kLineValues) : _mm512_setzero_si512();
      const __m512i y = r1 ? _mm512_loadu_si512(r1 + l * kLineValues) : _mm512_setzero_si512();
      bf16_bits* at = out + (i * d + l * kLineValues) * 2;
      _mm512_storeu_si512(at, _mm512_permutex2var_epi16(x, ix.lo, y));
      _mm512_storeu_si512(at + kLineValues, _mm512_permutex2var_epi16(x, ix.hi, y));
    }
  }
}

// Vp[h][chunk][pair of keys][d] = (v[2i][d], v[2i + 1][d]) as one 32-bit value, keys past kv_len
// zero: what p * v broadcasts.
void interleave_values(const PrefillArgs& a, int64_t num_chunks, bf16_bits* vp) {
  const int64_t chunk_values = kLanes * a.head_dim;
  const InterleaveIndices ix;
  // Chunk by chunk, every kv head of a chunk in turn: each thread reads a contiguous range of
  // the sequence's tokens, each token's heads once (head-major order read every token once per
  // head, from DRAM when the cache is cold: ~3 GB/s in a warm prefix's prefill).
  at::parallel_for(0, a.num_kv_heads * num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % a.num_kv_heads, c = task / a.num_kv_heads;
      interleave_value_chunk(a, ix, h, c, vp + (h * num_chunks + c) * chunk_values);
    }
  });
}

// One query head's tile of up to 16 queries.
struct Tile {
  int64_t head, first_query, count;
};

// qt[p] lane j: the pair of values (2p, 2p + 1) of query first_query + j (zeros past count).
void transpose_queries(const PrefillArgs& a, const Tile& tile, __m512bh* qt) {
  const int64_t d = a.head_dim;
  for (int64_t l = 0; l < d / kLineValues; ++l) {
    __m512 r[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      const bf16_bits* row =
          a.query + (tile.first_query + j) * a.q_stride + tile.head * d + l * kLineValues;
      r[j] = j < tile.count ? _mm512_castsi512_ps(_mm512_loadu_si512(row)) : _mm512_setzero_ps();
    }
    transpose16(r);  // r[i]: pair 16l + i of every query
    for (int i = 0; i < kLanes; ++i) qt[l * kLanes + i] = as_bh(_mm512_castps_si512(r[i]));
  }
}

// The online softmax's state for a tile, one lane per query.
struct TileState {
  __m512 max, sum;
  __m512 acc[2 * kMaxPairs];  // acc[e] lane j: sum of p * v[e] for query j under the running max
};

// Folds keys [16c, 16c + 16) into the tile's state. positions: each lane's query position.
void attend_chunk(const PrefillArgs& a, const Tile& tile, const __m512bh* qt, const bf16_bits* vp,
                  int64_t c, __m512i positions, TileState& st) {
  const int64_t d = a.head_dim, pairs = d / 2, h = tile.head / (a.num_heads / a.num_kv_heads);
  alignas(64) static const bf16_bits zeros[2 * kMaxPairs] = {};
  const bf16_bits* rows[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    const int64_t pos = c * kLanes + k;
    rows[k] = pos < a.kv_len ? cache_row(a, a.k_cache, pos, h) : zeros;
  }
  __m512 s[kLanes];
  for (auto& v : s) v = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
#pragma GCC unroll 16
    for (int k = 0; k < kLanes; ++k) {
      s[k] = _mm512_dpbf16_ps(s[k], qt[p], broadcast_pair(rows[k] + 2 * p));
    }
  }
  // Key 16c + k is attended by the query at position q iff key <= q and (no window or
  // q < key + window).
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = st.max;
  for (int k = 0; k < kLanes; ++k) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(c * kLanes + k));
    __mmask16 valid = _mm512_cmpge_epi32_mask(positions, key);
    if (a.sliding_window > 0) {
      const __m512i end =
          _mm512_add_epi32(key, _mm512_set1_epi32(static_cast<int32_t>(a.sliding_window)));
      valid &= _mm512_cmplt_epi32_mask(positions, end);
    }
    s[k] = _mm512_mask_mul_ps(neg_inf, valid, s[k], _mm512_set1_ps(a.scale));
    top = _mm512_max_ps(top, s[k]);
  }
  // A query with no key attended yet keeps max = -inf; shifting by 0 then keeps e^x finite.
  const __m512 shift =
      _mm512_mask_mov_ps(top, _mm512_cmpeq_ps_mask(top, neg_inf), _mm512_setzero_ps());
  const __m512 corr = exp_nonpositive16(_mm512_sub_ps(st.max, shift));  // 0 from -inf
  __m512 sum = _mm512_setzero_ps();
  __m512bh pt[kLanes / 2];
  for (int i = 0; i < kLanes / 2; ++i) {
    const __m512 p0 = exp_nonpositive16(_mm512_sub_ps(s[2 * i], shift));
    const __m512 p1 = exp_nonpositive16(_mm512_sub_ps(s[2 * i + 1], shift));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    pt[i] = as_bh(_mm512_or_si512(bf16_bits_rne16(p0), _mm512_slli_epi32(bf16_bits_rne16(p1), 16)));
  }
  st.max = top;
  st.sum = _mm512_fmadd_ps(st.sum, corr, sum);
  const bf16_bits* chunk_vp = vp + (h * ((a.kv_len + kLanes - 1) / kLanes) + c) * kLanes * d;
  for (int64_t e0 = 0; e0 < d; e0 += kLanes) {
    __m512 acc[kLanes];
    for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_mul_ps(st.acc[e0 + j], corr);
    for (int i = 0; i < kLanes / 2; ++i) {
      const bf16_bits* pairs_i = chunk_vp + (i * d + e0) * 2;
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) {
        acc[j] = _mm512_dpbf16_ps(acc[j], pt[i], broadcast_pair(pairs_i + 2 * j));
      }
    }
    for (int j = 0; j < kLanes; ++j) st.acc[e0 + j] = acc[j];
  }
}

void attend_tile(const PrefillArgs& a, const Tile& tile, const bf16_bits* vp) {
  const int64_t d = a.head_dim;
  __m512bh qt[kMaxPairs];
  transpose_queries(a, tile, qt);
  const int64_t first_pos = a.kv_len - a.num_queries + tile.first_query;
  const int64_t last_pos = first_pos + tile.count - 1;
  // Lanes past count repeat the last query, so that they stay finite (they are not stored).
  const __m512i lane = _mm512_min_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(tile.count - 1)));
  const __m512i positions =
      _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(first_pos)));
  TileState st;
  st.max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  st.sum = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; ++e) st.acc[e] = _mm512_setzero_ps();
  const int64_t first_key =
      a.sliding_window > 0 ? std::max<int64_t>(0, first_pos - a.sliding_window + 1) : 0;
  for (int64_t c = first_key / kLanes; c * kLanes <= last_pos; ++c) {
    attend_chunk(a, tile, qt, vp, c, positions, st);
  }
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(a.v_scale), st.sum);
  for (int64_t e0 = 0; e0 < d; e0 += kLanes) {
    __m512 r[kLanes];
    for (int j = 0; j < kLanes; ++j) r[j] = _mm512_mul_ps(st.acc[e0 + j], inv);
    transpose16(r);  // r[q]: values e0 .. e0 + 15 of query q
    for (int q = 0; q < tile.count; ++q) {
      bf16_bits* out = a.out + ((tile.first_query + q) * a.num_heads + tile.head) * d + e0;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16_rne(r[q]));
    }
  }
}

}  // namespace

void paged_prefill_bf16_avx512(const PrefillArgs& a) {
  const int64_t num_chunks = (a.kv_len + kLanes - 1) / kLanes;
  // interleave_values writes every element (zeros past kv_len): no zero-fill first.
  thread_local Scratch<bf16_bits> values;
  bf16_bits* vp = values.get(static_cast<size_t>(a.num_kv_heads * num_chunks * kLanes * a.head_dim));
  interleave_values(a, num_chunks, vp);
  // Tiles taken from both ends in turn (0, T - 1, 1, T - 2, ...): a causal tile's work grows with
  // its position, and parallel_for hands each thread a contiguous range of tasks.
  const int64_t num_tiles = (a.num_queries + kLanes - 1) / kLanes;
  at::parallel_for(0, num_tiles * a.num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t turn = task / a.num_heads;
      const int64_t t = turn % 2 == 0 ? turn / 2 : num_tiles - 1 - turn / 2;
      const int64_t first = t * kLanes;
      const Tile tile{task % a.num_heads, first, std::min<int64_t>(kLanes, a.num_queries - first)};
      attend_tile(a, tile, vp);
    }
  });
}

}  // namespace tgq_cpu

// ----------------------------------------------------------------------------------------------
// The same attention on AMX tiles (runs only where cpu_has_amx_bf16()): per query head and tile
// of 16 queries, the keys go by 64 at a time (attend_step_amx), both products transposed so that
// a lane is a query, as in the AVX-512 kernel above: the online softmax has no horizontal
// reduction and no per-row broadcast.
//  - scores^T: TDPBF16PS of the keys as they lie (A: 16 keys x 32 head values, rows copied once
//    per call, `Kr`) and the tile's queries transposed once (B: 16 pairs of head values x 16
//    queries, transpose_queries): per chunk of 16 keys a tile of 16 keys x 16 queries, fp32;
//  - the softmax in AVX-512 over the step's 64 vectors of 16 queries: max and sum are vertical
//    vmaxps/vaddps; the mask only on steps that reach the diagonal or the window's edge; the
//    scale (times log2 e) folded into the exponent's FMA, 2^x in 8 instructions (exp2_16, 17 for
//    exp_nonpositive16); p rounded to bf16 two keys at a time (vcvtne2ps2bf16: the same as c10's
//    rounding here, p being 0 or a normal number) and interleaved (vpermw) into B tiles of
//    16 pairs of keys x 16 queries;
//  - p * v: TDPBF16PS of the values transposed once per call (`Vt`, A: 16 head values x 16
//    pairs of keys) and those B tiles, accumulating out^T (16 head values x 16 queries) in fp32,
//    loaded into the tile and stored back per step: no AVX-512 work;
//  - the accumulator and the sum rescaled (vertical multiplies) only on steps where some
//    query's running max moved.
// Before, a row (one query's 64 scores) at a time: masked and scaled, max reduced, exponentials,
// sum reduced, and the fp32 accumulator rescaled by a broadcast per row and step, ~1,900
// AVX-512 instructions a step, ~3-4x the 16 TDPBF16PS. Now (1 thread, Intel Xeon with AMX, a
// shared machine; best of 6-8 calls, 7 rounds in turns with the previous kernel, the ratio's
// range over the rounds): a whole 512-token prompt of 12 heads x 64 1.9 -> 1.4 ms (1.03-1.52x,
// median 1.34x), 2,048 tokens 24 -> 17 ms (1.27-1.46x), with 4 kv heads 23 -> 16 ms
// (1.21-1.48x), 512 tokens of 32 / 8 heads x 128 7.5 -> 6.0 ms (1.11-1.35x). The tile work
// alone (the softmax left out) is now ~2/3 of the time. No faster (within the noise, ~10%):
// loading the keys and values into alternating tiles; issuing the next step's scores before
// this step's softmax (software pipelining); a lazy max (moved, and the accumulator rescaled,
// only when passed by more than 2^11), which also rounded the largest p to bf16.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#include "amx_common.h"

namespace tgq_cpu {
namespace {

constexpr int64_t kChunksPerStep = 4;  // chunks of 16 keys per step
constexpr int64_t kKeysPerStep = kChunksPerStep * kLanes;
constexpr int64_t kGroupKeys = 2 * kLanes;  // keys per p * v B tile (16 pairs)
// At most this many tiles per kv head (and two kv heads or more, one per thread), the keys go by
// once for all of them (attend_by_steps_amx); more, each tile reads a copy of them made once per
// call (attend_by_tiles_amx).
constexpr int64_t kStreamTiles = 8;
constexpr float kLog2e = 1.44269504f;

// 2^x on 16 lanes, 0 below 2^-126 (so from -inf): a degree-5 polynomial of x - floor(x) (relative
// error 1.7e-7, as exp_nonpositive16's) scaled by 2^floor(x) (vscalefps).
inline __m512 exp2_16(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.87623291e-3f);
  for (float c : {8.99258442e-3f, 5.58236055e-2f, 2.40154535e-1f, 6.93152964e-1f, 9.99999940e-1f}) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  }
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(normal, p, x);
}

// Keys [16c, 16c + 16) of kv head h as rows of head_dim values at `out` (Kr: an A tile per
// 32 head values, row stride head_dim). Keys past kv_len are zeros.
void copy_key_chunk(const PrefillArgs& a, int64_t h, int64_t c, bf16_bits* out) {
  const int64_t d = a.head_dim;
  for (int64_t n = 0; n < kLanes; ++n) {
    const int64_t pos = c * kLanes + n;
    if (pos < a.kv_len) {
      std::memcpy(out + n * d, cache_row(a, a.k_cache, pos, h), d * sizeof(bf16_bits));
    } else {
      std::fill_n(out + n * d, d, bf16_bits{0});
    }
  }
}

// Keys [32g, 32g + 32) of kv head h as Vt lays them out at `out` (32 x d values): per 16 head
// values b, an A tile of 1 KiB whose row e holds the 16 pairs of keys' values 16b + e, each pair
// (v[2i][e], v[2i + 1][e]) as one 32-bit value. Keys past kv_len are zeros.
void transpose_value_group(const PrefillArgs& a, const InterleaveIndices& ix, int64_t h,
                           int64_t g, bf16_bits* out) {
  const int64_t d = a.head_dim;
  alignas(64) bf16_bits vp[kGroupKeys * 2 * kMaxPairs];  // [16 pairs][d] pairs, as Vp
  interleave_value_chunk(a, ix, h, 2 * g, vp);
  interleave_value_chunk(a, ix, h, 2 * g + 1, vp + kLanes * d);
  for (int64_t b = 0; b < d / kLanes; ++b) {
    __m512 r[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      r[i] = _mm512_load_ps(reinterpret_cast<const float*>(vp + i * 2 * d + 2 * kLanes * b));
    }
    transpose16(r);  // r[e] lane i: pair i's values 16b + e
    float* tile = reinterpret_cast<float*>(out + b * kLanes * kGroupKeys);
    for (int e = 0; e < kLanes; ++e) _mm512_storeu_ps(tile + e * kLanes, r[e]);
  }
}

// Kr[h] and Vt[h] for every kv head, num_chunks (a multiple of 4) chunks each.
void prepare_keys_values(const PrefillArgs& a, int64_t num_chunks, bf16_bits* kr, bf16_bits* vt) {
  const int64_t chunk_values = kLanes * a.head_dim, groups = num_chunks / 2;
  // Group-major, every kv head of a group in turn: each thread reads a contiguous range of the
  // sequence's tokens (see interleave_values).
  at::parallel_for(0, a.num_kv_heads * groups, 1, [&](int64_t begin, int64_t end) {
    const InterleaveIndices ix;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % a.num_kv_heads, g = task / a.num_kv_heads;
      const int64_t at = h * num_chunks * chunk_values + 2 * g * chunk_values;
      copy_key_chunk(a, h, 2 * g, kr + at);
      copy_key_chunk(a, h, 2 * g + 1, kr + at + chunk_values);
      transpose_value_group(a, ix, h, g, vt + at);
    }
  });
}

// One tile's queries and its online softmax so far, one lane per query.
struct AmxTileState {
  Tile tile;
  int64_t first_pos, last_pos, first_key;  // the tile's first and last query's positions
  alignas(64) bf16_bits queries[kLanes * 2 * kMaxPairs];  // per 32 head values a B tile
  alignas(64) float acc[kLanes * 2 * kMaxPairs];          // [d][16 queries]: out^T
  alignas(64) float ref[kLanes];  // the running max, scaled, in log2 units
  alignas(64) float sum[kLanes];

  void start(const PrefillArgs& a, const Tile& t) {
    const int64_t d = a.head_dim;
    tile = t;
    transpose_queries(a, t, reinterpret_cast<__m512bh*>(queries));
    std::fill_n(acc, kLanes * d, 0.0f);
    std::fill_n(ref, kLanes, -std::numeric_limits<float>::infinity());
    std::fill_n(sum, kLanes, 0.0f);
    first_pos = a.kv_len - a.num_queries + t.first_query;
    last_pos = first_pos + t.count - 1;
    first_key = a.sliding_window > 0 ? std::max<int64_t>(0, first_pos - a.sliding_window + 1) : 0;
  }

  // Whether step `step`'s keys [64 step, 64 step + 64) reach any of the tile's queries.
  bool attends(int64_t step) const {
    return step >= first_key / kKeysPerStep && step * kKeysPerStep <= last_pos;
  }

  void finish(const PrefillArgs& a) const {
    const int64_t d = a.head_dim;
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(a.v_scale), _mm512_load_ps(sum));
    for (int64_t e0 = 0; e0 < d; e0 += kLanes) {
      __m512 r[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        r[j] = _mm512_mul_ps(_mm512_load_ps(acc + (e0 + j) * kLanes), inv);
      }
      transpose16(r);  // r[q]: values e0 .. e0 + 15 of query q
      for (int64_t q = 0; q < tile.count; ++q) {
        bf16_bits* out = a.out + ((tile.first_query + q) * a.num_heads + tile.head) * d + e0;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16_rne(r[q]));
      }
    }
  }
};

// Folds the keys of step `step` into the tile's state: `keys`, their 64 Kr rows; `values`,
// their two groups' Vt. Tiles: 0-3 scores^T (the step's four chunks of 16 keys x 16 queries),
// 4 queries then p (keys 0-31), 5 keys then p (keys 32-63), 6 values, 7 out^T.
void attend_step_amx(const PrefillArgs& a, AmxTileState& st, const bf16_bits* keys,
                     const bf16_bits* values, int64_t step) {
  const int64_t d = a.head_dim, lines = d / kLineValues;
  alignas(64) float scores[kKeysPerStep * kLanes];     // [64 keys][16 queries]
  alignas(64) bf16_bits probs[kKeysPerStep * kLanes];  // [32 pairs of keys][16 queries] pairs
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t k_bytes = d * static_cast<int64_t>(sizeof(bf16_bits));
  constexpr int64_t kTileValues = kLanes * kLineValues;  // bf16 values in one tile
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t l = 0; l < lines; ++l) {
    _tile_loadd(4, st.queries + l * kTileValues, 64);
    _tile_loadd(5, keys + 0 * kLanes * d + l * kLineValues, k_bytes);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(5, keys + 1 * kLanes * d + l * kLineValues, k_bytes);
    _tile_dpbf16ps(1, 5, 4);
    _tile_loadd(5, keys + 2 * kLanes * d + l * kLineValues, k_bytes);
    _tile_dpbf16ps(2, 5, 4);
    _tile_loadd(5, keys + 3 * kLanes * d + l * kLineValues, k_bytes);
    _tile_dpbf16ps(3, 5, 4);
  }
  _tile_stored(0, scores + 0 * kLanes * kLanes, 64);
  _tile_stored(1, scores + 1 * kLanes * kLanes, 64);
  _tile_stored(2, scores + 2 * kLanes * kLanes, 64);
  _tile_stored(3, scores + 3 * kLanes * kLanes, 64);
  // The query at position p attends key k iff k <= p and (no window or p < k + window): every
  // key of the step for every query of the tile (lanes past count repeat the last query) when
  // the step lies below the first query and within the last one's window.
  const int64_t key0 = step * kKeysPerStep;
  const bool masked = key0 + kKeysPerStep - 1 > st.first_pos ||
                      (a.sliding_window > 0 && st.last_pos >= key0 + a.sliding_window);
  // A positive scale is applied in the exponential's argument (the max of the unscaled scores
  // times the scale is the max of the scaled ones); any other, to the scores first.
  const bool scale_late = a.scale > 0;
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 top[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
  if (masked || !scale_late) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i positions = _mm512_min_epi32(
        _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(st.first_pos))),
        _mm512_set1_epi32(static_cast<int32_t>(st.last_pos)));
    for (int k = 0; k < kKeysPerStep; ++k) {
      __m512 s = _mm512_load_ps(scores + k * kLanes);
      if (!scale_late) s = _mm512_mul_ps(s, scale);
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(key0 + k));
      __mmask16 valid = _mm512_cmpge_epi32_mask(positions, key);
      if (a.sliding_window > 0) {
        valid &= _mm512_cmplt_epi32_mask(
            positions,
            _mm512_add_epi32(key, _mm512_set1_epi32(static_cast<int32_t>(a.sliding_window))));
      }
      s = _mm512_mask_mov_ps(neg_inf, valid, s);
      _mm512_store_ps(scores + k * kLanes, s);
      top[k % 4] = _mm512_max_ps(top[k % 4], s);
    }
  } else {
    for (int k = 0; k < kKeysPerStep; ++k) {
      top[k % 4] = _mm512_max_ps(top[k % 4], _mm512_load_ps(scores + k * kLanes));
    }
  }
  __m512 step_max = _mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3]));
  // Scores in log2 units from here: s * scale * log2(e).
  const __m512 mul = _mm512_set1_ps(scale_late ? a.scale * kLog2e : kLog2e);
  step_max = _mm512_mul_ps(step_max, mul);
  __m512 ref = _mm512_load_ps(st.ref);  // the running max
  __m512 sum = _mm512_load_ps(st.sum);
  const __mmask16 moves = _mm512_cmp_ps_mask(step_max, ref, _CMP_GT_OQ);
  if (moves != 0) {
    // 0 where the reference was -inf (nothing accumulated yet), 1 where it stays.
    const __m512 corr = _mm512_mask_mov_ps(
        _mm512_set1_ps(1.0f), moves, exp2_16(_mm512_sub_ps(ref, step_max)));
    ref = _mm512_mask_mov_ps(ref, moves, step_max);
    sum = _mm512_mul_ps(sum, corr);
    for (int64_t e = 0; e < d; ++e) {
      float* row = st.acc + e * kLanes;
      _mm512_store_ps(row, _mm512_mul_ps(_mm512_load_ps(row), corr));
    }
    _mm512_store_ps(st.ref, ref);
  }
  // A query with no key attended yet keeps ref = -inf; shifting by 0 then keeps 2^x finite.
  const __m512 shift =
      _mm512_mask_mov_ps(ref, _mm512_cmpeq_ps_mask(ref, neg_inf), _mm512_setzero_ps());
  // Word 2q of a B tile's row: key 2i's p for query q, word 2q + 1 key 2i + 1's.
  alignas(64) static const int16_t kPairWords[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                     21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pair_words = _mm512_load_si512(kPairWords);
  __m512 sum1 = _mm512_setzero_ps();
  for (int i = 0; i < kKeysPerStep / 2; ++i) {
    const __m512 p0 =
        exp2_16(_mm512_fmsub_ps(_mm512_load_ps(scores + 2 * i * kLanes), mul, shift));
    const __m512 p1 =
        exp2_16(_mm512_fmsub_ps(_mm512_load_ps(scores + (2 * i + 1) * kLanes), mul, shift));
    if (i % 2 == 0) {
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    } else {
      sum1 = _mm512_add_ps(sum1, _mm512_add_ps(p0, p1));
    }
    const __m512i words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));
    _mm512_store_si512(probs + i * kLineValues, _mm512_permutexvar_epi16(pair_words, words));
  }
  _mm512_store_ps(st.sum, _mm512_add_ps(sum, sum1));
  _tile_loadd(4, probs, 64);                               // keys 0-31
  _tile_loadd(5, probs + kLanes * kLineValues, 64);        // keys 32-63
  const bf16_bits* values_hi = values + kGroupKeys * d;    // keys 32-63 of the step
  for (int64_t b = 0; b < d / kLanes; ++b) {
    float* out = st.acc + b * kLanes * kLanes;
    _tile_loadd(7, out, 64);
    _tile_loadd(6, values + b * kTileValues, 64);
    _tile_dpbf16ps(7, 6, 4);
    _tile_loadd(6, values_hi + b * kTileValues, 64);
    _tile_dpbf16ps(7, 6, 5);
    _tile_stored(7, out, 64);
  }
}

// Per query head and tile of 16 queries (attend_step_amx over the call's Kr and Vt), head by head:
// a head's tiles one after another, the heads of one kv head next to each other, so the kv
// head's Kr and Vt stay in L2 across its tiles. Every head has the same work, so contiguous
// ranges of heads balance the threads.
void attend_by_tiles_amx(const PrefillArgs& a) {
  // Whole steps of 64 keys: a multiple of four chunks, zeros where kv_len ends.
  const int64_t num_chunks =
      ((a.kv_len + kLanes - 1) / kLanes + kChunksPerStep - 1) / kChunksPerStep * kChunksPerStep;
  const int64_t chunk_values = kLanes * a.head_dim;
  const int64_t head_values = num_chunks * chunk_values;
  thread_local Scratch<bf16_bits> values, keys;
  bf16_bits* vt = values.get(static_cast<size_t>(a.num_kv_heads * head_values));
  bf16_bits* kr = keys.get(static_cast<size_t>(a.num_kv_heads * head_values));
  prepare_keys_values(a, num_chunks, kr, vt);
  const int64_t num_tiles = (a.num_queries + kLanes - 1) / kLanes;
  const int64_t group = a.num_heads / a.num_kv_heads;
  at::parallel_for(0, num_tiles * a.num_heads, 1, [&](int64_t begin, int64_t end) {
    auto st = std::make_unique<AmxTileState>();
    load_amx_tile_config();  // after the allocation: see attend_by_steps_amx
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task % num_tiles * kLanes, head = task / num_tiles;
      st->start(a, Tile{head, first, std::min<int64_t>(kLanes, a.num_queries - first)});
      const int64_t h = head / group;
      for (int64_t step = st->first_key / kKeysPerStep; st->attends(step); ++step) {
        const int64_t c = kChunksPerStep * step;
        attend_step_amx(a, *st, kr + h * head_values + c * chunk_values,
                        vt + h * head_values + c * chunk_values, step);
      }
      st->finish(a);
    }
    _tile_release();
  });
}
// Asks for the rows of kv heads [begin, end) of the keys and values of step `step` (into L2): a
// kv head's rows are 128-256 bytes of each token's row of all heads, whose stride the hardware
// prefetchers did not follow: a cold cache (a prefix cached long ago) was read at ~4 GB/s. One
// step ahead: 32 queries over 2,080 tokens, 12 kv heads x 64, cache flushed, 1.5 -> 1.15 ms a
// call (Intel Xeon with AMX, 2 threads); two steps ahead was no better.
void prefetch_rows(const PrefillArgs& a, int64_t begin, int64_t end, int64_t step) {
  const int64_t run_bytes = (end - begin) * a.head_dim * static_cast<int64_t>(sizeof(bf16_bits));
  const int64_t last = std::min(a.kv_len, (step + 1) * kKeysPerStep);
  for (int64_t pos = step * kKeysPerStep; pos < last; ++pos) {
    const char* k = reinterpret_cast<const char*>(cache_row(a, a.k_cache, pos, begin));
    const char* v = reinterpret_cast<const char*>(cache_row(a, a.v_cache, pos, begin));
    for (int64_t at = 0; at < run_bytes; at += 64) {
      _mm_prefetch(k + at, _MM_HINT_T1);
      _mm_prefetch(v + at, _MM_HINT_T1);
    }
  }
}

// Few tiles per kv head (a short chunk after a long cached prefix): the keys go by once, step by
// step; each step's Kr and Vt of a kv head are made in L1 and folded into every tile of the kv
// head's query heads. Each thread takes a range of kv heads and goes through the steps for all
// of them at once, so it reads each token's rows of its heads as one contiguous run. No copy of
// the whole sequence's keys and values, which cost more than the attention itself when few tiles
// read it (32 queries over 2,080 cached tokens, 12 heads x 64: see kStreamTiles).
void attend_by_steps_amx(const PrefillArgs& a) {
  const int64_t num_tiles = (a.num_queries + kLanes - 1) / kLanes;
  const int64_t tiles_per_kv_head = num_tiles * (a.num_heads / a.num_kv_heads);
  const int64_t lines = a.head_dim / kLineValues;
  at::parallel_for(0, a.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    const InterleaveIndices ix;
    // Kept per thread (~25 KiB a tile): a vector of them per call was mapped and page-faulted in
    // every call (296 KiB a thread for 12 kv heads x 2 tiles).
    thread_local Scratch<AmxTileState> kept_states;
    const int64_t num_states = (end - begin) * tiles_per_kv_head;
    AmxTileState* const states = kept_states.get(static_cast<size_t>(num_states));
    const auto keys = std::make_unique_for_overwrite<bf16_bits[]>(
        static_cast<size_t>(kChunksPerStep * lines * kLanes * kLineValues));
    const auto values = std::make_unique_for_overwrite<bf16_bits[]>(
        static_cast<size_t>(kChunksPerStep * kLanes * a.head_dim));
    // The tile configuration only once the memory is allocated: loaded before these
    // allocations (mapped by a system call), the next tile instruction faulted with SIGILL as
    // if unconfigured (Linux 6.18, Intel Xeon with AMX).
    load_amx_tile_config();
    int64_t first_step = std::numeric_limits<int64_t>::max(), last_step = 0;
    for (int64_t i = 0; i < num_states; ++i) {
      const int64_t first = i % num_tiles * kLanes;
      AmxTileState& st = states[i];
      // Tiles kv head by kv head: those of kv head begin + i / tiles_per_kv_head together.
      st.start(a, Tile{begin * (a.num_heads / a.num_kv_heads) + i / num_tiles, first,
                       std::min<int64_t>(kLanes, a.num_queries - first)});
      first_step = std::min(first_step, st.first_key / kKeysPerStep);
      last_step = std::max(last_step, st.last_pos / kKeysPerStep);
    }
    prefetch_rows(a, begin, end, first_step);
    for (int64_t step = first_step; step <= last_step; ++step) {
      prefetch_rows(a, begin, end, step + 1);
      for (int64_t h = begin; h < end; ++h) {
        AmxTileState* head_states = states + (h - begin) * tiles_per_kv_head;
        bool needed = false;
        for (int64_t i = 0; i < tiles_per_kv_head; ++i) needed |= head_states[i].attends(step);
        if (!needed) continue;
        for (int64_t j = 0; j < kChunksPerStep; ++j) {
          copy_key_chunk(a, h, kChunksPerStep * step + j, keys.get() + j * kLanes * a.head_dim);
        }
        for (int64_t g = 0; g < kKeysPerStep / kGroupKeys; ++g) {
          transpose_value_group(a, ix, h, kKeysPerStep / kGroupKeys * step + g,
                                values.get() + g * kGroupKeys * a.head_dim);
        }
        for (int64_t i = 0; i < tiles_per_kv_head; ++i) {
          if (head_states[i].attends(step)) {
            attend_step_amx(a, head_states[i], keys.get(), values.get(), step);
          }
        }
      }
    }
    for (int64_t i = 0; i < num_states; ++i) states[i].finish(a);
    _tile_release();
  });
}

}  // namespace

void paged_prefill_bf16_amx(const PrefillArgs& a) {
  const int64_t num_tiles = (a.num_queries + kLanes - 1) / kLanes;
  const int64_t tiles_per_kv_head = num_tiles * (a.num_heads / a.num_kv_heads);
  if (tiles_per_kv_head <= kStreamTiles && a.num_kv_heads >= 2) {
    attend_by_steps_amx(a);
  } else {
    attend_by_tiles_amx(a);
  }
}

}  // namespace tgq_cpu

#pragma GCC pop_options
