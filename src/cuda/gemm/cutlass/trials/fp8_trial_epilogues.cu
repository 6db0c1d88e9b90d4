// The cooperative FP8 block-scaled forward with other epilogues than the shipped one (no source
// operand C, 128x64 sub-tiles): with C and CUTLASS's sub-tiles, without C with CUTLASS's sub-tiles,
// and without C with 128x128 sub-tiles.
#include "cuda/gemm/cutlass/grouped_fp8_sm90.cuh"
#include "cuda/gemm/cutlass/trials/fp8_forward_trials.h"

namespace epx::cuda {

void fp8_trial_cooperative_with_source(const void* a, const float* a_scales, const void* bt, const float* b_scales,
                                       void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                       const int32_t* rows, int groups, Stream stream) {
  grouped_fp8::forward<grouped_fp8::CooperativeWithSource>(a, a_scales, bt, b_scales, out, ld_out, K, N, offsets, rows,
                                                           groups, stream);
}

void fp8_trial_cooperative_epi_auto(const void* a, const float* a_scales, const void* bt, const float* b_scales,
                                    void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                    const int32_t* rows, int groups, Stream stream) {
  grouped_fp8::forward<
      grouped_fp8::CooperativeEpilogueTile<cutlass::epilogue::collective::EpilogueTileAuto, 115>>(
      a, a_scales, bt, b_scales, out, ld_out, K, N, offsets, rows, groups, stream);
}

void fp8_trial_cooperative_epi128x128(const void* a, const float* a_scales, const void* bt, const float* b_scales,
                                      void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                      const int32_t* rows, int groups, Stream stream) {
  grouped_fp8::forward<grouped_fp8::CooperativeEpilogueTile<cute::Shape<cute::_128, cute::_128>, 116>>(
      a, a_scales, bt, b_scales, out, ld_out, K, N, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
