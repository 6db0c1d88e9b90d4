// Ping-pong 128x128 tiles, 64x64 epilogue sub-tiles, no C, in 2x1 clusters, fp32 gradients (the shipped
// bf16 no-source kernel's schedule, for overwritten fp32 gradients).
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_pingpong_epi64x64_noc_c21_f32, 53, float, cute::Shape<cute::_128, cute::_128, cute::_64>,
                cute::Shape<cute::_64, cute::_64>, true, true, cute::Shape<cute::_2, cute::_1, cute::_1>)
