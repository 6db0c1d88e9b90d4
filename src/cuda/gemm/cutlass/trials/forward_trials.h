// Candidate forward / dgrad kernels (beta 0), built only with -DEPX_GEMM_TRIALS=ON; bench_grouped_gemm
// times each beside the shipped kernel of its mode and checks they agree bit for bit.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm_cuda.h"

namespace epx::cuda {

struct ForwardTrial {
  const char* name;
  bool dgrad;  // else forward (the argument conventions of grouped_dgrad_bf16 / grouped_forward_bf16)
  void (*run)(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
              const int32_t* offsets, const int32_t* rows, int groups, Stream stream);
};

const ForwardTrial* forward_trials(int& count);

}  // namespace epx::cuda
