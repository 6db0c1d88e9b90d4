// The bf16 pointer-array dgrad with the staged tile's epilogue (grouped_staged_sm90.cuh).
#include "cuda/gemm/cutlass/grouped_staged_sm90.cuh"

namespace epx::cuda {

void grouped_dgrad_bf16_staged(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                               const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows,
                               Stream stream) {
  grouped::run_staged_rows<cutlass::layout::ColumnMajor>(18, grouped::Mode::kDgrad, a, b, out, ld_out, K, N, offsets,
                                                         rows, groups, total_rows, stream, "epx::grouped_gemm_dgrad");
}

}  // namespace epx::cuda
