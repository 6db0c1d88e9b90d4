// The cooperative FP8 block-scaled forward without the source operand C and with 128x64 epilogue
// sub-tiles.
#include "cuda/gemm/cutlass/grouped_fp8_sm90.cuh"
#include "cuda/gemm/cutlass/trials/fp8_forward_trials.h"

namespace epx::cuda {

void fp8_trial_cooperative_nosource_epi128x64(const void* a, const float* a_scales, const void* bt,
                                              const float* b_scales, void* out, int64_t ld_out, int64_t K, int64_t N,
                                              const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  grouped_fp8::forward<grouped_fp8::CooperativeNoSourceEpi<64, 115>>(a, a_scales, bt, b_scales, out, ld_out, K, N,
                                                                    offsets, rows, groups, stream);
}

}  // namespace epx::cuda
