// The shipped dgrad schedule (cooperative 128x256x64) in 1x2 clusters: TMA multicast of one operand.
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

EPX_FORWARD_TRIAL(dgrad_trial_cluster1x2, 43, true, grouped::CooperativeCluster1x2)
