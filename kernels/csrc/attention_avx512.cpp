// paged_decode_attention's bf16 kernel for CPUs with AVX512_BF16 (paged_attention.cpp calls it
// where cpu_has_avx512_bf16() and the head size is whole 64-byte lines).
//
// Per query head and chunk of up to 16 tokens of a block: q . k by vdpbf16ps (each product of two
// bf16 exact, sums in fp32), one vector of partial sums per token, folded into one vector of the
// 16 tokens' scores by a shuffle tree; the online softmax then works on that vector. p * v stays
// fp32: a line of 32 bf16 values read as 16 32-bit lanes gives the odd elements by masking the
// low half and the even ones by a shift (no shuffle), so the accumulator is kept as even and odd
// halves and interleaved once, when the output is stored.
//
// Blocks are done in three passes over a task's heads (decode_task), and with 2 to 8 query heads
// per kv head, p * v widens each V line once for the group (accumulate_group).
//
// An FP8 E4M3 cache (KvFormat::kFp8E4M3): before each pass reads a block's K (or V) rows of a kv
// head, they are decoded to bf16 into a small per-thread buffer (kv_fp8_avx512.cpp), which the
// passes then read as they read a bf16 cache, so the sums are those of `cache.to(bfloat16)`: half
// the bytes cross the memory bus, for ~4 instructions per 32 values, shared by the G query heads.
// k_scale rides in the score scale, v_scale in the output's 1 / sum (DecodeArgs).
//
// Time against the AVX2 fp32 kernel, in turns in one process (2 threads, Zen 4, caches warm):
// 16 sequences x 12 heads x 64 at 24 tokens 0.82-0.91x, 64 of them 0.82-0.91x, at 512 tokens
// 0.66-0.74x; 32 query / 8 kv heads x 128, 16 sequences at 1,024 tokens 0.75-0.81x, one at 4,096
// 0.55-0.64x. Each (block, kv head) unit of rows is prefetched two units ahead (the first block of
// the thread's next task included); other distances and hints measured alike within noise.
#include "attention_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include "avx512_common.h"

namespace tgq_cpu {
namespace {

constexpr int kLanes = 16;  // fp32 lanes; also the tokens a chunk scores at once

// Lane t = the sum of the 16 lanes of part[t]: four rounds, each adding pairs of vectors after a
// shuffle that puts matching partial sums side by side (8 + 4 + 2 + 1 additions).
inline __m512 sum_each(const __m512 (&part)[kLanes]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit chunk: tokens 2i, 2i + 1, 2i, 2i + 1
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(part[2 * i], part[2 * i + 1]),
                         _mm512_unpackhi_ps(part[2 * i], part[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit chunk: tokens 4i .. 4i + 3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // chunks: b[2i] summed in pairs of chunks, then b[2i + 1]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// One query head's online-softmax state: acc[2l] holds the even elements of the head's line l,
// acc[2l + 1] the odd ones, as sums of p * v under the running max. (Plain floats: a std::vector
// of __m512 members need not be 64-byte aligned.)
template <int L>
struct HeadState {
  float max, sum;
  float acc[2 * L][kLanes];
};

// A thread's buffers for one task's query heads.
template <int L>
struct TaskScratch {
  std::vector<HeadState<L>> heads;
  int64_t scores_per_head;  // a block's tokens, rounded up to whole chunks of 16
  std::vector<float> scores;  // [heads][scores_per_head]: scores, then the softmax weights
  std::vector<float> corr;    // [heads]: this block's rescaling of each head's accumulator
  std::vector<bf16_bits> decoded;  // fp8 caches: [block_size][32L], a block's rows of a kv head

  TaskScratch(int64_t num_heads, int64_t block_size, KvFormat format)
      : heads(num_heads),
        scores_per_head((block_size + kLanes - 1) / kLanes * kLanes),
        scores(num_heads * scores_per_head),
        corr(num_heads),
        decoded(format == KvFormat::kBf16 ? 0 : block_size * L * kLineValues) {}
};

// A line of 32 bf16 values, widened exactly: its even elements (the low half of each 32-bit lane,
// shifted up) and its odd ones (the high half, the low half masked off).
inline void widen_line(const bf16_bits* p, __m512& even, __m512& odd) {
  const __m512i line = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
  odd = _mm512_castsi512_ps(
      _mm512_and_si512(line, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// p * v over `count` tokens of one chunk, from zero: tokens are dealt round-robin to S sets of
// accumulators so that S * 2L chains of FMAs run side by side (one set: each chain 16 FMAs long,
// which the FMA latency, not the arithmetic, bounds). Returns the sets' sum.
template <int L>
inline void weighted_values(const float* weights, const bf16_bits* v, int64_t stride, int count,
                            __m512 (&out)[2 * L]) {
  constexpr int S = L <= 2 ? 4 : (L <= 4 ? 2 : 1);  // at most 16 accumulators
  __m512 acc[S][2 * L];
  for (auto& set : acc) {
    for (auto& a : set) a = _mm512_setzero_ps();
  }
  const auto add_token = [&](__m512 (&set)[2 * L], int t) {
    const __m512 w = _mm512_set1_ps(weights[t]);
#pragma GCC unroll 8
    for (int l = 0; l < L; ++l) {
      __m512 even, odd;
      widen_line(v + t * stride + l * kLineValues, even, odd);
      set[2 * l] = _mm512_fmadd_ps(w, even, set[2 * l]);
      set[2 * l + 1] = _mm512_fmadd_ps(w, odd, set[2 * l + 1]);
    }
  };
  int t = 0;
  for (; t + S <= count; t += S) {
#pragma GCC unroll 4
    for (int i = 0; i < S; ++i) add_token(acc[i], t + i);
  }
  for (; t < count; ++t) add_token(acc[0], t);
  for (int i = 0; i < 2 * L; ++i) {
    out[i] = acc[0][i];
    for (int j = 1; j < S; ++j) out[i] = _mm512_add_ps(out[i], acc[j][i]);
  }
}

// The scaled scores q . k of `count` <= 16 tokens (k points at the first one's row of this kv
// head; rows `stride` apart), soft-capped where softcap > 0, in lanes 0 .. count - 1, -inf in
// the rest.
template <int L>
inline __m512 chunk_scores(const __m512bh (&q)[L], const bf16_bits* k, int64_t stride, int count,
                           float scale, float softcap) {
  __m512 part[kLanes];
#pragma GCC unroll 16
  for (int t = 0; t < kLanes; ++t) {
    part[t] = _mm512_setzero_ps();
    if (t < count) {
      for (int l = 0; l < L; ++l) {
        part[t] = _mm512_dpbf16_ps(part[t], q[l], load_pairs(k + t * stride + l * kLineValues));
      }
    }
  }
  const auto valid = static_cast<__mmask16>((1u << count) - 1);
  __m512 scores = _mm512_mul_ps(sum_each(part), _mm512_set1_ps(scale));
  if (softcap > 0.0f) {
    const __m512 cap = _mm512_set1_ps(softcap);
    scores = _mm512_mul_ps(tanh16(_mm512_div_ps(scores, cap)), cap);
  }
  return _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                            scores);
}

// Online softmax over one block's scores (`chunks` vectors of 16): raises the running max, turns
// the scores into weights e^(score - max) in place, and returns the factor e^(old max - new max)
// that the accumulator is to be scaled by. No branch: the factor is 1 when the max did not rise
// and 0 on the first block (old max = -inf).
template <int L>
inline float softmax_block(HeadState<L>& st, float* scores, int64_t chunks) {
  __m512 top = _mm512_set1_ps(st.max);
  for (int64_t c = 0; c < chunks; ++c) {
    top = _mm512_max_ps(top, _mm512_loadu_ps(scores + c * kLanes));
  }
  const float new_max = _mm512_reduce_max_ps(top);
  const float corr = _mm512_cvtss_f32(exp_nonpositive16(_mm512_set1_ps(st.max - new_max)));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 shifted =
        _mm512_sub_ps(_mm512_loadu_ps(scores + c * kLanes), _mm512_set1_ps(new_max));
    const __m512 p = exp_nonpositive16(shifted);
    _mm512_storeu_ps(scores + c * kLanes, p);
    sum = _mm512_add_ps(sum, p);
  }
  st.max = new_max;
  st.sum = st.sum * corr + _mm512_reduce_add_ps(sum);
  return corr;
}

// out[0 .. 32L) = acc * (v_scale / sum) in bf16 (round to nearest even), even and odd halves
// interleaved.
template <int L>
void store_head(const HeadState<L>& st, float v_scale, bf16_bits* out) {
  const __m512 inv = _mm512_set1_ps(v_scale / st.sum);
  for (int l = 0; l < L; ++l) {
    const __m512i even = bf16_bits_rne16(_mm512_mul_ps(_mm512_loadu_ps(st.acc[2 * l]), inv));
    const __m512i odd = bf16_bits_rne16(_mm512_mul_ps(_mm512_loadu_ps(st.acc[2 * l + 1]), inv));
    _mm512_storeu_si512(out + l * kLineValues, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
  }
}

// Bytes a cache spends on one value.
inline int64_t value_bytes(const DecodeArgs& a) { return a.kv_format == KvFormat::kBf16 ? 2 : 1; }

// Rows [0, rows) of one kv head of `cache` from value `offset` on, into L2.
inline void prefetch_rows(const DecodeArgs& a, const void* cache, int64_t offset, int64_t rows) {
  const int64_t bytes = value_bytes(a), stride = a.shape.num_kv_heads * a.shape.head_dim * bytes;
  const char* row = static_cast<const char*>(cache) + offset * bytes;
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t at = 0; at < a.shape.head_dim * bytes; at += 64) {
      _mm_prefetch(row + t * stride + at, _MM_HINT_T1);
    }
  }
}

// A block's rows of one kv head as the passes read them: bf16, `stride` values apart.
struct Rows {
  const bf16_bits* values;
  int64_t stride;
};

// Rows [0, count) of one kv head of `cache` from value `offset` on: the cache's own when bf16,
// else decoded into `decoded`.
inline Rows block_rows(const DecodeArgs& a, const void* cache, int64_t offset, int64_t count,
                       std::vector<bf16_bits>& decoded) {
  const int64_t stride = a.shape.num_kv_heads * a.shape.head_dim;
  if (a.kv_format == KvFormat::kBf16) {
    return {static_cast<const bf16_bits*>(cache) + offset, stride};
  }
  fp8_rows_to_bf16(a.kv_format, static_cast<const uint8_t*>(cache) + offset, stride, count,
                   a.shape.head_dim, decoded.data());
  return {decoded.data(), a.shape.head_dim};
}

// The first position a query at kv_len - 1 attends: a window w keeps positions >= kv_len - w.
inline int64_t first_token(const DecodeShape& s, int64_t kv_len) {
  return s.sliding_window > 0 ? std::max<int64_t>(0, kv_len - s.sliding_window) : 0;
}

// Offset in the caches of token `pos` of sequence b, kv head h.
inline int64_t row_offset(const DecodeArgs& a, int64_t b, int64_t pos, int64_t h) {
  const DecodeShape& s = a.shape;
  return cache_row_offset(a.tables[b * s.max_blocks + pos / s.block_size], pos % s.block_size, h,
                          s.block_size, s.num_kv_heads, s.head_dim);
}

// Sequence b, kv heads [h0, h1).
struct Task {
  int64_t b, h0, h1;
};

// A task reads its blocks in order, each for all the task's kv heads: unit u is block u / heads
// (counted from the first one attended), kv head u % heads. Units past the task's last one are
// those of the first block of `next`, the thread's next task. Where unit u's rows are in the
// caches (from the block's first token) and how many of them hold tokens; rows = 0: no such unit.
struct Unit {
  int64_t offset, rows;
};

inline Unit unit_rows(const DecodeArgs& a, const Task& task, const Task* next, int64_t u) {
  const DecodeShape& s = a.shape;
  const int64_t heads = task.h1 - task.h0, kv_len = a.kv_lens[task.b];
  const int64_t first_block = first_token(s, kv_len) / s.block_size;
  const int64_t units = ((kv_len + s.block_size - 1) / s.block_size - first_block) * heads;
  if (u < units) {
    const int64_t start = (first_block + u / heads) * s.block_size;
    return {row_offset(a, task.b, start, task.h0 + u % heads),
            std::min(s.block_size, kv_len - start)};
  }
  if (next == nullptr || u - units >= next->h1 - next->h0) return {0, 0};
  const int64_t next_len = a.kv_lens[next->b];
  const int64_t start = first_token(s, next_len) / s.block_size * s.block_size;
  return {row_offset(a, next->b, start, next->h0 + u - units),
          std::min(s.block_size, next_len - start)};
}

// Units are prefetched this many ahead of the one being read (measured: 1-12 alike, within noise).
constexpr int64_t kPrefetchUnits = 2;

// p * v of one block for query head j: acc = acc * corr + sum over the block's `tokens` rows of v.
template <int L>
void accumulate_head(TaskScratch<L>& scratch, int64_t j, const bf16_bits* v, int64_t stride,
                     int64_t tokens) {
  HeadState<L>& st = scratch.heads[j];
  const float* weights = scratch.scores.data() + j * scratch.scores_per_head;
  const __m512 corr = _mm512_set1_ps(scratch.corr[j]);
  __m512 acc[2 * L];
  for (int i = 0; i < 2 * L; ++i) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(st.acc[i]), corr);
  for (int64_t c = 0; c * kLanes < tokens; ++c) {
    const int count = static_cast<int>(std::min<int64_t>(kLanes, tokens - c * kLanes));
    __m512 part[2 * L];
    weighted_values<L>(weights + c * kLanes, v + c * kLanes * stride, stride, count, part);
    for (int i = 0; i < 2 * L; ++i) acc[i] = _mm512_add_ps(acc[i], part[i]);
  }
  for (int i = 0; i < 2 * L; ++i) _mm512_storeu_ps(st.acc[i], acc[i]);
}

// The same for the G query heads j0 .. j0 + G - 1 of one kv head at once: each line of v is
// widened once and feeds all G heads (2G chains of FMAs, the weight a broadcast operand), where
// accumulate_head would widen it G times. One thread, 32 query / 8 kv heads, caches warm: 16
// sequences x 64 at 256 tokens 420 -> 353 us, 4 x 128 at 1,024 tokens 761 -> 700 us, 16 x 128
// at 256 tokens alike (740-868 against 759-772 us).
template <int L, int G>
void accumulate_group_of(TaskScratch<L>& scratch, int64_t j0, const bf16_bits* v, int64_t stride,
                         int64_t tokens) {
  const float* weights[G];
  __m512 corr[G];
  for (int gi = 0; gi < G; ++gi) {
    weights[gi] = scratch.scores.data() + (j0 + gi) * scratch.scores_per_head;
    corr[gi] = _mm512_set1_ps(scratch.corr[j0 + gi]);
  }
  for (int l = 0; l < L; ++l) {
    __m512 acc[G][2];
    for (int gi = 0; gi < G; ++gi) {
      for (int half = 0; half < 2; ++half) {
        acc[gi][half] =
            _mm512_mul_ps(_mm512_loadu_ps(scratch.heads[j0 + gi].acc[2 * l + half]), corr[gi]);
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {
      __m512 even, odd;
      widen_line(v + t * stride + l * kLineValues, even, odd);
#pragma GCC unroll 8
      for (int gi = 0; gi < G; ++gi) {
        const __m512 w = _mm512_set1_ps(weights[gi][t]);
        acc[gi][0] = _mm512_fmadd_ps(w, even, acc[gi][0]);
        acc[gi][1] = _mm512_fmadd_ps(w, odd, acc[gi][1]);
      }
    }
    for (int gi = 0; gi < G; ++gi) {
      for (int half = 0; half < 2; ++half) {
        _mm512_storeu_ps(scratch.heads[j0 + gi].acc[2 * l + half], acc[gi][half]);
      }
    }
  }
}

// accumulate_group_of for groups of 2 to 8 (2G accumulators fit the registers); false for the
// others, which go head by head.
template <int L>
bool accumulate_group(TaskScratch<L>& scratch, int64_t j0, int64_t g, const bf16_bits* v,
                      int64_t stride, int64_t tokens) {
  switch (g) {
    case 2: accumulate_group_of<L, 2>(scratch, j0, v, stride, tokens); return true;
    case 3: accumulate_group_of<L, 3>(scratch, j0, v, stride, tokens); return true;
    case 4: accumulate_group_of<L, 4>(scratch, j0, v, stride, tokens); return true;
    case 5: accumulate_group_of<L, 5>(scratch, j0, v, stride, tokens); return true;
    case 6: accumulate_group_of<L, 6>(scratch, j0, v, stride, tokens); return true;
    case 7: accumulate_group_of<L, 7>(scratch, j0, v, stride, tokens); return true;
    case 8: accumulate_group_of<L, 8>(scratch, j0, v, stride, tokens); return true;
    default: return false;
  }
}

// Attention of one task's query heads; `next`: the thread's next task (nullptr: none). Per block,
// in three passes over the task's heads: scores, softmax, p * v. Each pass's per-head work is
// independent of the other heads', so the core overlaps the heads' dependency chains (within one
// head, scores -> max -> e^x -> p * v is one long chain). Done head by head, the scores and
// softmax alone took 2.9 ns per token and head on one core; 16 x 12 heads at 64 tokens on one
// thread went 80 -> 71 us with the passes.
template <int L>
void decode_task(const DecodeArgs& a, TaskScratch<L>& scratch, const Task& task, const Task* next) {
  const DecodeShape& s = a.shape;
  const int64_t b = task.b, h0 = task.h0, h1 = task.h1;
  const int64_t g = s.num_heads / s.num_kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t num_q = (h1 - h0) * g, row = scratch.scores_per_head;
  const bf16_bits* query = a.query + b * a.q_stride + h0 * g * d;
  for (int64_t j = 0; j < num_q; ++j) {
    scratch.heads[j].max = -std::numeric_limits<float>::infinity();
    scratch.heads[j].sum = 0.0f;
    std::fill_n(&scratch.heads[j].acc[0][0], 2 * L * kLanes, 0.0f);
  }
  const int64_t kv_len = a.kv_lens[b], first = first_token(s, kv_len);
  int64_t unit = 0;
  for (int64_t bi = first / bs; bi * bs < kv_len; ++bi) {
    const int64_t t0 = std::max(first, bi * bs), t1 = std::min(kv_len, (bi + 1) * bs);
    const int64_t base = row_offset(a, b, t0, h0);
    const int64_t chunks = (t1 - t0 + kLanes - 1) / kLanes;
    for (int64_t kh = 0; kh < h1 - h0; ++kh, ++unit) {
      const Unit ahead = unit_rows(a, task, next, unit + kPrefetchUnits);
      prefetch_rows(a, a.k_cache, ahead.offset, ahead.rows);
      prefetch_rows(a, a.v_cache, ahead.offset, ahead.rows);
      const Rows k = block_rows(a, a.k_cache, base + kh * d, t1 - t0, scratch.decoded);
      for (int64_t j = kh * g; j < (kh + 1) * g; ++j) {
        __m512bh q[L];
        for (int l = 0; l < L; ++l) q[l] = load_pairs(query + j * d + l * kLineValues);
        for (int64_t c = 0; c < chunks; ++c) {
          const int count = static_cast<int>(std::min<int64_t>(kLanes, t1 - t0 - c * kLanes));
          const __m512 sc = chunk_scores<L>(q, k.values + c * kLanes * k.stride, k.stride, count,
                                            s.scale, s.softcap);
          _mm512_storeu_ps(scratch.scores.data() + j * row + c * kLanes, sc);
        }
      }
    }
    for (int64_t j = 0; j < num_q; ++j) {
      scratch.corr[j] = softmax_block<L>(scratch.heads[j], scratch.scores.data() + j * row, chunks);
    }
    for (int64_t kh = 0; kh < h1 - h0; ++kh) {
      const Rows v = block_rows(a, a.v_cache, base + kh * d, t1 - t0, scratch.decoded);
      if (!accumulate_group<L>(scratch, kh * g, g, v.values, v.stride, t1 - t0)) {
        for (int64_t j = kh * g; j < (kh + 1) * g; ++j) {
          accumulate_head<L>(scratch, j, v.values, v.stride, t1 - t0);
        }
      }
    }
  }
  bf16_bits* out = a.out + (b * s.num_heads + h0 * g) * d;
  for (int64_t j = 0; j < num_q; ++j) store_head<L>(scratch.heads[j], a.v_scale, out + j * d);
}

template <int L>
void decode_all(const DecodeArgs& a) {
  const DecodeShape& s = a.shape;
  const int64_t per_task = kv_heads_per_task(a.batch, s.num_kv_heads);
  const int64_t tasks_per_seq = (s.num_kv_heads + per_task - 1) / per_task;
  const int64_t g = s.num_heads / s.num_kv_heads;
  const auto task_at = [&](int64_t i) {
    const int64_t h0 = i % tasks_per_seq * per_task;
    return Task{i / tasks_per_seq, h0, std::min(s.num_kv_heads, h0 + per_task)};
  };
  at::parallel_for(0, a.batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    TaskScratch<L> scratch(per_task * g, s.block_size, a.kv_format);
    for (int64_t i = begin; i < end; ++i) {
      const Task next = task_at(i + 1);
      decode_task<L>(a, scratch, task_at(i), i + 1 < end ? &next : nullptr);
    }
  });
}

}  // namespace

void paged_decode_bf16_avx512(const DecodeArgs& args) {
  switch (args.shape.head_dim / kLineValues) {
    case 1: return decode_all<1>(args);
    case 2: return decode_all<2>(args);
    case 3: return decode_all<3>(args);
    case 4: return decode_all<4>(args);
    case 5: return decode_all<5>(args);
    case 6: return decode_all<6>(args);
    case 7: return decode_all<7>(args);
    default: return decode_all<8>(args);
  }
}

}  // namespace tgq_cpu
