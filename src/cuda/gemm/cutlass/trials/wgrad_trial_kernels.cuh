// One candidate wgrad kernel per translation unit (they compile in parallel): a schedule, its
// epilogue sub-tile, whether it keeps the source operand C, and its cluster shape.
#pragma once

#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/trials/wgrad_trials.h"

namespace epx::cuda::wgrad_trial {

using namespace cute;

template <class Tile, class EpiTile, bool kPingpong, bool NoSource, class Cluster = cute::Shape<_1, _1, _1>>
struct Schedule {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using MainloopSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueTile = EpiTile;
  static constexpr bool kNoSource = NoSource;
};

template <class S, int kId, class Out>
void run(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride, int64_t K, int64_t N,
         const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  using Kn = grouped::Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Out, S>;
  grouped::run<Kn, Out>(kId, grouped::Mode::kWgrad, a, d, static_cast<Out*>(out), N, out_group_stride, K, N, 0.0f,
                        offsets, rows, groups, stream);
}

}  // namespace epx::cuda::wgrad_trial

#define EPX_WGRAD_TRIAL(fn, id, Out, ...)                                                                          \
  namespace epx::cuda {                                                                                       \
  void fn(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride, int64_t K, int64_t N,      \
          const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {                          \
    wgrad_trial::run<wgrad_trial::Schedule<__VA_ARGS__>, id, Out>(a, d, out, out_group_stride, K, N, offsets, rows, \
                                                            groups, stream);                                  \
  }                                                                                                           \
  }
