// Wgrad with bf16 or fp32 gradients that overwrite (beta 0), on ping-pong tiles without a source
// operand: see PingpongNoSource in grouped_sm90.cuh.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_wgrad_bf16_out_pingpong_nosource(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                              int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows,
                                              int groups, Stream stream) {
  using Kn = grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             grouped::PingpongNoSource>;
  grouped::run<Kn, cutlass::bfloat16_t>(8, grouped::Mode::kWgrad, a, d, static_cast<cutlass::bfloat16_t*>(out), N,
                                        out_group_stride, K, N, 0.0f, offsets, rows, groups, stream);
}

void grouped_wgrad_f32_pingpong_nosource(GroupedOperand a, GroupedOperand d, float* out, int64_t out_group_stride,
                                         int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                         Stream stream) {
  using Kn =
      grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, grouped::PingpongNoSource>;
  grouped::run<Kn, float>(9, grouped::Mode::kWgrad, a, d, out, N, out_group_stride, K, N, 0.0f, offsets, rows, groups,
                          stream);
}

}  // namespace epx::cuda
