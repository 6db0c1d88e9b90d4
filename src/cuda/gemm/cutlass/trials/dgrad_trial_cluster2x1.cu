// The shipped dgrad schedule (cooperative 128x256x64) in 2x1 clusters: TMA multicast of one operand.
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

EPX_FORWARD_TRIAL(dgrad_trial_cluster2x1, 42, true, grouped::CooperativeCluster2x1)
