// The bf16 forward over m-grouped contiguous rows (contiguous_groups_sm90.cuh): out [rows, N] bf16 =
// a [rows, K] . w_g [K, N] (both row-major) for the 128-row blocks of each group, on the shipped
// cooperative forward's tile and epilogue (grouped_sm90.cuh's CooperativeOverwrite: 128x256x64, no
// source operand, 128x64 epilogue sub-tiles) in CUTLASS's non-pointer-array kernel.
#include "cuda/gemm/cutlass/contiguous_groups_sm90.cuh"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda {
namespace {

using namespace cute;

struct ContiguousForward {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  static constexpr int kAlign = 8;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cute::Shape<_128, _64>, float,
      float, void, cutlass::layout::RowMajor, kAlign, Element, cutlass::layout::RowMajor, kAlign,
      cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void>>::CollectiveOp;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::RowMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = contiguous::GroupsMainloop<BuiltMainloop>;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                          contiguous::Tiles>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kCacheId = 12;
};

}  // namespace

void grouped_forward_bf16_contiguous(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K,
                                     int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     int64_t total_rows, Stream stream) {
  using K_ = ContiguousForward;
  if (groups == 0 || total_rows == 0) return;
  cudaStream_t s = to_cuda(stream);
  grouped::Cache& c = grouped::cache_for(K_::kCacheId);
  const contiguous::Tables tables = contiguous::write_tables(c, offsets, rows, groups, total_rows, s);
  typename K_::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {static_cast<int>(total_rows), static_cast<int>(N), static_cast<int>(K), 1};
  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<const K_::Element*>(a.ptr);
  ml.dA = cute::make_stride(a.ld, cute::_1{}, static_cast<int64_t>(0));
  // w_g [K, N] row-major: B (N, K, group) with N contiguous.
  ml.ptr_B = static_cast<const K_::Element*>(b.ptr);
  ml.dB = cute::make_stride(cute::_1{}, b.ld, b.group_stride);
  ml.groups = groups;
  ml.tile_group = tables.tile_group;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.ptr_D = static_cast<K_::Element*>(out);
  args.epilogue.dD = cute::make_stride(ld_out, cute::_1{}, static_cast<int64_t>(0));
  args.epilogue.dC = args.epilogue.dD;
  args.hw_info = grouped::hardware_info();
  args.scheduler.row_end = tables.row_end;
  args.scheduler.band_blocks = contiguous::band_blocks(total_rows, groups);
  grouped::launch<typename K_::Gemm>(args, c, s, "epx::grouped_gemm_forward", K, N,
                                     "rows and columns must be multiples of 8 elements");
}

}  // namespace epx::cuda
