// Wgrad with the ping-pong schedule (fp32 and bf16 out) and with 2x1 clusters (bf16 out): see
// grouped_sm90.cuh for when each wins.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_wgrad_bf16_pingpong(GroupedOperand a, GroupedOperand d, float* out, int64_t out_group_stride, int64_t K,
                                 int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream,
                                 float beta) {
  using Kn = grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, grouped::Pingpong>;
  grouped::run<Kn, float>(4, grouped::Mode::kWgrad, a, d, out, N, out_group_stride, K, N, beta, offsets, rows, groups,
                          stream);
}

void grouped_wgrad_bf16_out_pingpong(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                     int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     Stream stream, float beta) {
  using Kn =
      grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t, grouped::Pingpong>;
  grouped::run<Kn, cutlass::bfloat16_t>(5, grouped::Mode::kWgrad, a, d, static_cast<cutlass::bfloat16_t*>(out), N,
                                        out_group_stride, K, N, beta, offsets, rows, groups, stream);
}

void grouped_wgrad_bf16_out_cluster(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                    int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                    Stream stream, float beta) {
  using Kn = grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             grouped::CooperativeCluster2x1>;
  grouped::run<Kn, cutlass::bfloat16_t>(6, grouped::Mode::kWgrad, a, d, static_cast<cutlass::bfloat16_t*>(out), N,
                                        out_group_stride, K, N, beta, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
