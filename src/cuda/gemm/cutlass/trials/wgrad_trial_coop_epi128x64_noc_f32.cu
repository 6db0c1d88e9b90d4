// Cooperative 128x256 tiles, 128x64 epilogue sub-tiles, no C operand, fp32 gradients.
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_coop_epi128x64_noc_f32, 27, float,
                cute::Shape<cute::_128, cute::_256, cute::_64>,
                cute::Shape<cute::_128, cute::_64>, false, true)
