// Dgrad: out [rows, N] fp32 (+)= a [rows, K] . w_g^T with w_g [N, K] row-major (K contiguous: the
// layout tensor cores like best).
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_dgrad_bf16(GroupedOperand a, GroupedOperand b, float* out, int64_t ld_out, int64_t K, int64_t N,
                        bool accumulate, const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows,
                        Stream stream) {
  (void)total_rows;
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, float>;
  grouped::run<Kn, float>(1, grouped::Mode::kDgrad, a, b, out, ld_out, 0, K, N, accumulate ? 1.0f : 0.0f, offsets, rows,
                          groups, stream);
}

}  // namespace epx::cuda
