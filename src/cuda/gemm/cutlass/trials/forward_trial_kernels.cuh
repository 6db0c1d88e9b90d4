// One candidate forward or dgrad kernel (beta 0, bf16 out) per translation unit (they compile in
// parallel): a schedule of grouped_sm90.cuh and the kernel's cache id. The dgrad reads w_g [K, N] as
// its column-major [N, K] operand, as grouped_dgrad_bf16 does.
#pragma once

#include <type_traits>

#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/trials/forward_trials.h"

namespace epx::cuda::forward_trial {

template <class S, int kId, bool kDgrad>
void run(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
         const int32_t* rows, int groups, Stream stream) {
  using LayoutB = std::conditional_t<kDgrad, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Kn = grouped::Kernel<cutlass::layout::RowMajor, LayoutB, cutlass::bfloat16_t, S>;
  grouped::run<Kn, cutlass::bfloat16_t>(kId, kDgrad ? grouped::Mode::kDgrad : grouped::Mode::kForward, a, b,
                                        static_cast<cutlass::bfloat16_t*>(out), ld_out, 0, K, N, 0.0f, offsets, rows,
                                        groups, stream);
}

}  // namespace epx::cuda::forward_trial

#define EPX_FORWARD_TRIAL(fn, id, dgrad, Schedule)                                                          \
  namespace epx::cuda {                                                                                   \
  void fn(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,            \
          const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {                      \
    forward_trial::run<Schedule, id, dgrad>(a, b, out, ld_out, K, N, offsets, rows, groups, stream);      \
  }                                                                                                       \
  }
