// The shipped forward schedule (cooperative 128x256x64) in 2x1 clusters: TMA multicast of one operand.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/trials/forward_trials.h"

namespace epx::cuda {

void forward_trial_cluster2x1(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                              const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             grouped::CooperativeCluster2x1>;
  grouped::run<Kn, cutlass::bfloat16_t>(40, grouped::Mode::kForward, a, b, static_cast<cutlass::bfloat16_t*>(out),
                                        ld_out, 0, K, N, 0.0f, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
