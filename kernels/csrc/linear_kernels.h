// The bf16-weight linear kernels that linear_bf16.cpp dispatches between, per ISA.
#pragma once

#include "avx2_common.h"

namespace tgq_cpu {

// Weights packed for the AVX-512 kernel: tiles of kPackColumns output columns, [ceil(N / 16)]
// [ceil(K / 2)][16][2] bf16, i.e. for each tile and pair of K values the 16 columns' two values
// side by side. w[n, k] sits at ((n / 16 * ceil(K / 2) + k / 2) * 16 + n % 16) * 2 + k % 2; the
// padding past N and K is zeros.
constexpr int kPackColumns = 16;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// out[M, N] = x[M, K] @ w[N, K]^T + bias, w packed.
struct PackedLinear {
  const bf16_bits* x;  // [M, x_stride] with x_stride = 2 * ceil(K / 2), zeros past K
  const bf16_bits* w;  // packed
  const float* bias;   // [N] or nullptr
  int64_t M, N, x_stride;
  bf16_bits* out;    // [M, N] bf16, or nullptr when out_f32 is set
  float* out_f32;    // [M, N]: the bf16-rounded results widened to fp32 (logits), or nullptr
  const float* scale = nullptr;  // [N]: each column's sums times it before the bias (8-bit weights)
};

// True on CPUs with AVX512F/BW/VL and AVX512_BF16 (vdpbf16ps); checked once.
bool cpu_has_avx512_bf16();

// Requires cpu_has_avx512_bf16(); any M (decode steps and prefill chunks).
void linear_bf16_packed_avx512(const PackedLinear& args);

// The experts of a sparse mixture-of-experts block with SiLU MLPs, weights packed and stacked:
// out[t] = sum over token t's k choices, in expert order, of bf16(expert(x[t]) * weight), each
// partial sum rounded to bf16 (as index_add_ adds them expert by expert); expert(v) =
// down(bf16(silu(gate)) * up) with [gate, up] = gate_up(v), every value rounded to bf16 as the
// unfused MLP rounds it. Each expert some token picked reads its weights once.
struct PackedExperts {
  const bf16_bits* x;        // [T, K]
  const int64_t* experts;    // [T, k]: expert ids in [0, E)
  const float* weights;      // [T, k]
  const bf16_bits* gate_up;  // [E] x packed [2I, K]
  const bf16_bits* down;     // [E] x packed [K, I]
  int64_t T, top_k, E, K, I;  // K and I even, I % 16 == 0
  bf16_bits* out;             // [T, K]
};

// Requires cpu_has_avx512_bf16().
void moe_experts_bf16_avx512(const PackedExperts& args);

// True where cpu_has_avx512_bf16() and the CPU has AMX-TILE and AMX-BF16 that this process may
// use (asked of Linux on the first call); checked once.
bool cpu_has_amx_bf16();

// The same for AMX-INT8 (the greedy head's screen, greedy_head_avx512.cpp).
bool cpu_has_amx_int8();

// The same on AMX tiles: requires cpu_has_amx_bf16() and K % 32 == 0; any M.
void linear_bf16_packed_amx(const PackedLinear& args);

// 8-bit weights, one fp32 scale per output column (`--quantize int8|fp8`, checkpoints), stored as
// sign and magnitude: bit 7 the sign, bits 0-6 a code whose value a format's table gives (int8:
// |q| itself; fp8 E4M3: the E4M3 bits, which are sign and magnitude already). int8's -128 has no
// 7-bit magnitude: it takes the code no other value uses, "-0" (0x80), which kInt8Minus128 (int8
// weights that contain -128, as compressed-tensors' int8 does) decodes at two more instructions
// per 64 weights.
enum class ByteCode { kInt8, kInt8Minus128, kFp8E4M3 };
// Packed for the AVX-512 kernel: the tiles and pairs of the bf16 layout, two pairs of K (two
// 32-value lines) per 64-byte block, bytes arranged so that vpunpck{l,h}bw of a block's low and
// high bf16 bytes gives the two lines: the value at index i (= column * 2 + k % 2) of line 2j + h
// sits at byte (i / 8) * 16 + h * 8 + i % 8 of block j; [ceil(N / 16)][ceil(K / 4)][64] bytes,
// zeros past N, K.
constexpr int64_t kByteBlockBytes = 64;
// True where cpu_has_avx512_bf16() and the CPU has AVX512_VBMI (vpermt2b); checked once.
bool cpu_has_avx512_8bit_linear();
// Requires cpu_has_avx512_8bit_linear(); args.w unused, args.scale set, args.x_stride a multiple
// of 4; any M. The same sums as linear_bf16_packed_avx512 over the weights' values as bf16 (every
// int8 and every E4M3 value is exactly a bf16 value).
void linear_8bit_packed_avx512(const PackedLinear& args, const uint8_t* codes, ByteCode code);

// Row x's dot product with weight row w as linear_bf16's AVX2 kernel computes it in a call of one
// row (before the bias and the rounding to x's dtype); x is the row widened to fp32. The greedy
// head's exact logits on CPUs without AVX512_BF16 (greedy_head_avx2.cpp).
float linear_avx2_one_row(const float* x, const bf16_bits* w, int64_t K);

// Packed for the AVX2 kernel: per tile of 16 columns and block of 4 K values, each K value's 16
// column bytes in column order (int8 as it is, E4M3 bits as they are): w[n, k] at byte
// ((n / 16 * ceil(K / 4) + k / 4) * 4 + k % 4) * 16 + n % 16, [ceil(N / 16)][ceil(K / 4)][4][16],
// zeros past N, K.
constexpr int64_t kAvx2ByteBlockValues = 4;  // K values per block
constexpr int64_t kAvx2ByteBlockBytes = kAvx2ByteBlockValues * kPackColumns;
// Any AVX2/FMA CPU; args.w unused, args.scale set, args.x_stride = 4 * ceil(K / 4); any M.
// out = fma(sum over k in K order of x * w in fp32, scale, bias), rounded once to bf16 (or not
// at all, out_f32); the weights int8 or (fp8) E4M3. `wide`: on the 16-lane kernel (requires
// cpu_has_avx512f_kernels()), the same sums bit for bit.
void linear_8bit_packed_avx2(const PackedLinear& args, const uint8_t* codes, bool fp8, bool wide);
// True on CPUs with AVX512F, BW, VL and F16C (the 16-lane 8-bit and 4-bit kernels); checked once.
bool cpu_has_avx512f_kernels();
// The 16-lane kernel over x already widened to fp32 ([M, args.x_stride]).
void linear_8bit_packed_avx512f(const PackedLinear& args, const float* x32, const uint8_t* codes,
                                bool fp8);

// 4-bit weights in groups (GPTQ, AWQ, compressed-tensors int4): w[n, k] = (q[n, k] - zero[n, g])
// * scale[n, g] with q in 0..15 and g = k / group_size, the groups contiguous runs of group_size
// input columns (the last may be partial). Packed for the kernels: the tiles and pairs of
// the bf16 layout, four pairs of K (eight K values, four 32-value lines) per 64-byte block, each
// 16-bit word of a block holding one index i (= column * 2 + k % 2) of all four lines: line
// 4j + l's value at index i is the nibble at bits 4l..4l+3 of word i of block j, i.e. q[n, k]
// sits in block k / 8 of tile n / 16, word (n % 16) * 2 + k % 2, bits 4 * (k % 8 / 2)..+3;
// [ceil(N / 16)][ceil(K / 8)][64] bytes, zeros past N, K. A block never straddles two groups
// (group_size is a multiple of 8, or K itself). The AVX-512 and the AVX2 kernels both read it.
constexpr int64_t kInt4BlockBytes = 64;
constexpr int64_t kInt4BlockValues = 8;  // K values per block

// out[M, N] = x[M, K] @ w[N, K]^T + bias, w the packed 4-bit weights with their zeros and scales.
struct Int4Linear {
  const bf16_bits* x;  // [M, x_stride] with x_stride = 8 * ceil(K / 8), zeros past K
  const uint8_t* q;    // packed
  const float* scale;  // [N, G]
  const float* zero;   // [N, G]
  const float* bias;   // [N] or nullptr
  int64_t M, N, x_stride, group_size, groups;  // groups = G = ceil(K / group_size)
  bf16_bits* out;   // [M, N] bf16, or nullptr when out_f32 is set
  float* out_f32;   // [M, N]: the fp32 sums themselves (not rounded to bf16), or nullptr
};

// Requires cpu_has_avx512_bf16(); any M. out = sum over k of x * (q - zero) * scale + bias in
// fp32, rounded once to bf16 (or not at all, out_f32); each row's value independent of the others.
void linear_int4_packed_avx512(const Int4Linear& args);
// The same on AVX2/FMA (any CPU the kernels build for), over the same packed weights; `wide`:
// on the 16-lane kernel (requires cpu_has_avx512f_kernels(): AVX512F/BW/VL), the same sums
// bit for bit.
void linear_int4_packed_avx2(const Int4Linear& args, bool wide);
// The 16-lane kernel over x widened to fp32 ([M, x_stride]) and sx, each row's sum of x over
// each group ([M, G]).
void linear_int4_packed_avx512f(const Int4Linear& args, const float* x32, const float* sx);

}  // namespace tgq_cpu
