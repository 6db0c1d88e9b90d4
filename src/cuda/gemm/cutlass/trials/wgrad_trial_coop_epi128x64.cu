// Cooperative 128x256 tiles, 128x64 epilogue sub-tiles (CUTLASS's choice: 128x32), with C.
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_coop_epi128x64, 20, cutlass::bfloat16_t,
                cute::Shape<cute::_128, cute::_256, cute::_64>,
                cute::Shape<cute::_128, cute::_64>, false, false)
