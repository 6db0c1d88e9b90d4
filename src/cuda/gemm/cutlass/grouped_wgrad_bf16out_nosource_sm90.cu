// Wgrad with bf16 gradients that overwrite (beta 0), on the schedule without a source operand: see
// CooperativeNoSource in grouped_sm90.cuh.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_wgrad_bf16_out_nosource(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                     int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     Stream stream) {
  using Kn = grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             grouped::CooperativeNoSource>;
  grouped::run<Kn, cutlass::bfloat16_t>(7, grouped::Mode::kWgrad, a, d, static_cast<cutlass::bfloat16_t*>(out), N,
                                        out_group_stride, K, N, 0.0f, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
