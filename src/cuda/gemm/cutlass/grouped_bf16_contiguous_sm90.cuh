// The bf16 grouped GEMMs over m-grouped contiguous rows (contiguous_groups_sm90.cuh): out [rows, N]
// bf16 = a [rows, K] . B_g for the 128-row blocks of each group, on the shipped cooperative kernel's
// tile (128x256x64) in CUTLASS's non-pointer-array kernel, with one of two epilogues: CUTLASS's
// without a source operand (grouped_sm90.cuh's CooperativeOverwrite: 128x64 sub-tiles) or the staged
// tile (staged_tile_epilogue_sm90.cuh; the same bits). LayoutB: RowMajor for the forward (w_g [K, N]),
// ColumnMajor for dgrad (w_g [N, K], K contiguous). Each instantiation has its own translation unit,
// so they compile in parallel.
#pragma once

#include "cuda/gemm/cutlass/contiguous_groups_sm90.cuh"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/staged_tile_epilogue_sm90.cuh"

namespace epx::cuda::contiguous {

struct Bf16Parts {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlign = 8;
};

// Outside the kernel template: the epilogue's builder is not parsed as a dependent type there.
using Bf16CutlassEpilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16Parts::TileShape, Bf16Parts::ClusterShape,
    cute::Shape<cute::_128, cute::_64>, float, float, void, cutlass::layout::RowMajor, Bf16Parts::kAlign,
    Bf16Parts::Element, cutlass::layout::RowMajor, Bf16Parts::kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Bf16Parts::Element, float, void>>::CollectiveOp;
using Bf16StagedEpilogue = staged_tile::StagedTileEpilogue<256, false>;

template <class LayoutB, class EpilogueT, int kId>
struct Bf16Kernel : Bf16Parts {
  using Epilogue = EpilogueT;
  static constexpr int kEpilogueBytes = static_cast<int>(sizeof(typename Epilogue::SharedStorage));
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      LayoutB, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueBytes>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = GroupsMainloop<BuiltMainloop>;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, Tiles>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kCacheId = kId;
};

// One launch (the arguments as grouped_forward_bf16's; fn names the op in errors).
template <class LayoutB, class EpilogueT, int kId>
void run_bf16(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
              const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream,
              const char* fn) {
  using K_ = Bf16Kernel<LayoutB, EpilogueT, kId>;
  launch<typename K_::Gemm>(K_::kCacheId, a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream, fn,
                            "rows and columns must be multiples of 8 elements", [](auto&, const Tables&) {});
}

}  // namespace epx::cuda::contiguous
