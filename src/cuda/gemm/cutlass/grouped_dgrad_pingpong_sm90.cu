// The dgrad on ping-pong 128x128 tiles (forward_gemm_schedule() picks it): its own translation unit so
// it compiles beside the cooperative one.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_dgrad_bf16_pingpong(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                                 const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  using Kn =
      grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t, grouped::Pingpong>;
  grouped::run<Kn, cutlass::bfloat16_t>(11, grouped::Mode::kDgrad, a, b, static_cast<cutlass::bfloat16_t*>(out),
                                        ld_out, 0, K, N, 0.0f, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
