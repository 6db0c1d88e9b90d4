// The forward and dgrad on cooperative 128x256 tiles with other epilogues than the shipped one (no
// source operand C, 128x64 sub-tiles): with C and CUTLASS's sub-tiles (the shipped one before), and
// without C with CUTLASS's sub-tiles.
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

namespace epx::cuda::forward_trial {

struct CooperativeNoCEpiAuto : grouped::Cooperative {
  static constexpr bool kNoSource = true;
};

}  // namespace epx::cuda::forward_trial

EPX_FORWARD_TRIAL(forward_trial_with_source, 32, false, grouped::Cooperative)
EPX_FORWARD_TRIAL(dgrad_trial_with_source, 33, true, grouped::Cooperative)
EPX_FORWARD_TRIAL(forward_trial_noc_epi_auto, 34, false, forward_trial::CooperativeNoCEpiAuto)
EPX_FORWARD_TRIAL(dgrad_trial_noc_epi_auto, 35, true, forward_trial::CooperativeNoCEpiAuto)
