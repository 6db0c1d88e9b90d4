// The FP8 block-scaled forward over m-grouped contiguous rows with the staged tile's epilogue
// (grouped_fp8_contiguous_sm90.cuh, staged_tile_epilogue_sm90.cuh).
#include "cuda/gemm/cutlass/grouped_fp8_contiguous_sm90.cuh"

namespace epx::cuda {

void grouped_forward_fp8_contiguous_staged(const void* a, const float* a_scales_mmajor, const void* bt,
                                           const float* b_scales, void* out, int64_t ld_out, int64_t K, int64_t N,
                                           const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows,
                                           Stream stream) {
  grouped_fp8::run_contiguous<grouped_fp8::ContiguousKernel<grouped_fp8::ContiguousStagedEpilogue, 103>>(
      a, a_scales_mmajor, bt, b_scales, out, ld_out, K, N, offsets, rows, groups, total_rows, stream);
}

}  // namespace epx::cuda
