// Cooperative 128x256 tiles, 128x128 epilogue sub-tiles, no C, in 2x1 clusters, fp32 gradients.
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_coop_epi128x128_noc_c21_f32, 54, float, cute::Shape<cute::_128, cute::_256, cute::_64>,
                cute::Shape<cute::_128, cute::_128>, false, true, cute::Shape<cute::_2, cute::_1, cute::_1>)
