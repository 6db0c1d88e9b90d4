// The forward and dgrad on ping-pong 128x128 tiles, whose warp groups take turns so that one's
// epilogue runs under the other's MMAs: with the source operand C, and without it in 2x1 clusters
// (the bf16 wgrad's schedule). Candidates for the short contractions (K = 2048), where the cooperative
// kernel's epilogue, not overlapped with any MMA, weighs most.
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

EPX_FORWARD_TRIAL(forward_trial_pingpong, 36, false, grouped::Pingpong)
EPX_FORWARD_TRIAL(dgrad_trial_pingpong, 37, true, grouped::Pingpong)
EPX_FORWARD_TRIAL(forward_trial_pingpong_noc_c21, 38, false, grouped::PingpongNoSource)
EPX_FORWARD_TRIAL(dgrad_trial_pingpong_noc_c21, 39, true, grouped::PingpongNoSource)
