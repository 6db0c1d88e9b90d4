// Wgrad with overwritten bf16 gradients on cooperative 128x256 tiles whose epilogue stages the whole
// tile once and leaves it to the TMA unit (staged_tile_epilogue_sm90.cuh).
//
// Why: with an expert's ~256 rows as the contraction, a wgrad tile's MMAs are short and its output
// large, and the epilogue decides the rate. Without any epilogue the cooperative and ping-pong mainloops
// both run FC1's DeepSeek-V3 wgrad at the forward's rate (~2.5-2.8 ms on an H200), CUTLASS's epilogues
// take it to ~4.2 ms (bench/NOTES.md). The staged tile costs the mainloop a stage (three instead of four).
//
// The gradients must be evenly strided (group g at out + g * group_stride, rows of N elements), which
// wgrad's are: one [G, K, N] tensor map then addresses every group, so no descriptor is rewritten when
// a CTA moves to another group.
#pragma once

#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/k_tail_mainloop_sm90.cuh"
#include "cuda/gemm/cutlass/staged_tile_epilogue_sm90.cuh"

namespace epx::cuda::wgrad_tma {

using namespace cute;

using CoopTmaStoreEpilogue = staged_tile::Epilogue<256, true>;

// bf16 activations [rows, K] (A, read as column-major [K, rows]) and gradients of the next layer
// [rows, N] (B, row-major); cooperative 128x256x64 tiles, no cluster; a group's last K block issues only
// the MMAs that reach its rows (k_tail_mainloop_sm90.cuh).
struct CoopTmaStoreWgradKernel {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = void;
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using Epilogue = staged_tile::TmaStoreAdapter<CoopTmaStoreEpilogue>;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::ColumnMajor*, 8, ElementB,
      cutlass::layout::RowMajor*, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(CoopTmaStoreEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = grouped::KTailMainloop<BuiltMainloop>;
  using Types = grouped::KernelTypes<grouped::GroupShape, Mainloop, Epilogue>;
  using GemmKernel = typename Types::GemmKernel;
  using Gemm = typename Types::Gemm;
  using StrideA = typename Types::StrideA;
  using StrideB = typename Types::StrideB;
  using StrideC = typename Types::StrideC;
  using Shape3 = typename Types::Shape3;
};

}  // namespace epx::cuda::wgrad_tma
