// The FP8 block-scaled forward over m-grouped contiguous rows (contiguous_groups_sm90.cuh): the
// kernel's types, with CUTLASS's epilogue or the staged tile's (the same bits), and the launch.
#pragma once

#include "cuda/gemm/cutlass/contiguous_groups_sm90.cuh"
#include "cuda/gemm/cutlass/fp8_overlapped_promotion_sm90.cuh"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/staged_tile_epilogue_sm90.cuh"
#include "cutlass/detail/blockwise_scale_layout.hpp"

namespace epx::cuda::grouped_fp8 {

struct ContiguousParts {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
};

// Outside the kernel template: the epilogue's builder is not parsed as a dependent type there.
using ContiguousCutlassEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ContiguousParts::TileShape, ContiguousParts::ClusterShape,
    cute::Shape<cute::_128, cute::_64>, float, float, void, cutlass::layout::RowMajor,
    16 / sizeof(ContiguousParts::ElementOut), ContiguousParts::ElementOut, cutlass::layout::RowMajor,
    16 / sizeof(ContiguousParts::ElementOut), cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ContiguousParts::ElementOut, float, void>>::CollectiveOp;
using ContiguousStagedEpilogue = staged_tile::StagedTileEpilogue<128, false>;

// The cooperative FP8 schedule's tile and promotion (grouped_fp8_sm90.cuh's Cooperative), on
// CUTLASS's non-pointer-array kernel.
template <class EpilogueT, int kId>
struct ContiguousKernel : ContiguousParts {
  using Epilogue = EpilogueT;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>,
      16, ElementB, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Mainloop = contiguous::GroupsMainloop<OverlappedPromotionMainloop<BuiltMainloop>>;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                          contiguous::Tiles>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kCacheId = kId;
};

// One launch (the arguments as grouped_forward_fp8_contiguous's).
template <class K_>
void run_contiguous(const void* a, const float* a_scales_mmajor, const void* bt, const float* b_scales, void* out,
                    int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                    int64_t total_rows, Stream stream) {
  // A's scales M-major over whole 128-row blocks; B's per group [K/128, N/128].
  auto scales = [&](typename K_::Gemm::Arguments& args, const contiguous::Tables& tables) {
    const int Nn = static_cast<int>(N), Kk = static_cast<int>(K);
    const int padded_rows = static_cast<int>(tables.row_blocks * contiguous::kTileRows);
    args.mainloop.ptr_SFA = a_scales_mmajor;
    args.mainloop.layout_SFA = K_::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(padded_rows, Nn, Kk, 1));
    args.mainloop.ptr_SFB = b_scales;
    args.mainloop.layout_SFB =
        K_::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(static_cast<int>(total_rows), Nn, Kk, groups));
  };
  contiguous::launch<typename K_::Gemm>(K_::kCacheId, {a, K, 0}, {bt, K, N * K}, out, ld_out, K, N, offsets, rows,
                                        groups, total_rows, stream, "epx::grouped_gemm_forward_fp8",
                                        "both must be multiples of 128", scales);
}

}  // namespace epx::cuda::grouped_fp8
