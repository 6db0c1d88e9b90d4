// The bf16 grouped GEMMs over m-grouped contiguous rows (contiguous_groups_sm90.cuh): out [rows, N]
// bf16 = a [rows, K] . B_g for the 128-row blocks of each group, on the shipped cooperative kernel's
// tile and epilogue (grouped_sm90.cuh's CooperativeOverwrite: 128x256x64, no source operand, 128x64
// epilogue sub-tiles) in CUTLASS's non-pointer-array kernel. LayoutB: RowMajor for the forward (w_g
// [K, N]), ColumnMajor for dgrad (w_g [N, K], K contiguous). Each instantiation has its own
// translation unit, so they compile in parallel.
#pragma once

#include <type_traits>

#include "cuda/gemm/cutlass/contiguous_groups_sm90.cuh"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda::contiguous {

// The parts that do not depend on B's layout (outside the template: the epilogue's builder is not
// parsed as a dependent type there).
struct Bf16Parts {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlign = 8;
  using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cute::Shape<cute::_128, cute::_64>, float, float, void, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::RowMajor, kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void>>::CollectiveOp;
  static constexpr int kEpilogueBytes = static_cast<int>(sizeof(Epilogue::SharedStorage));
};

template <class LayoutB, int kId>
struct Bf16Kernel : Bf16Parts {
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
template <class LayoutB, int kId>
void run_bf16(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
              const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream,
              const char* fn) {
  using K_ = Bf16Kernel<LayoutB, kId>;
  if (groups == 0 || total_rows == 0) return;
  cudaStream_t s = to_cuda(stream);
  grouped::Cache& c = grouped::cache_for(K_::kCacheId);
  const Tables tables = write_tables(c, offsets, rows, groups, total_rows, s);
  typename K_::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {static_cast<int>(total_rows), static_cast<int>(N), static_cast<int>(K), 1};
  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<const typename K_::Element*>(a.ptr);
  ml.dA = cute::make_stride(a.ld, cute::_1{}, static_cast<int64_t>(0));
  // B (N, K, group): N contiguous for the forward's w_g [K, N], K contiguous for dgrad's w_g [N, K].
  ml.ptr_B = static_cast<const typename K_::Element*>(b.ptr);
  if constexpr (std::is_same_v<LayoutB, cutlass::layout::RowMajor>)
    ml.dB = cute::make_stride(cute::_1{}, b.ld, b.group_stride);
  else
    ml.dB = cute::make_stride(b.ld, cute::_1{}, b.group_stride);
  ml.groups = groups;
  ml.tile_group = tables.tile_group;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.ptr_D = static_cast<typename K_::Element*>(out);
  args.epilogue.dD = cute::make_stride(ld_out, cute::_1{}, static_cast<int64_t>(0));
  args.epilogue.dC = args.epilogue.dD;
  args.hw_info = grouped::hardware_info();
  args.scheduler.row_end = tables.row_end;
  args.scheduler.band_blocks = band_blocks(total_rows, groups);
  grouped::launch<typename K_::Gemm>(args, c, s, fn, K, N, "rows and columns must be multiples of 8 elements");
}

}  // namespace epx::cuda::contiguous
