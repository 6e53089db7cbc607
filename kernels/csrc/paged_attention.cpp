// paged_decode_attention: one query token per sequence against a paged KV cache, read through the
// block table (no gather copy), fp32 math on bf16 or fp32 data; here the AVX2 kernel, which serves
// every CPU, head size and dtype, and the dispatch to the AVX-512 one (attention_avx512.cpp).
// paged_prefill_attention: the checks in front of prefill_avx512.cpp's kernel.
//
// Both also take FP8 caches, E4M3 or E5M2, beside a bf16 query (a byte stands for its FP8 value
// times the cache's fp32 scale): the AVX-512 kernels where fp8_kv_attention_serves, and decode's AVX2
// kernel on any CPU (it decodes each block to fp32 first, below).
#include "attention_kernels.h"
#include "linear_kernels.h"

#include <type_traits>

namespace {

using namespace tgq_cpu;

// ----------------------------------------------------------------------------------------------
// paged_decode_attention, AVX2
//
// One task handles one sequence and a run of its kv heads (kv_heads_per_task), with all
// G = H / Hkv query heads of each, so each K/V row is read from memory once and reused G times.
// Softmax is online at block granularity: per block, compute the scores, raise the running max
// once, rescale the accumulator once, then add p * v.

template <typename T>
float dot_row(const float* q, const T* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kVec <= d; i += kVec) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += q[i] * to_f32(k[i]);
  return s;
}

// The 8 horizontal sums of a[0..7], as one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 quads0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 quads1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // quadsN lanes: sums of elements 0-3 of a[4N..4N+3], then of elements 4-7.
  return _mm256_add_ps(_mm256_permute2f128_ps(quads0, quads1, 0x20),
                       _mm256_permute2f128_ps(quads0, quads1, 0x31));
}

// scores[t] = q . k[t * stride], eight tokens at a time so their FMA chains overlap.
template <typename T>
void block_scores(const float* q, const T* k, int64_t stride, int64_t num_tokens, int64_t d,
                  float* scores) {
  int64_t t = 0;
  for (; t + kVec <= num_tokens && d % kVec == 0; t += kVec) {
    __m256 acc[kVec];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += kVec) {
      const __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
      for (int j = 0; j < kVec; ++j) {
        acc[j] = _mm256_fmadd_ps(qv, load8(k + (t + j) * stride + i), acc[j]);
      }
    }
    _mm256_storeu_ps(scores + t, hsum8(acc));
  }
  for (; t < num_tokens; ++t) scores[t] = dot_row(q, k + t * stride, d);
}

// scores[t] = e^(scores[t] - max)
void exp_shifted(float* scores, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  int64_t t = 0;
  for (; t + kVec <= n; t += kVec) {
    _mm256_storeu_ps(scores + t, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), m)));
  }
  for (; t < n; ++t) scores[t] = std::exp(scores[t] - max);
}

void scale_row(float* acc, float c, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] *= c;
}

// acc[i:] += sum_t p[t] * v[t * stride + i:] over slices of S vectors that fit in d, each slice
// held in registers across the tokens; returns where the slices stopped.
template <int S, typename T>
int64_t add_weighted_slices(float* acc, const float* p, const T* v, int64_t stride,
                            int64_t num_tokens, int64_t i, int64_t d) {
  for (; i + S * kVec <= d; i += S * kVec) {
    __m256 a[S];
    for (int j = 0; j < S; ++j) a[j] = _mm256_loadu_ps(acc + i + j * kVec);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const __m256 pv = _mm256_set1_ps(p[t]);
#pragma GCC unroll 8
      for (int j = 0; j < S; ++j) {
        a[j] = _mm256_fmadd_ps(pv, load8(v + t * stride + i + j * kVec), a[j]);
      }
    }
    for (int j = 0; j < S; ++j) _mm256_storeu_ps(acc + i + j * kVec, a[j]);
  }
  return i;
}

// acc += sum_t p[t] * v[t * stride]: 8 vectors of acc per pass (8 independent FMA chains), then
// single vectors, then the d % 8 tail.
template <typename T>
void add_weighted_rows(float* acc, const float* p, const T* v, int64_t stride,
                       int64_t num_tokens, int64_t d) {
  int64_t i = add_weighted_slices<8>(acc, p, v, stride, num_tokens, 0, d);
  i = add_weighted_slices<1>(acc, p, v, stride, num_tokens, i, d);
  for (; i < d; ++i) {
    for (int64_t t = 0; t < num_tokens; ++t) acc[i] += p[t] * to_f32(v[t * stride + i]);
  }
}

// Per-thread buffers for one task: Q query heads (kv heads h0 .. h1 - 1 times G).
struct HeadState {
  std::vector<float> q;         // [Q, D], pre-scaled
  std::vector<float> acc;       // [Q, D], sum of p * v under the running max
  std::vector<float> scores;    // [Q, block_size]
  std::vector<float> max, sum;  // [Q], running max score and sum of p
  std::vector<float> k_rows, v_rows;  // fp8 caches: [block_size, kv heads of the task, D]
};

// An FP8 cache's bytes, as the AVX2 kernel reads them (decode_task's C): E4M3, or E5M2 (a type
// of its own, so that the two decode differently).
using e4m3_byte = uint8_t;
struct e5m2_byte {
  uint8_t bits;
};

// ----------------------------------------------------------------------------------------------
// FP8 E4M3 -> fp32 for the AVX2 kernel. A byte s.eeee.mmm, sign-extended to 16 bits and shifted
// left by 7 with bit 14 cleared, is the fp16 s.0eeee.mmm0000000 (exponent bias 15 against 7), whose
// value is exactly the byte's times 2^-8, subnormals included; F16C widens it exactly (it takes
// fp16 subnormals whatever MXCSR's DAZ says), and the 2^8 rides in the scales (decode_dispatch).
// E4M3's NaN (magnitude 0x7F) gets fp16's all-ones exponent. 16 values: ~12 instructions.
constexpr float kE4m3Unscale = 256.0f;  // decoded value * 256 = the byte's E4M3 value

__attribute__((target("f16c"))) inline float e4m3_scaled_f32(e4m3_byte byte) {
  uint16_t half = static_cast<uint16_t>((static_cast<int16_t>(static_cast<int8_t>(byte)) << 7) &
                                        0xBFFF);
  if ((half & 0x3F80) == 0x3F80) half |= 0x7C00;
  return _cvtsh_ss(half);
}

// num_rows rows of row_values bytes, `stride` bytes apart -> contiguous rows of fp32 at out,
// each the byte's value times 2^-8.
__attribute__((target("f16c"))) void e4m3_rows_to_scaled_f32(const e4m3_byte* rows,
                                                              int64_t stride, int64_t num_rows,
                                                              int64_t row_values, float* out) {
  const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
  const __m256i magnitude = _mm256_set1_epi16(0x3F80);
  const __m256i all_ones_exponent = _mm256_set1_epi16(0x7C00);
  for (int64_t r = 0; r < num_rows; ++r, out += row_values) {
    const e4m3_byte* row = rows + r * stride;
    int64_t i = 0;
    for (; i + 16 <= row_values; i += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
      __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), keep);
      const __m256i is_nan = _mm256_cmpeq_epi16(_mm256_and_si256(half, magnitude), magnitude);
      half = _mm256_or_si256(half, _mm256_and_si256(is_nan, all_ones_exponent));
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_castsi256_si128(half)));
      _mm256_storeu_ps(out + i + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)));
    }
    for (; i < row_values; ++i) out[i] = e4m3_scaled_f32(row[i]);
  }
}

// FP8 E5M2 -> fp32 for the AVX2 kernel: each byte is the high byte of the fp16 with its value,
// which F16C widens exactly (no factor to undo, unlike E4M3's 2^-8).
__attribute__((target("f16c"))) void e5m2_rows_to_scaled_f32(const e5m2_byte* rows,
                                                              int64_t stride, int64_t num_rows,
                                                              int64_t row_values, float* out) {
  for (int64_t r = 0; r < num_rows; ++r, out += row_values) {
    const auto* row = reinterpret_cast<const uint8_t*>(rows + r * stride);
    int64_t i = 0;
    for (; i + 16 <= row_values; i += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
      const __m256i half = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_castsi256_si128(half)));
      _mm256_storeu_ps(out + i + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)));
    }
    for (; i < row_values; ++i) out[i] = _cvtsh_ss(static_cast<uint16_t>(row[i] << 8));
  }
}

struct BlockSpan {
  int64_t num_tokens;  // tokens of the block to attend, from the first one k and v point at
  int64_t num_kv_heads;  // of the task; k and v point at the first one
  int64_t group;  // query heads per kv head
  int64_t row_stride;  // elements between consecutive tokens of a block
  int64_t head_dim;
  int64_t block_size;  // stride of st.scores rows
  float softcap;  // > 0: scores soft-capped (DecodeShape)
};

// Folds one block's tokens into the state of all the task's query heads. Tokens are visited in
// groups of 8 and, per group, every head of the task: the group's rows for those heads are
// contiguous, so the block is read front to back (once for K, once for V).
template <typename T>
void attend_block(HeadState& st, const BlockSpan& b, const T* k, const T* v) {
  const int64_t d = b.head_dim, num_q = b.num_kv_heads * b.group;
  for (int64_t t = 0; t < b.num_tokens; t += kVec) {
    const int64_t n = std::min(kVec, b.num_tokens - t);
    for (int64_t j = 0; j < num_q; ++j) {
      block_scores(st.q.data() + j * d, k + t * b.row_stride + j / b.group * d, b.row_stride, n,
                   d, st.scores.data() + j * b.block_size + t);
    }
  }
  for (int64_t j = 0; j < num_q; ++j) {
    float* scores = st.scores.data() + j * b.block_size;
    if (b.softcap > 0.0f) {
      for (int64_t t = 0; t < b.num_tokens; ++t) {
        scores[t] = std::tanh(scores[t] / b.softcap) * b.softcap;
      }
    }
    const float new_max = std::max(st.max[j], *std::max_element(scores, scores + b.num_tokens));
    if (new_max > st.max[j]) {
      const float corr = std::exp(st.max[j] - new_max);  // 0 on the first block (max = -inf)
      scale_row(st.acc.data() + j * d, corr, d);
      st.sum[j] *= corr;
      st.max[j] = new_max;
    }
    exp_shifted(scores, b.num_tokens, new_max);
    st.sum[j] += std::accumulate(scores, scores + b.num_tokens, 0.0f);
  }
  for (int64_t t = 0; t < b.num_tokens; t += kVec) {
    const int64_t n = std::min(kVec, b.num_tokens - t);
    for (int64_t j = 0; j < num_q; ++j) {
      add_weighted_rows(st.acc.data() + j * d, st.scores.data() + j * b.block_size + t,
                        v + t * b.row_stride + j / b.group * d, b.row_stride, n, d);
    }
  }
}

// One sequence, kv heads h0 .. h1 - 1 (query heads h0 * G .. h1 * G - 1); query and out point at
// the sequence's [H, D] rows. C is the caches' element: T, or e4m3_byte, whose block rows of the
// task's heads are decoded to fp32 once (into st.k_rows, st.v_rows) before the G query heads
// read them; each output is acc * (v_scale / sum).
template <typename T, typename C>
void decode_task(const DecodeShape& s, HeadState& st, const T* query, const C* k_cache,
                 const C* v_cache, const int64_t* table, int64_t kv_len, int64_t h0, int64_t h1,
                 float v_scale, T* out) {
  const int64_t g = s.num_heads / s.num_kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t row_stride = s.num_kv_heads * d;  // between tokens of one block
  const int64_t num_q = (h1 - h0) * g;
  for (int64_t i = 0; i < num_q * d; ++i) st.q[i] = to_f32(query[h0 * g * d + i]) * s.scale;
  std::fill_n(st.acc.begin(), num_q * d, 0.0f);
  std::fill_n(st.max.begin(), num_q, -std::numeric_limits<float>::infinity());
  std::fill_n(st.sum.begin(), num_q, 0.0f);
  // The query sits at position kv_len - 1; a window w keeps keys at positions >= kv_len - w.
  const int64_t first = s.sliding_window > 0 ? std::max<int64_t>(0, kv_len - s.sliding_window) : 0;
  for (int64_t bi = first / bs; bi * bs < kv_len; ++bi) {
    const int64_t t0 = std::max(first, bi * bs), t1 = std::min(kv_len, (bi + 1) * bs);
    const int64_t base = ((table[bi] * bs + (t0 - bi * bs)) * s.num_kv_heads + h0) * d;
    if constexpr (!std::is_same_v<C, T>) {
      const int64_t width = (h1 - h0) * d;  // the task's heads of one token are contiguous
      if constexpr (std::is_same_v<C, e5m2_byte>) {
        e5m2_rows_to_scaled_f32(k_cache + base, row_stride, t1 - t0, width, st.k_rows.data());
        e5m2_rows_to_scaled_f32(v_cache + base, row_stride, t1 - t0, width, st.v_rows.data());
      } else {
        e4m3_rows_to_scaled_f32(k_cache + base, row_stride, t1 - t0, width, st.k_rows.data());
        e4m3_rows_to_scaled_f32(v_cache + base, row_stride, t1 - t0, width, st.v_rows.data());
      }
      attend_block(st, BlockSpan{t1 - t0, h1 - h0, g, width, d, bs, s.softcap},
                   st.k_rows.data(), st.v_rows.data());
    } else {
      attend_block(st, BlockSpan{t1 - t0, h1 - h0, g, row_stride, d, bs, s.softcap},
                   k_cache + base, v_cache + base);
    }
  }
  for (int64_t j = 0; j < num_q; ++j) {
    const float inv = v_scale / st.sum[j];
    for (int64_t i = 0; i < d; ++i) store_out(out + (h0 * g + j) * d + i, st.acc[j * d + i] * inv);
  }
}

// C: the caches' element (decode_task); v_scale 1 but for fp8 caches.
template <typename T, typename C = T>
void decode_dispatch(const DecodeShape& s, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& tables,
                     const at::Tensor& kv_lens, float v_scale, at::Tensor& out) {
  const int64_t batch = query.size(0), g = s.num_heads / s.num_kv_heads, d = s.head_dim;
  const int64_t q_stride = query.stride(0);  // a view of the fused qkv rows is fine
  const int64_t per_task = kv_heads_per_task(batch, s.num_kv_heads);
  const int64_t tasks_per_seq = (s.num_kv_heads + per_task - 1) / per_task;
  const T* q = data_as<T>(query);
  const C* k = data_as<C>(k_cache);
  const C* v = data_as<C>(v_cache);
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  T* o = mutable_data_as<T>(out);
  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t num_q = per_task * g;
    const int64_t decoded = std::is_same_v<C, T> ? 0 : s.block_size * per_task * d;
    HeadState st{std::vector<float>(num_q * d),       std::vector<float>(num_q * d),
                 std::vector<float>(num_q * s.block_size), std::vector<float>(num_q),
                 std::vector<float>(num_q),           std::vector<float>(decoded),
                 std::vector<float>(decoded)};
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, h0 = task % tasks_per_seq * per_task;
      const int64_t h1 = std::min(s.num_kv_heads, h0 + per_task);
      decode_task<T, C>(s, st, q + b * q_stride, k, v, tab + b * s.max_blocks, lens[b], h0,
                        h1, v_scale, o + b * s.num_heads * d);
    }
  });
}

// Every block id a sequence will read must index the cache: checked up front, not in the loop.
void check_block_tables(const at::Tensor& tables, const at::Tensor& kv_lens, int64_t block_size,
                        int64_t num_blocks) {
  const int64_t batch = tables.size(0), max_blocks = tables.size(1);
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    int64_t used = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(lens[b] >= 1 && used <= max_blocks, "paged_decode_attention: kv_lens[", b,
                "] = ", lens[b], " must be in [1, ", max_blocks * block_size, "]");
    for (int64_t i = 0; i < used; ++i) {
      TORCH_CHECK(tab[b * max_blocks + i] >= 0 && tab[b * max_blocks + i] < num_blocks,
                  "paged_decode_attention: block_tables[", b, ", ", i, "] = ",
                  tab[b * max_blocks + i], " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

// Whether the AVX-512 attention kernels serve this dtype and head size on this CPU.
bool avx512_attention_serves(at::ScalarType dtype, int64_t head_dim) {
  return dtype == at::kBFloat16 && cpu_has_avx512_bf16() && avx512_attention_supports(head_dim);
}

// Whether they take FP8 E4M3 caches (with a bf16 query) of this head size on this CPU: the
// 8-bit linear's ISA (AVX512_BF16 and AVX512_VBMI) decodes the bytes.
bool fp8_kv_attention_serves(int64_t head_dim) {
  return cpu_has_avx512_8bit_linear() && avx512_attention_supports(head_dim);
}

// "auto": the AVX-512 kernel where it serves the call, else AVX2; "avx2" and "avx512" name one
// (tests check each). Both read fp8 caches (AVX2: with F16C, which every AVX2 CPU has).
bool use_avx512(std::string_view path, const at::Tensor& query, bool fp8_cache) {
  TORCH_CHECK(path == "auto" || path == "avx2" || path == "avx512",
              "paged_decode_attention: unknown path '", path, "' (auto, avx2, avx512)");
  if (fp8_cache) {
    const bool served = fp8_kv_attention_serves(query.size(2));
    TORCH_CHECK(path != "avx512" || served, "paged_decode_attention: path 'avx512' reads fp8 "
                "caches on a CPU with AVX512_BF16 and AVX512_VBMI and a head size that is a "
                "multiple of 32 up to 256, got ", query.size(2), " (fp8_kv_attention_serves)");
    TORCH_CHECK(served || __builtin_cpu_supports("f16c"), "paged_decode_attention: path 'avx2' "
                "reads fp8 caches on a CPU with F16C");
    return path == "auto" ? served : path == "avx512";
  }
  const bool served = avx512_attention_serves(query.scalar_type(), query.size(2));
  if (path == "auto") return served;
  if (path == "avx2") return false;
  TORCH_CHECK(served, "paged_decode_attention: path 'avx512' needs bf16, a CPU with AVX512_BF16 "
              "and a head size that is a multiple of 32 up to 256, got ", query.scalar_type(),
              " and ", query.size(2));
  return true;
}

// The caches' dtypes against the query's: all bf16 or all fp32, or fp8 (E4M3 or E5M2) caches and
// a bf16 query. The caches' format (kBf16 for any non-fp8 one); fp8 caches' scales must be finite
// and positive, other caches take none (scales 1).
KvFormat check_cache_dtypes(const char* op, const at::Tensor& query, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, double k_scale, double v_scale) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), op,
              ": k_cache and v_cache must share a dtype, got ", k_cache.scalar_type(), " and ",
              v_cache.scalar_type());
  const KvFormat format = k_cache.scalar_type() == at::kFloat8_e4m3fn   ? KvFormat::kFp8E4M3
                          : k_cache.scalar_type() == at::kFloat8_e5m2 ? KvFormat::kFp8E5M2
                                                                      : KvFormat::kBf16;
  if (format != KvFormat::kBf16) {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, op,
                ": fp8 caches need a bf16 query, got ", query.scalar_type());
    TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
                op, ": k_scale and v_scale must be finite and > 0, got ", k_scale, " and ",
                v_scale);
  } else {
    TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), op,
                ": query, k_cache and v_cache must share a dtype (or the caches be "
                "float8_e4m3fn or float8_e5m2 beside a bf16 query)");
    TORCH_CHECK(k_scale == 1.0 && v_scale == 1.0, op,
                ": k_scale and v_scale apply to fp8 caches only, got ", k_scale, " and ",
                v_scale, " for ", k_cache.scalar_type(), " caches");
  }
  return format;
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& kv_lens, double scale,
                                  int64_t sliding_window, double softcap,
                                  c10::string_view path_arg, double k_scale, double v_scale) {
  const std::string_view path(path_arg.data(), path_arg.size());
  TORCH_CHECK(query.dim() == 3, "paged_decode_attention: query must be [B, H, D], got ",
              query.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: k_cache and v_cache must both be "
              "[num_blocks, block_size, Hkv, D], got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "paged_decode_attention: head_dim mismatch, query ", d,
              " vs cache ", k_cache.size(3));
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode_attention: ", heads,
              " query heads is not a multiple of ", kv_heads, " kv heads");
  const KvFormat format =
      check_cache_dtypes("paged_decode_attention", query, k_cache, v_cache, k_scale, v_scale);
  const bool fp8 = format != KvFormat::kBf16;
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat,
              "paged_decode_attention: dtype must be bf16 or fp32, got ", query.scalar_type());
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && kv_lens.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == d,
              "paged_decode_attention: each query row's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: k_cache and v_cache must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch,
              "paged_decode_attention: block_tables must be [", batch, ", max_blocks], got ",
              block_tables.sizes());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt || block_tables.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables must be int32 or int64");
  TORCH_CHECK(kv_lens.dim() == 1 && kv_lens.size(0) == batch,
              "paged_decode_attention: kv_lens must be [", batch, "], got ", kv_lens.sizes());
  TORCH_CHECK(sliding_window >= 0, "paged_decode_attention: sliding_window must be >= 0");
  TORCH_CHECK(softcap >= 0.0, "paged_decode_attention: softcap must be >= 0 (0: none)");
  at::Tensor tables = block_tables.to(at::kLong).contiguous();
  at::Tensor lens = kv_lens.to(at::kLong).contiguous();
  check_block_tables(tables, lens, k_cache.size(1), k_cache.size(0));
  // k_scale multiplies the score scale in fp32 (exact, so the same scores, where k_scale is a
  // power of two; 1 leaves them the bf16 kernel's).
  const float score_scale = static_cast<float>(scale) * static_cast<float>(k_scale);
  DecodeShape shape{heads, kv_heads, d, k_cache.size(1), tables.size(1), sliding_window,
                    score_scale, static_cast<float>(softcap)};
  at::Tensor out = at::empty(query.sizes(), query.options());  // contiguous, whatever query is
  if (use_avx512(path, query, fp8)) {
    paged_decode_bf16_avx512(DecodeArgs{
        shape, batch, query.stride(0), data_as<bf16_bits>(query),
        format, k_cache.data_ptr(), v_cache.data_ptr(),
        static_cast<float>(v_scale), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
        mutable_data_as<bf16_bits>(out)});
  } else if (format == KvFormat::kFp8E5M2) {
    decode_dispatch<bf16_bits, e5m2_byte>(shape, query, k_cache, v_cache, tables, lens,
                                          static_cast<float>(v_scale), out);
  } else if (fp8) {
    // The AVX2 kernel's decoded E4M3 values are the bytes' times 2^-8: the scales take the 2^8
    // (exactly, so the sums are those of the bf16 kernel on `cache.to(bf16) * scale`).
    shape.scale *= kE4m3Unscale;
    decode_dispatch<bf16_bits, e4m3_byte>(shape, query, k_cache, v_cache, tables, lens,
                                          static_cast<float>(v_scale) * kE4m3Unscale, out);
  } else if (query.scalar_type() == at::kFloat) {
    decode_dispatch<float>(shape, query, k_cache, v_cache, tables, lens, 1.0f, out);
  } else {
    decode_dispatch<bf16_bits>(shape, query, k_cache, v_cache, tables, lens, 1.0f, out);
  }
  return out;
}

// ----------------------------------------------------------------------------------------------
// paged_prefill_attention: one sequence's prefill chunk (attention_avx512's companion,
// prefill_avx512.cpp); bf16 on AVX512_BF16 CPUs only; the torch backend serves every other case.

// The `used` blocks of an fp8 cache that block_ids names, decoded to bf16 into a cache of their
// own (block i: block_ids[i]'s values). The prefill kernels read each K row once per tile of 16
// queries (and AMX's copy of the keys is bf16 anyway): decoding once per call costs one pass
// over the sequence's bytes, beside a chunk's compute.
at::Tensor decoded_blocks(const at::Tensor& cache, KvFormat format, const int64_t* block_ids,
                          int64_t used) {
  const int64_t block_values = cache.size(1) * cache.size(2) * cache.size(3);
  at::Tensor out = at::empty({used, cache.size(1), cache.size(2), cache.size(3)},
                             cache.options().dtype(at::kBFloat16));
  const auto* bytes = static_cast<const uint8_t*>(cache.data_ptr());
  bf16_bits* values = mutable_data_as<bf16_bits>(out);
  at::parallel_for(0, used, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      fp8_rows_to_bf16(format, bytes + block_ids[i] * block_values, block_values, 1,
                       block_values, values + i * block_values);
    }
  });
  return out;
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_ids,
                                   int64_t kv_len, double scale, int64_t sliding_window,
                                   c10::string_view kernel_arg, double k_scale, double v_scale) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "paged_prefill_attention: needs a CPU with AVX512_BF16");
  const std::string_view kernel(kernel_arg.data(), kernel_arg.size());
  TORCH_CHECK(kernel == "avx512" || kernel == "amx", "paged_prefill_attention: unknown kernel '",
              kernel, "' (avx512, amx)");
  TORCH_CHECK(kernel != "amx" || cpu_has_amx_bf16(), "paged_prefill_attention: kernel 'amx' "
              "needs a CPU with AMX-BF16 that Linux lets us use");
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && query.device().is_cpu(),
              "paged_prefill_attention: query must be a [Q, H, D] bf16 CPU tensor");
  const int64_t num_queries = query.size(0), heads = query.size(1), d = query.size(2);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == d,
              "paged_prefill_attention: each query row's heads must be contiguous");
  TORCH_CHECK(avx512_attention_supports(d), "paged_prefill_attention: head size must be a multiple "
              "of 32 up to 256, got ", d);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu() && k_cache.size(3) == d,
              "paged_prefill_attention: k_cache and v_cache must both be contiguous CPU "
              "[num_blocks, block_size, Hkv, ", d, "], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  const KvFormat format =
      check_cache_dtypes("paged_prefill_attention", query, k_cache, v_cache, k_scale, v_scale);
  const bool fp8 = format != KvFormat::kBf16;
  TORCH_CHECK(!fp8 || cpu_has_avx512_8bit_linear(), "paged_prefill_attention: fp8 caches need "
              "a CPU with AVX512_VBMI (fp8_kv_attention_serves)");
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_prefill_attention: ", heads,
              " query heads is not a multiple of ", kv_heads, " kv heads");
  TORCH_CHECK(num_queries >= 1 && num_queries <= kv_len, "paged_prefill_attention: ",
              num_queries, " queries must be in [1, kv_len = ", kv_len, "]");
  TORCH_CHECK(sliding_window >= 0, "paged_prefill_attention: sliding_window must be >= 0");
  const int64_t used = (kv_len + block_size - 1) / block_size;
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong &&
                  block_ids.device().is_cpu() && block_ids.size(0) >= used,
              "paged_prefill_attention: block_ids must be int64 on the CPU with at least ", used,
              " entries, got ", block_ids.sizes(), " ", block_ids.scalar_type());
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < used; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < k_cache.size(0), "paged_prefill_attention: block_ids[",
                i, "] = ", id[i], " is outside the cache's ", k_cache.size(0), " blocks");
  }
  // fp8: the kernels read the decoded blocks, in order (block i is the sequence's block i).
  const at::Tensor keys = fp8 ? decoded_blocks(k_cache, format, id, used) : k_cache;
  const at::Tensor values = fp8 ? decoded_blocks(v_cache, format, id, used) : v_cache;
  std::vector<int64_t> in_order(fp8 ? used : 0);
  std::iota(in_order.begin(), in_order.end(), 0);
  at::Tensor out = at::empty({num_queries, heads, d}, query.options());
  // k_scale multiplies the score scale in fp32, as paged_decode_attention does.
  const float score_scale = static_cast<float>(scale) * static_cast<float>(k_scale);
  (kernel == "amx" ? paged_prefill_bf16_amx : paged_prefill_bf16_avx512)(PrefillArgs{
      heads, kv_heads, d, block_size, num_queries, kv_len, sliding_window, score_scale,
      static_cast<float>(v_scale), data_as<bf16_bits>(query), query.stride(0),
      data_as<bf16_bits>(keys), data_as<bf16_bits>(values), fp8 ? in_order.data() : id,
      mutable_data_as<bf16_bits>(out)});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def("attention_avx512_serves(ScalarType dtype, int head_dim) -> bool",
        &avx512_attention_serves);
  m.def("fp8_kv_attention_serves(int head_dim) -> bool", &fp8_kv_attention_serves);
  m.def(
      "paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_ids, "
      "int kv_len, float scale, int sliding_window, str kernel='avx512', float k_scale=1.0, "
      "float v_scale=1.0) -> Tensor",
      &paged_prefill_attention);
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor kv_lens, float scale, int sliding_window, float softcap=0.0, str path='auto', "
      "float k_scale=1.0, float v_scale=1.0) -> Tensor",
      &paged_decode_attention);
}
