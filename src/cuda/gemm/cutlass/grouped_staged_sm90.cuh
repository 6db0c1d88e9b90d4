// The bf16 pointer-array forward and dgrad on cooperative 128x256 tiles with the staged tile's
// epilogue (staged_tile_epilogue_sm90.cuh, kGroupRows): a group's whole tiles leave by TMA boxes of
// one tensor map over all rows, its partial last tile row by row (the map cannot stop at a group's
// end). The same bits as grouped_sm90.cuh's CooperativeOverwrite. LayoutB: RowMajor for the forward
// (w_g [K, N]), ColumnMajor for dgrad (w_g [N, K]); each in its own translation unit.
#pragma once

#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/staged_tile_epilogue_sm90.cuh"
#include "epx/error.h"

namespace epx::cuda::grouped {

template <class LayoutB>
struct StagedRowsKernel {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = void;
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using EpilogueOp = staged_tile::Epilogue<256, true, true>;
  using Epilogue = staged_tile::TmaStoreAdapter<EpilogueOp>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::RowMajor*, 8, ElementB,
      LayoutB*, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueOp::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Types = KernelTypes<GroupShape, Mainloop, Epilogue>;
  using GemmKernel = typename Types::GemmKernel;
  using Gemm = typename Types::Gemm;
  using StrideA = typename Types::StrideA;
  using StrideB = typename Types::StrideB;
  using StrideC = typename Types::StrideC;
  using Shape3 = typename Types::Shape3;
};

// One launch (the arguments as grouped_forward_bf16's; fn names the op in errors).
template <class LayoutB>
void run_staged_rows(int kernel_id, Mode mode, GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out,
                     int64_t Kd, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                     int64_t total_rows, Stream stream, const char* fn) {
  using Kn = StagedRowsKernel<LayoutB>;
  if (groups == 0 || total_rows == 0) return;
  cudaStream_t s = to_cuda(stream);
  Cache& c = cache_for(kernel_id);
  const Arrays<Kn> arr = device_arrays<Kn>(c, s, mode, a, b, static_cast<cutlass::bfloat16_t*>(out), ld_out, 0, Kd,
                                           N, offsets, rows, groups);
  staged_tile::TmaStoreArguments epi;
  const CUresult r = staged_tile::encode_output_map(epi, out, total_rows, N, 1, ld_out, ld_out * total_rows);
  require_status(r == CUDA_SUCCESS, Status::kCudaError, fn, "cuTensorMapEncodeTiled failed (CUresult ",
                 static_cast<int>(r), ") for ", total_rows, " rows of ", N, " columns, row stride ", ld_out);
  epi.group_offsets = offsets;
  epi.group_rows = rows;
  epi.out = static_cast<__nv_bfloat16*>(out);
  epi.ld = ld_out;
  epi.cols = N;
  typename Kn::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, arr.shapes, nullptr},
                                    {arr.a, arr.sa, arr.b, arr.sb},
                                    epi,
                                    hardware_info()};
  launch<typename Kn::Gemm>(args, c, s, fn, Kd, N, "rows and columns must be multiples of 8 elements");
}

}  // namespace epx::cuda::grouped
