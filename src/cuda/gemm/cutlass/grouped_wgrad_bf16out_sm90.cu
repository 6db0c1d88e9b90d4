// Wgrad with bf16 gradients (fp32 accumulation, one rounding at the end): half the memory of fp32
// weight gradients, which for hundreds of local experts is tens of gigabytes.
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {

void grouped_wgrad_bf16_out(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride, int64_t K,
                            int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream,
                            float beta) {
  using Kn = grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t>;
  grouped::run<Kn, cutlass::bfloat16_t>(3, grouped::Mode::kWgrad, a, d, static_cast<cutlass::bfloat16_t*>(out), N,
                                        out_group_stride, K, N, beta, offsets, rows, groups, stream);
}

}  // namespace epx::cuda
