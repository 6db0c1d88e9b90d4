// The bf16 dgrad over m-grouped contiguous rows (grouped_bf16_contiguous_sm90.cuh): out [rows, N] =
// a [rows, K] . w_g^T with w_g [N, K] row-major (K contiguous); CUTLASS's epilogue here, the staged
// tile's in grouped_dgrad_contiguous_staged_sm90.cu.
#include "cuda/gemm/cutlass/grouped_bf16_contiguous_sm90.cuh"

namespace epx::cuda {

void grouped_dgrad_bf16_contiguous(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                                   const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows,
                                   Stream stream) {
  if (contiguous_staged_epilogue(out, N, ld_out, true, K))
    return grouped_dgrad_bf16_contiguous_staged(a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream);
  contiguous::run_bf16<cutlass::layout::ColumnMajor, contiguous::Bf16CutlassEpilogue, 13>(
      a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream, "epx::grouped_gemm_dgrad");
}

}  // namespace epx::cuda
