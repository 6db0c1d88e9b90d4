// Wgrad: out_g [K, N] fp32 = a_g^T . d_g, a_g [rows_g, K] and d_g [rows_g, N] row-major: the
// contraction runs over the group's rows (A is read column-major, B row-major).
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "core/env_choice.h"

namespace epx::cuda {

bool wgrad_trims_k_tail() { return detail::env_choice("EPX_WGRAD_K_TAIL", {"trim", "full"}) != 1; }

void grouped_wgrad_bf16(GroupedOperand a, GroupedOperand d, float* out, int64_t out_group_stride, int64_t K, int64_t N,
                        const int32_t* offsets, const int32_t* rows, int groups, Stream stream, float beta) {
  using Kn = grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float>;
  grouped::run<Kn, float>(2, grouped::Mode::kWgrad, a, d, out, N, out_group_stride, K, N, beta, offsets, rows, groups,
                          stream);
}

}  // namespace epx::cuda
