// Ping-pong 128x128 tiles, 64x64 epilogue sub-tiles, no C operand, fp32 gradients.
#include "cuda/gemm/cutlass/trials/wgrad_trial_kernels.cuh"

EPX_WGRAD_TRIAL(wgrad_trial_pingpong_epi64x64_noc_f32, 26, float,
                cute::Shape<cute::_128, cute::_128, cute::_64>,
                cute::Shape<cute::_64, cute::_64>, true, true)
