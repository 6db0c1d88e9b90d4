// The forward and dgrad on CooperativeNoSource (no source operand C, 128x128 epilogue sub-tiles), the
// schedule that speeds up wgrad: measured 5-12% slower than the shipped cooperative kernels here.
#include "cuda/gemm/cutlass/trials/forward_trial_kernels.cuh"

EPX_FORWARD_TRIAL(forward_trial_nosource, 30, false, grouped::CooperativeNoSource)
EPX_FORWARD_TRIAL(dgrad_trial_nosource, 31, true, grouped::CooperativeNoSource)
