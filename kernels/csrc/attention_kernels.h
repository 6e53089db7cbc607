// Paged decode attention, as paged_attention.cpp dispatches it between ISAs: the shape of a call,
// how it is split into tasks, and the AVX-512 kernel's entry point.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

// Cache layout: k_cache[block_id, offset, kv_head, :] holds token block_index * block_size + offset
// of the sequence whose block table has block_id at block_index.
struct DecodeShape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t sliding_window;  // 0 = attend to the whole sequence
  float scale;
  float softcap;  // > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2)
};

// How the AVX-512 kernels' KV cache holds its values: bf16, or FP8 bytes (E4M3 or E5M2), each
// standing for its value times the cache's scale (one fp32 scale per cache tensor).
enum class KvFormat { kBf16, kFp8E4M3, kFp8E5M2 };

// One call with a bf16 query, checked: tables [batch, max_blocks] and kv_lens [batch] int64,
// every block id a sequence reads inside the cache. An fp8 cache's scales are applied in fp32,
// outside the sums: shape.scale is the score scale times k_scale, and v_scale multiplies each
// output (acc * (v_scale / sum)); with both 1 the arithmetic is the bf16 kernel's on the decoded
// values, step for step.
struct DecodeArgs {
  DecodeShape shape;
  int64_t batch;
  int64_t q_stride;  // elements between sequences' query rows (a view of the fused qkv is fine)
  const bf16_bits* query;
  KvFormat kv_format;
  const void* k_cache;  // bf16_bits or FP8 bytes, as kv_format says
  const void* v_cache;
  float v_scale;
  const int64_t* tables;
  const int64_t* kv_lens;
  bf16_bits* out;  // [batch, num_heads, head_dim], contiguous
};

// A task is one sequence and a run of its kv heads (with all their query heads, so each K/V row is
// read from memory once): whole sequences when there are enough of them to keep every thread busy,
// so each block is read as one contiguous span; else the kv heads are split.
inline int64_t kv_heads_per_task(int64_t batch, int64_t num_kv_heads) {
  constexpr int64_t kTasksPerThread = 4;
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  const int64_t splits = std::min(num_kv_heads, (wanted + batch - 1) / batch);
  return (num_kv_heads + splits - 1) / splits;
}

// The head sizes the AVX-512 kernels (decode and prefill) serve: one or more whole 64-byte lines
// of bf16, up to 256 values. With bf16 and cpu_has_avx512_bf16(), avx512_attention_serves (paged_attention.cpp,
// also an op for the Python backend) is this rule.
inline bool avx512_attention_supports(int64_t head_dim) {
  return head_dim > 0 && head_dim % 32 == 0 && head_dim <= 256;
}

// Where row `offset` of cache block `block_id`, kv head h, starts in a [num_blocks, block_size,
// num_kv_heads, head_dim] cache.
inline int64_t cache_row_offset(int64_t block_id, int64_t offset, int64_t h, int64_t block_size,
                                int64_t num_kv_heads, int64_t head_dim) {
  return ((block_id * block_size + offset) * num_kv_heads + h) * head_dim;
}

// Requires cpu_has_avx512_bf16() (linear_kernels.h) and avx512_attention_supports(head_dim);
// with an fp8 cache, cpu_has_avx512_8bit_linear() too.
void paged_decode_bf16_avx512(const DecodeArgs& args);

// num_rows rows of row_values (a multiple of 32) FP8 E4M3 bytes, `stride` bytes apart, decoded to
// bf16 (exactly: every E4M3 value is a bf16 value) into contiguous rows at out. Requires
// cpu_has_avx512_8bit_linear() (AVX512_BF16 and AVX512_VBMI, as the 8-bit linear's decoding).
void e4m3_rows_to_bf16(const uint8_t* rows, int64_t stride, int64_t num_rows, int64_t row_values,
                       bf16_bits* out);

// The same for FP8 E5M2 bytes (each the high byte of an fp16: widened by vcvtph2ps, exact).
void e5m2_rows_to_bf16(const uint8_t* rows, int64_t stride, int64_t num_rows, int64_t row_values,
                       bf16_bits* out);

// e4m3_rows_to_bf16 or e5m2_rows_to_bf16, as `format` (an fp8 one) says.
void fp8_rows_to_bf16(KvFormat format, const uint8_t* rows, int64_t stride, int64_t num_rows,
                      int64_t row_values, bf16_bits* out);

// One sequence's prefill chunk: its num_queries new tokens, at positions kv_len - num_queries ..
// kv_len - 1, attend causally (and within the window) to its first kv_len tokens, whose K/V are
// already in the cache. bf16; checked by the caller.
struct PrefillArgs {
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int64_t num_queries, kv_len;
  int64_t sliding_window;  // 0 = attend to the whole sequence
  float scale;
  float v_scale;  // each output is acc * (v_scale / sum): an fp8 cache's scale for V, else 1
  const bf16_bits* query;  // [num_queries, num_heads, head_dim], tokens q_stride apart
  int64_t q_stride;
  const bf16_bits* k_cache;
  const bf16_bits* v_cache;
  const int64_t* block_ids;  // the sequence's blocks, enough for kv_len tokens
  bf16_bits* out;  // [num_queries, num_heads, head_dim], contiguous
};

// Requires cpu_has_avx512_bf16() and avx512_attention_supports(head_dim).
void paged_prefill_bf16_avx512(const PrefillArgs& args);

// The same on AMX tiles: requires cpu_has_amx_bf16() (linear_kernels.h) too.
void paged_prefill_bf16_amx(const PrefillArgs& args);

}  // namespace tgq_cpu
