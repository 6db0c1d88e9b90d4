// The shipped dgrad schedule (cooperative 128x256x64) in 1x2 clusters: TMA multicast of one operand.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/trials/forward_trials.h"

namespace epx::cuda {

void dgrad_trial_cluster1x2(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                            const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                             grouped::CooperativeCluster1x2>;
  grouped::run<Kn, cutlass::bfloat16_t>(43, grouped::Mode::kDgrad, a, b, static_cast<cutlass::bfloat16_t*>(out), ld_out,
                                        0, K, N, 0.0f, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
