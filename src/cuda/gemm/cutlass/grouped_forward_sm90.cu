// Forward: out [rows, N] bf16 = a [rows, K] . w_g [K, N] (both row-major), and the choice between the
// forward's and dgrad's schedules.
#include "core/env_choice.h"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "epx/error.h"

namespace epx::cuda {

ForwardGemmSchedule forward_gemm_schedule(int64_t contraction, int64_t row_capacity, int groups, int64_t row_align) {
  const bool aligned = row_align > 0 && row_align % 128 == 0;
  const int choice =
      detail::env_choice("EPX_GEMM_FORWARD_KERNEL", {"auto", "cooperative", "pingpong", "contiguous"});
  if (choice <= 0) {
    if (contraction <= 2048 && groups > 0 && row_capacity >= 1024 * static_cast<int64_t>(groups))
      return ForwardGemmSchedule::kPingpong;
    // Contiguous where groups average two 128-row blocks of capacity or more: the gains were measured
    // there, and the one-GPU DeepSeek-V3 layer with align 128 (~1 block a group) ran its bf16 forward
    // 1.2x slower on it.
    return aligned && groups > 0 && row_capacity >= 256 * static_cast<int64_t>(groups)
               ? ForwardGemmSchedule::kContiguous
               : ForwardGemmSchedule::kCooperative;
  }
  if (choice == 1) return ForwardGemmSchedule::kCooperative;
  if (choice == 2) return ForwardGemmSchedule::kPingpong;
  require(aligned, "epx::grouped_gemm_forward", "EPX_GEMM_FORWARD_KERNEL is contiguous, which needs every group to ",
          "start at a multiple of 128 rows; row_align is ", row_align, ", expected a multiple of 128");
  return ForwardGemmSchedule::kContiguous;
}

void grouped_forward_bf16(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                          const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream,
                          int64_t row_align) {
  const ForwardGemmSchedule schedule = forward_gemm_schedule(K, total_rows, groups, row_align);
  if (schedule == ForwardGemmSchedule::kContiguous)
    return grouped_forward_bf16_contiguous(a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream);
  if (schedule == ForwardGemmSchedule::kPingpong)
    return grouped_forward_bf16_pingpong(a, b, out, ld_out, K, N, offsets, rows, groups, stream);
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             grouped::CooperativeOverwrite>;
  grouped::run<Kn, cutlass::bfloat16_t>(0, grouped::Mode::kForward, a, b, static_cast<cutlass::bfloat16_t*>(out), ld_out,
                                        0, K, N, 0.0f, offsets, rows, groups, stream);
}

bool grouped_gemm_available() { return true; }

}  // namespace epx::cuda
