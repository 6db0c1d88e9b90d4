// Candidate FP8 block-scaled forward kernels, built only with -DEPX_GEMM_TRIALS=ON. EPX_FP8_GEMM_KERNEL
// set to a candidate's name runs it in place of the shipped schedules, so bench_grouped_gemm times it
// through the same op (scale regrouping and padding fill included) beside them.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm_cuda.h"

namespace epx::cuda {

struct Fp8ForwardTrial {
  const char* name;
  // The arguments of grouped_forward_fp8_blockwise_pingpong.
  void (*run)(const void* a, const float* a_scales, const void* bt, const float* b_scales, void* out, int64_t ld_out,
              int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream);
};

/// The candidates, in a fixed order; count set to their number.
const Fp8ForwardTrial* fp8_forward_trials(int& count);

/// The candidate called `name`, or null.
const Fp8ForwardTrial* fp8_forward_trial_named(const char* name);

}  // namespace epx::cuda
