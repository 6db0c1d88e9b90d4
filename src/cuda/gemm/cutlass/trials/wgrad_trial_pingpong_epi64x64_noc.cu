// Ping-pong 128x128 tiles, 64x64 epilogue sub-tiles (CUTLASS's choice: 64x32), no C operand.
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_pingpong_epi64x64_noc, 23, cutlass::bfloat16_t,
                cute::Shape<cute::_128, cute::_128, cute::_64>,
                cute::Shape<cute::_64, cute::_64>, true, true)
