// The bf16 forward over m-grouped contiguous rows with the staged tile's epilogue
// (grouped_bf16_contiguous_sm90.cuh, staged_tile_epilogue_sm90.cuh).
#include "cuda/gemm/cutlass/grouped_bf16_contiguous_sm90.cuh"

namespace epx::cuda {

void grouped_forward_bf16_contiguous_staged(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K,
                                            int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                            int64_t total_rows, Stream stream) {
  contiguous::run_bf16<cutlass::layout::RowMajor, contiguous::Bf16StagedEpilogue, 15>(
      a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream, "epx::grouped_gemm_forward");
}

}  // namespace epx::cuda
