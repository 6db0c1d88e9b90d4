// Ping-pong 128x128 tiles, 64x128 epilogue sub-tiles, no C operand.
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_pingpong_epi64x128_noc, 24, cutlass::bfloat16_t,
                cute::Shape<cute::_128, cute::_128, cute::_64>,
                cute::Shape<cute::_64, cute::_128>, true, true)
