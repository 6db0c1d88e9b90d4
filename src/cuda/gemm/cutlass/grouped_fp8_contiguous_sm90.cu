// The FP8 block-scaled forward over m-grouped contiguous rows with CUTLASS's epilogue
// (grouped_fp8_contiguous_sm90.cuh); the staged tile's is in grouped_fp8_contiguous_staged_sm90.cu.
#include "cuda/gemm/cutlass/grouped_fp8_contiguous_sm90.cuh"

namespace epx::cuda {

void grouped_forward_fp8_contiguous(const void* a, const float* a_scales_mmajor, const void* bt, const float* b_scales,
                                    void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                    const int32_t* rows, int groups, int64_t total_rows, Stream stream) {
  if (contiguous_staged_epilogue(out, N, ld_out, false, K))
    return grouped_forward_fp8_contiguous_staged(a, a_scales_mmajor, bt, b_scales, out, ld_out, K, N, offsets, rows,
                                                 groups, total_rows, stream);
  grouped_fp8::run_contiguous<grouped_fp8::ContiguousKernel<grouped_fp8::ContiguousCutlassEpilogue, 102>>(
      a, a_scales_mmajor, bt, b_scales, out, ld_out, K, N, offsets, rows, groups, total_rows, stream);
}

}  // namespace epx::cuda
