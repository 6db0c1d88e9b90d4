// The forward and dgrad on CooperativeNoSource (no source operand C, 128x128 epilogue sub-tiles), the
// schedule that speeds up wgrad: measured 5-12% slower than the shipped cooperative kernels here.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/trials/forward_trials.h"

namespace epx::cuda {

void forward_trial_nosource(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                            const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             grouped::CooperativeNoSource>;
  grouped::run<Kn, cutlass::bfloat16_t>(30, grouped::Mode::kForward, a, b, static_cast<cutlass::bfloat16_t*>(out),
                                        ld_out, 0, K, N, 0.0f, offsets, rows, groups, stream);
}

void dgrad_trial_nosource(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                          const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                             grouped::CooperativeNoSource>;
  grouped::run<Kn, cutlass::bfloat16_t>(31, grouped::Mode::kDgrad, a, b, static_cast<cutlass::bfloat16_t*>(out), ld_out,
                                        0, K, N, 0.0f, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
