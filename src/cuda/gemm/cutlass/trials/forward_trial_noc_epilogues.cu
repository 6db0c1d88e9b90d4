// The forward and dgrad on cooperative 128x256 tiles without the source operand C (the forward never
// reads it; its shared-memory stages go to the mainloop), with CUTLASS's epilogue sub-tiles and with
// 128x64 ones: the no-C candidate above also took 128x128 sub-tiles, so it did not tell the two apart.
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

namespace epx::cuda::forward_trial {

struct CooperativeNoCEpiAuto : grouped::Cooperative {
  static constexpr bool kNoSource = true;
};
struct CooperativeNoCEpi128x64 : grouped::Cooperative {
  using EpilogueTile = cute::Shape<cute::_128, cute::_64>;
  static constexpr bool kNoSource = true;
};

}  // namespace epx::cuda::forward_trial

EPX_FORWARD_TRIAL(forward_trial_noc_epi_auto, 32, false, forward_trial::CooperativeNoCEpiAuto)
EPX_FORWARD_TRIAL(dgrad_trial_noc_epi_auto, 33, true, forward_trial::CooperativeNoCEpiAuto)
EPX_FORWARD_TRIAL(forward_trial_noc_epi128x64, 34, false, forward_trial::CooperativeNoCEpi128x64)
EPX_FORWARD_TRIAL(dgrad_trial_noc_epi128x64, 35, true, forward_trial::CooperativeNoCEpi128x64)
