// Forward: out [rows, N] bf16 = a [rows, K] . w_g [K, N] (both row-major).
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_forward_bf16(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                          const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream) {
  (void)total_rows;
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                                    grouped::CooperativeOverwrite>;
  grouped::run<Kn, cutlass::bfloat16_t>(0, grouped::Mode::kForward, a, b, static_cast<cutlass::bfloat16_t*>(out), ld_out,
                                        0, K, N, 0.0f, offsets, rows, groups, stream);
}

bool grouped_gemm_available() { return true; }

}  // namespace epx::cuda
