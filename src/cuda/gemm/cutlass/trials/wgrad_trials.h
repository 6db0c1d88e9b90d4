// Candidate wgrad kernels (bf16 or fp32 gradients, beta 0), built only with -DEPX_GEMM_TRIALS=ON (each is a
// CUTLASS instantiation: minutes of compile time that CI and users need not pay). bench_grouped_gemm
// times them beside the shipped schedules (`--wgrad fc1|fc2 trials`), so a schedule replaces a
// default only on measured evidence.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm_cuda.h"

namespace epx::cuda {

struct WgradTrial {
  const char* name;
  bool fp32_out;  // else bf16 gradients
  void (*run)(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride, int64_t K, int64_t N,
              const int32_t* offsets, const int32_t* rows, int groups, Stream stream);
};

/// The candidates, in a fixed order; count set to their number.
const WgradTrial* wgrad_trials(int& count);

}  // namespace epx::cuda
