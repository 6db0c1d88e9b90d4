// The shipped forward schedule (cooperative 128x256x64) in 1x2 clusters: TMA multicast of one operand.
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

EPX_FORWARD_TRIAL(forward_trial_cluster1x2, 41, false, grouped::CooperativeCluster1x2)
