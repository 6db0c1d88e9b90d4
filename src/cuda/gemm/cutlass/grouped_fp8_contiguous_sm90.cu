// The FP8 block-scaled forward over m-grouped contiguous rows (contiguous_groups_sm90.cuh): the
// kernel's types and the launch.
#include "cuda/gemm/cutlass/contiguous_groups_sm90.cuh"
#include "cuda/gemm/cutlass/fp8_overlapped_promotion_sm90.cuh"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cutlass/detail/blockwise_scale_layout.hpp"

namespace epx::cuda {
namespace grouped_fp8 {
namespace {

using namespace cute;

// The cooperative FP8 schedule's tile, epilogue and promotion (grouped_fp8_sm90.cuh's Cooperative),
// on CUTLASS's non-pointer-array kernel.
struct ContiguousKernel {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using TileShape = cute::Shape<_128, _128, _128>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cute::Shape<_128, _64>, float, float,
      void, cutlass::layout::RowMajor, 16 / sizeof(ElementOut), ElementOut, cutlass::layout::RowMajor,
      16 / sizeof(ElementOut), cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void>>::CollectiveOp;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>,
      16, ElementB, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Mainloop = contiguous::GroupsMainloop<OverlappedPromotionMainloop<BuiltMainloop>>;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                          contiguous::Tiles>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kCacheId = 102;
};

}  // namespace
}  // namespace grouped_fp8

void grouped_forward_fp8_contiguous(const void* a, const float* a_scales_mmajor, const void* bt, const float* b_scales,
                                    void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                    const int32_t* rows, int groups, int64_t total_rows, Stream stream) {
  using K_ = grouped_fp8::ContiguousKernel;
  if (groups == 0 || total_rows == 0) return;
  cudaStream_t s = to_cuda(stream);
  grouped::Cache& c = grouped::cache_for(K_::kCacheId);
  const contiguous::Tables tables = contiguous::write_tables(c, offsets, rows, groups, total_rows, s);
  const int M = static_cast<int>(total_rows), Nn = static_cast<int>(N), Kk = static_cast<int>(K);
  const int padded_rows = static_cast<int>(tables.row_blocks * contiguous::kTileRows);
  typename K_::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {M, Nn, Kk, 1};
  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<const K_::ElementA*>(a);
  ml.dA = cute::make_stride(static_cast<int64_t>(K), cute::_1{}, static_cast<int64_t>(0));
  ml.ptr_B = static_cast<const K_::ElementB*>(bt);
  ml.dB = cute::make_stride(static_cast<int64_t>(K), cute::_1{}, static_cast<int64_t>(N * K));
  ml.ptr_SFA = a_scales_mmajor;
  ml.layout_SFA = K_::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(padded_rows, Nn, Kk, 1));
  ml.ptr_SFB = b_scales;
  ml.layout_SFB = K_::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(M, Nn, Kk, groups));
  ml.groups = groups;
  ml.tile_group = tables.tile_group;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.ptr_D = static_cast<K_::ElementOut*>(out);
  args.epilogue.dD = cute::make_stride(static_cast<int64_t>(ld_out), cute::_1{}, static_cast<int64_t>(0));
  args.epilogue.dC = args.epilogue.dD;
  args.hw_info = grouped::hardware_info();
  args.scheduler.row_end = tables.row_end;
  args.scheduler.band_blocks = contiguous::band_blocks(total_rows, groups);
  grouped::launch<typename K_::Gemm>(args, c, s, "epx::grouped_gemm_forward_fp8", K, N,
                                     "both must be multiples of 128");
}

}  // namespace epx::cuda
