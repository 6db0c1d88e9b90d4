// Ping-pong 128x128 tiles, 64x64 epilogue sub-tiles, no C, in 2x1 clusters (TMA multicast of one operand).
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_pingpong_epi64x64_noc_c21, 50, cutlass::bfloat16_t,
                cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_64, cute::_64>, true, true,
                cute::Shape<cute::_2, cute::_1, cute::_1>)
