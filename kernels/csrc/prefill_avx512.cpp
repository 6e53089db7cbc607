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
// of 16 queries, the keys go by 64 at a time. Scores: TDPBF16PS of the queries (A: 16 queries x
// 32 head values, copied once per tile) and the keys transposed once per call into B tiles
// (`Kt`: per kv head, 16 keys and 32 head values, the 16 keys' pairs side by side), 16 x 16 fp32
// per tile; the online softmax in AVX-512, a row (one query's 64 scores) at a time, in two passes
// over the tile's rows (attend_tile_amx); p rounded to bf16 is the A tile of p * v, whose B tiles
// are `Vp` (interleave_values) as it lies: 16 pairs of keys x 16 head values. The output
// accumulates in fp32 rows, rescaled per row. Tiles go head by head (paged_prefill_bf16_amx).
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#include "amx_common.h"

namespace tgq_cpu {
namespace {

constexpr int64_t kChunksPerStep = 4;  // chunks of 16 keys per step
constexpr int64_t kKeysPerStep = kChunksPerStep * kLanes;
// At most this many tiles per kv head (and two kv heads or more, one per thread), the keys go by
// once for all of them (attend_by_steps_amx); more, each tile reads a copy of them made once per
// call (attend_by_tiles_amx).
constexpr int64_t kStreamTiles = 8;

// Keys [16c, 16c + 16) of kv head h as `lines` B tiles of 1 KiB at `out`: tile l's row p holds
// the 16 keys' values (32l + 2p, 32l + 2p + 1). Keys past kv_len are zeros.
void transpose_key_chunk(const PrefillArgs& a, int64_t h, int64_t c, bf16_bits* out) {
  for (int64_t l = 0; l < a.head_dim / kLineValues; ++l) {
    __m512 r[kLanes];
    for (int n = 0; n < kLanes; ++n) {
      const int64_t pos = c * kLanes + n;
      r[n] = pos < a.kv_len ? _mm512_loadu_ps(reinterpret_cast<const float*>(
                                  cache_row(a, a.k_cache, pos, h) + l * kLineValues))
                            : _mm512_setzero_ps();
    }
    transpose16(r);  // r[p] lane n: pair p of key n
    float* tile = reinterpret_cast<float*>(out + l * kLanes * kLineValues);
    for (int p = 0; p < kLanes; ++p) _mm512_storeu_ps(tile + p * kLanes, r[p]);
  }
}

// Kt[h][c]: transpose_key_chunk(h, c) for every kv head and chunk.
void transpose_keys(const PrefillArgs& a, int64_t num_chunks, bf16_bits* kt) {
  const int64_t chunk_values = kLanes * a.head_dim;
  at::parallel_for(0, a.num_kv_heads * num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {  // chunk-major, as interleave_values
      const int64_t h = task % a.num_kv_heads, c = task / a.num_kv_heads;
      transpose_key_chunk(a, h, c, kt + (h * num_chunks + c) * chunk_values);
    }
  });
}

// One tile's queries and its online softmax so far.
struct AmxTileState {
  Tile tile;
  int64_t first_pos, last_pos, first_key;  // the tile's first and last query's positions
  alignas(64) bf16_bits queries[kLanes * 2 * kMaxPairs];  // [16][d], zeros past count
  alignas(64) float acc[kLanes * 2 * kMaxPairs];          // [16 queries][d]
  float row_max[kLanes], row_sum[kLanes];

  void start(const PrefillArgs& a, const Tile& t) {
    const int64_t d = a.head_dim;
    tile = t;
    std::fill_n(queries, kLanes * d, bf16_bits{0});
    for (int64_t q = 0; q < t.count; ++q) {
      std::memcpy(queries + q * d, a.query + (t.first_query + q) * a.q_stride + t.head * d,
                  d * sizeof(bf16_bits));
    }
    std::fill_n(acc, kLanes * d, 0.0f);
    std::fill_n(row_max, kLanes, -std::numeric_limits<float>::infinity());
    std::fill_n(row_sum, kLanes, 0.0f);
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
    for (int64_t q = 0; q < tile.count; ++q) {
      const __m512 inv = _mm512_set1_ps(a.v_scale / row_sum[q]);
      bf16_bits* out = a.out + ((tile.first_query + q) * a.num_heads + tile.head) * d;
      for (int64_t e0 = 0; e0 < d; e0 += kLanes) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e0),
                            to_bf16_rne(_mm512_mul_ps(_mm512_loadu_ps(acc + q * d + e0), inv)));
      }
    }
  }
};

// Folds the keys of step `step` into the tile's state: `keys`, their four chunks' Kt tiles
// (chunk j, line l at (j * lines + l) * 256 values); `values`, their four chunks' Vp.
// Tiles: 0-3 scores (the step's four chunks of 16 keys), 4 queries then p (keys 0-31), 5 keys
// then p (keys 32-63), 6 values, 7 p * v.
void attend_step_amx(const PrefillArgs& a, AmxTileState& st, const bf16_bits* keys,
                     const bf16_bits* values, int64_t step) {
  const int64_t d = a.head_dim, lines = d / kLineValues;
  const int64_t first_pos = st.first_pos, last_pos = st.last_pos;
  float* acc = st.acc;
  float* row_max = st.row_max;
  float* row_sum = st.row_sum;
  const bf16_bits* queries = st.queries;
  alignas(64) float scores[kLanes * kKeysPerStep];     // [16 queries][64 keys]
  alignas(64) bf16_bits probs[kLanes * kKeysPerStep];  // the same, bf16: p * v's A tiles
  alignas(64) float part[kLanes * kLanes];             // [16 queries][16 values] of p * v
  alignas(64) float corr[kLanes], shift[kLanes];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t q_bytes = d * static_cast<int64_t>(sizeof(bf16_bits));
  const int64_t v_bytes = 2 * d * static_cast<int64_t>(sizeof(bf16_bits));  // a pair row of Vp
  constexpr int64_t kScoreBytes = kKeysPerStep * sizeof(float);
  constexpr int64_t kProbBytes = kKeysPerStep * sizeof(bf16_bits);
  const int64_t tile_values = kLanes * kLineValues;  // one Kt tile
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t l = 0; l < lines; ++l) {
    _tile_loadd(4, queries + l * kLineValues, q_bytes);
    _tile_loadd(5, keys + (0 * lines + l) * tile_values, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, keys + (1 * lines + l) * tile_values, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, keys + (2 * lines + l) * tile_values, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, keys + (3 * lines + l) * tile_values, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, scores, kScoreBytes);
  _tile_stored(1, scores + kLanes, kScoreBytes);
  _tile_stored(2, scores + 2 * kLanes, kScoreBytes);
  _tile_stored(3, scores + 3 * kLanes, kScoreBytes);
  // Row q: the query at first_pos + q attends key k iff k <= its position and (no window or
  // its position < k + window). Two passes over the rows (scaled, masked scores and each
  // row's max; then the exponentials), each row's work short and independent of the others'.
  for (int q = 0; q < kLanes; ++q) {
    const __m512i pos = _mm512_set1_epi32(static_cast<int32_t>(std::min(first_pos + q, last_pos)));
    __m512 top_v = neg_inf;
    for (int j = 0; j < kChunksPerStep; ++j) {
      const __m512i key = _mm512_add_epi32(
          lane, _mm512_set1_epi32(static_cast<int32_t>(step * kKeysPerStep + j * kLanes)));
      __mmask16 valid = _mm512_cmple_epi32_mask(key, pos);
      if (a.sliding_window > 0) {
        valid &= _mm512_cmpgt_epi32_mask(
            _mm512_add_epi32(key, _mm512_set1_epi32(static_cast<int32_t>(a.sliding_window))),
            pos);
      }
      float* at = scores + q * kKeysPerStep + j * kLanes;
      const __m512 sj =
          _mm512_mask_mul_ps(neg_inf, valid, _mm512_loadu_ps(at), _mm512_set1_ps(a.scale));
      _mm512_storeu_ps(at, sj);
      top_v = _mm512_max_ps(top_v, sj);
    }
    const float top = std::max(row_max[q], _mm512_reduce_max_ps(top_v));
    shift[q] = top == -std::numeric_limits<float>::infinity() ? 0.0f : top;
    corr[q] = row_max[q] - shift[q];  // exponentiated below, 16 rows at once
    row_max[q] = top;
  }
  _mm512_storeu_ps(corr, exp_nonpositive16(_mm512_loadu_ps(corr)));
  for (int q = 0; q < kLanes; ++q) {
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < kChunksPerStep; ++j) {
      const __m512 sj = _mm512_loadu_ps(scores + q * kKeysPerStep + j * kLanes);
      const __m512 pj = exp_nonpositive16(_mm512_sub_ps(sj, _mm512_set1_ps(shift[q])));
      sum = _mm512_add_ps(sum, pj);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + q * kKeysPerStep + j * kLanes),
                          to_bf16_rne(pj));
    }
    row_sum[q] = row_sum[q] * corr[q] + _mm512_reduce_add_ps(sum);
  }
  _tile_loadd(4, probs, kProbBytes);                   // keys 0-31
  _tile_loadd(5, probs + kKeysPerStep / 2, kProbBytes);  // keys 32-63
  const bf16_bits* values_hi = values + 2 * kLanes * d;  // chunks 2 and 3 of the step
  for (int64_t e0 = 0; e0 < d; e0 += kLanes) {
    _tile_zero(7);
    _tile_loadd(6, values + 2 * e0, v_bytes);
    _tile_dpbf16ps(7, 4, 6);
    _tile_loadd(6, values_hi + 2 * e0, v_bytes);
    _tile_dpbf16ps(7, 5, 6);
    _tile_stored(7, part, kLanes * sizeof(float));
    for (int q = 0; q < kLanes; ++q) {
      float* row = acc + q * d + e0;
      _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_loadu_ps(row), _mm512_set1_ps(corr[q]),
                                            _mm512_loadu_ps(part + q * kLanes)));
    }
  }
}

// Per query head and tile of 16 queries (attend_step_amx over the call's Kt and Vp), head by head:
// a head's tiles one after another, the heads of one kv head next to each other, so the kv
// head's Kt and Vp stay in L2 across its tiles. Every head has the same work, so contiguous
// ranges of heads balance the threads.
void attend_by_tiles_amx(const PrefillArgs& a) {
  // Whole steps of 64 keys: a multiple of four chunks, zeros where kv_len ends.
  const int64_t num_chunks =
      ((a.kv_len + kLanes - 1) / kLanes + kChunksPerStep - 1) / kChunksPerStep * kChunksPerStep;
  const int64_t chunk_values = kLanes * a.head_dim;
  const int64_t head_values = num_chunks * chunk_values;
  thread_local Scratch<bf16_bits> values, keys;
  bf16_bits* vp = values.get(static_cast<size_t>(a.num_kv_heads * head_values));
  bf16_bits* kt = keys.get(static_cast<size_t>(a.num_kv_heads * head_values));
  interleave_values(a, num_chunks, vp);
  transpose_keys(a, num_chunks, kt);
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
        attend_step_amx(a, *st, kt + h * head_values + c * chunk_values,
                        vp + h * head_values + c * chunk_values, step);
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
// step; each step's Kt and Vp of a kv head are made in L1 and folded into every tile of the kv
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
    std::vector<AmxTileState> states(static_cast<size_t>((end - begin) * tiles_per_kv_head));
    const auto keys = std::make_unique_for_overwrite<bf16_bits[]>(
        static_cast<size_t>(kChunksPerStep * lines * kLanes * kLineValues));
    const auto values = std::make_unique_for_overwrite<bf16_bits[]>(
        static_cast<size_t>(kChunksPerStep * kLanes * a.head_dim));
    // The tile configuration only once the memory is allocated: loaded before these
    // allocations (mapped by a system call), the next tile instruction faulted with SIGILL as
    // if unconfigured (Linux 6.18, Intel Xeon with AMX).
    load_amx_tile_config();
    int64_t first_step = std::numeric_limits<int64_t>::max(), last_step = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(states.size()); ++i) {
      const int64_t first = i % num_tiles * kLanes;
      AmxTileState& st = states[static_cast<size_t>(i)];
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
        AmxTileState* head_states = states.data() + (h - begin) * tiles_per_kv_head;
        bool needed = false;
        for (int64_t i = 0; i < tiles_per_kv_head; ++i) needed |= head_states[i].attends(step);
        if (!needed) continue;
        for (int64_t j = 0; j < kChunksPerStep; ++j) {
          const int64_t c = kChunksPerStep * step + j;
          transpose_key_chunk(a, h, c, keys.get() + j * lines * kLanes * kLineValues);
          interleave_value_chunk(a, ix, h, c, values.get() + j * kLanes * a.head_dim);
        }
        for (int64_t i = 0; i < tiles_per_kv_head; ++i) {
          if (head_states[i].attends(step)) {
            attend_step_amx(a, head_states[i], keys.get(), values.get(), step);
          }
        }
      }
    }
    for (const AmxTileState& st : states) st.finish(a);
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
