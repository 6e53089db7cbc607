// Checks and registration of the screened greedy lm_head (greedy_head_avx512.cpp and
// greedy_head_avx2.cpp have the kernels and the proof that they pick what the full lm_head's
// argmax picks).
#include "greedy_head.h"

#include "linear_kernels.h"  // kPackColumns, ceil_div

namespace {

using namespace tgq_cpu;

void check_column_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t N) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 &&
                  t.size(0) == N && t.is_contiguous(),
              "greedy_head_argmax: ", name, " must be a contiguous [", N, "] ", dtype,
              " CPU tensor, got ", t.scalar_type(), " ", t.sizes());
}

at::Tensor greedy_head_argmax(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& screen, const at::Tensor& scale,
                              const at::Tensor& q_sum, const at::Tensor& bound_x,
                              const at::Tensor& bound_ex, int64_t max_candidates,
                              const std::optional<at::Tensor>& masks, c10::string_view kernel) {
  const bool amx = kernel == "amx", avx2 = kernel == "avx2";
  TORCH_CHECK(amx || avx2 || kernel == "avx512", "greedy_head_argmax: unknown kernel '",
              std::string_view(kernel.data(), kernel.size()), "' (avx512, amx, avx2)");
  TORCH_CHECK(avx2 || cpu_has_avx512_vnni_bf16(), "greedy_head_argmax: kernel '",
              std::string_view(kernel.data(), kernel.size()),
              "' needs a CPU with AVX512_BF16 and AVX512_VNNI");
  TORCH_CHECK(!amx || cpu_has_amx_int8(),
              "greedy_head_argmax: kernel 'amx' needs a CPU with AMX-INT8 that Linux lets us use");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "greedy_head_argmax: x must be a [M, K] bf16 CPU tensor, got ", x.scalar_type(),
              " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(K > 0 && K % kScreenQuad == 0 && K <= kScreenMaxK,
              "greedy_head_argmax: K must be a positive multiple of 4 up to ", kScreenMaxK,
              ", got ", K);
  TORCH_CHECK(!amx || K % 64 == 0, "greedy_head_argmax: kernel 'amx' needs K % 64 == 0, got ",
              K);
  TORCH_CHECK(max_candidates > 0, "greedy_head_argmax: max_candidates must be positive");
  check_column_vector(scale, "scale", at::kFloat, N);
  check_column_vector(q_sum, "q_sum", at::kInt, N);
  check_column_vector(bound_x, "bound_x", at::kFloat, N);
  check_column_vector(bound_ex, "bound_ex", at::kFloat, N);
  const int64_t tiles = ceil_div(N, kPackColumns);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous() && weight.dim() == 2 && weight.size(0) == N &&
                  weight.size(1) == K,
              "greedy_head_argmax: weight must be a contiguous [", N, ", ", K,
              "] bf16 CPU tensor, got ", weight.scalar_type(), " ", weight.sizes());
  const std::vector<int64_t> screen_shape{tiles, K / kScreenQuad, kPackColumns, kScreenQuad};
  TORCH_CHECK(screen.device().is_cpu() && screen.scalar_type() == at::kChar &&
                  screen.is_contiguous() && screen.sizes() == c10::IntArrayRef(screen_shape),
              "greedy_head_argmax: screen must be a contiguous int8 ", c10::IntArrayRef(screen_shape),
              " tensor, got ", screen.scalar_type(), " ", screen.sizes());
  if (masks.has_value()) {
    TORCH_CHECK(masks->device().is_cpu() && masks->scalar_type() == at::kInt &&
                    masks->dim() == 2 && masks->size(0) == M && masks->is_contiguous(),
                "greedy_head_argmax: masks must be a contiguous [", M, ", W] int32 CPU tensor");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return out;
  GreedyHeadArgs args{
      data_as<bf16_bits>(xc), data_as<bf16_bits>(weight), screen.const_data_ptr<int8_t>(),
      scale.const_data_ptr<float>(), q_sum.const_data_ptr<int32_t>(),
      bound_x.const_data_ptr<float>(), bound_ex.const_data_ptr<float>(), M, N, K,
      max_candidates, out.mutable_data_ptr<int64_t>()};
  if (masks.has_value()) {
    args.masks = reinterpret_cast<const uint32_t*>(masks->const_data_ptr<int32_t>());
    args.mask_words = masks->size(1);
  }
  args.amx = amx;
  if (avx2) {
    greedy_head_avx2(args);
  } else {
    greedy_head_avx512(args);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.def(
      "greedy_head_argmax(Tensor x, Tensor weight, Tensor screen, Tensor scale, Tensor q_sum, "
      "Tensor bound_x, Tensor bound_ex, int max_candidates, Tensor? masks=None, "
      "str kernel='avx512') -> Tensor",
      &greedy_head_argmax);
  m.def("has_amx_int8() -> bool", [] { return cpu_has_amx_int8(); });
}
