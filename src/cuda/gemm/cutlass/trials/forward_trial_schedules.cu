// The forward and dgrad on each shipped schedule regardless of forward_gemm_schedule()'s choice, so
// that every contest holds both (cooperative 128x256, ping-pong 128x128), and ping-pong without the
// source operand C in 2x1 clusters (the bf16 wgrad's schedule).
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

EPX_FORWARD_TRIAL(forward_trial_cooperative, 36, false, grouped::CooperativeOverwrite)
EPX_FORWARD_TRIAL(dgrad_trial_cooperative, 37, true, grouped::CooperativeOverwrite)
EPX_FORWARD_TRIAL(forward_trial_pingpong, 44, false, grouped::Pingpong)
EPX_FORWARD_TRIAL(dgrad_trial_pingpong, 45, true, grouped::Pingpong)
EPX_FORWARD_TRIAL(forward_trial_pingpong_noc_c21, 38, false, grouped::PingpongNoSource)
EPX_FORWARD_TRIAL(dgrad_trial_pingpong_noc_c21, 39, true, grouped::PingpongNoSource)
