// Cooperative 256x128 tiles, 128x64 epilogue sub-tiles, no C operand.
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_coop256x128_epi128x64_noc, 25, cutlass::bfloat16_t,
                cute::Shape<cute::_256, cute::_128, cute::_64>,
                cute::Shape<cute::_128, cute::_64>, false, true)
