// Dgrad: out [rows, N] bf16 = a [rows, K] . w_g^T with w_g [N, K] row-major (K contiguous: the
// layout tensor cores like best). bf16 out: the FFN's stacked FC1 makes d_x one GEMM over
// K = P*F, so no fp32 partial ever has to be kept between two GEMMs.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_dgrad_bf16(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                        const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream,
                        int64_t row_align) {
  const ForwardGemmSchedule schedule = forward_gemm_schedule(K, total_rows, groups, row_align);
  if (schedule == ForwardGemmSchedule::kContiguous)
    return grouped_dgrad_bf16_contiguous(a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream);
  if (schedule == ForwardGemmSchedule::kPingpong)
    return grouped_dgrad_bf16_pingpong(a, b, out, ld_out, K, N, offsets, rows, groups, stream);
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                             grouped::CooperativeOverwrite>;
  grouped::run<Kn, cutlass::bfloat16_t>(1, grouped::Mode::kDgrad, a, b, static_cast<cutlass::bfloat16_t*>(out), ld_out,
                                        0, K, N, 0.0f, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
