// The FP8 block-scaled mainloop with its scale promotion overlapped with the next K block's MMAs.
//
// CUTLASS's pointer-array blockwise mainloop (the base class) runs, per 128-deep K block: issue the
// block's WGMMAs into a partial accumulator, wait for all of them (warpgroup_wait<0>), then add
// partial x scale into the final accumulator on the CUDA cores. In the cooperative schedule both
// consumer warp groups reach that wait together, so the tensor cores idle through the drain and the
// promotion of every K block (bench/NOTES.md: 45-52% of the dense FP8 rate on an H200).
//
// This mainloop keeps two partial accumulators and issues block k + 1 into one before promoting
// block k out of the other (warpgroup_wait<1>), so the promotion runs while the tensor cores work.
// The arithmetic is the base's, in the same order -- final = partial_k x s_k + final as one FMA per
// element, from final = +0 -- so the output is bit-identical to the base's. The price is 64 more
// fp32 registers per thread (three 64 x 128 accumulators per warp group at a 128 x 128 tile), within
// the 232 the cooperative kernel gives its consumer warp groups (no spills).
// Measured on an H200 against the base in one interleaved contest (bench_grouped_gemm --fp8, trials
// build; every output bit-identical): cooperative 1.04-1.12x at every shape with >= 256 rows a group,
// ping-pong 1.10-1.20x, both level at decode (32 groups x 16 rows, where the weight reads bound it).
//
// Only what the kernel calls differently is replaced: mma(). The producer side (TMA of A and B,
// cp.async of the scales), the tensor maps of the pointer array and mma_tail() are the base's; the
// release order is the same (block k's stage once its MMAs are done, the last one by mma_tail).
// Served: one promotion per tile K block (scale granularity K = tile K), a scale per row of A and
// one per tile of B (1 x 128 activations, 128 x 128 weights).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace epx::cuda::grouped_fp8 {

template <class Base>
struct OverlappedPromotionMainloop : Base {
  using typename Base::ElementBlockScale;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;

  static_assert(Base::ScaleMsPerTile > 1 && Base::ScaleNsPerTile == 1,
                "a scale per row of A and one per tile of B (1x128 activations, 128x128 weights)");
  static_assert(Base::ScalePromotionInterval * cute::size<2>(typename TiledMma::AtomShape_MNK{}) ==
                    cute::size<2>(TileShape{}),
                "one promotion per tile K block");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator lives in registers");

    cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (M, K, stage)
    cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (N, K, stage)
    // The staged scales seen as (M, N, (K, stage)) tensors, broadcast (stride 0) along the other
    // operand's mode, so that a thread's partition_C holds the scales of its accumulator elements.
    cute::Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    cute::Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout wg_threads = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int wg = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto wg_mma = tiled_mma.get_slice(wg_threads(wg));
    cute::Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA, MMA_M, MMA_N, (K, stage))
    cute::Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    cute::Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // smem descriptors (MMA, MMA_M, MMA_K, stage)
    cute::Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));

    // Two partial accumulators and the scales of the block each holds.
    cute::Tensor part0 = make_fragment_like(accum);
    cute::Tensor part1 = make_fragment_like(accum);
    cute::Tensor scale0 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    cute::Tensor scale1 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    cute::Tensor scale_b = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));

    // +0 before the first promotion (no K leaves a zero product; the base leaves it undefined).
    clear(accum);
    if (k_tile_count <= 0) return;

    // Waits for the stage at `read`, issues its K block into `part` (one commit group) and takes
    // its scales into `scale`: A's per-row scales times B's one for the tile.
    auto issue = [&](auto& part, auto& scale, PipelineState read) {
      pipeline.consumer_wait(read);
      const int stage = read.index();
      // The scales are read before the MMAs are issued: read after them (they are needed only at the
      // promotion), the cooperative kernel lost its whole gain over the waiting mainloop on an H200.
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), scale);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), scale_b);
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
      const ElementBlockScale sb = scale_b(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(scale)); ++i) filter_zeros(scale)(i) = filter_zeros(scale)(i) * sb;
    };
    // final += part x scale, one FMA per element (the base's arithmetic: bit-identical results).
    auto promote = [&](auto& part, auto& scale) {
      warpgroup_fence_operand(part);
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) = __fmaf_rn(part(i), scale(i), accum(i));
      warpgroup_fence_operand(accum);
    };

    PipelineState read = smem_pipe_read;
    PipelineState release = smem_pipe_read;  // the oldest stage still held
    issue(part0, scale0, read);
    ++read;
    int left = k_tile_count - 1;  // K blocks not issued yet; the newest issued one sits in part0
    while (left >= 2) {
      issue(part1, scale1, read);
      ++read;
      warpgroup_wait<1>();  // part0's block is done, part1's runs on
      pipeline.consumer_release(release);
      ++release;
      promote(part0, scale0);
      issue(part0, scale0, read);
      ++read;
      warpgroup_wait<1>();
      pipeline.consumer_release(release);
      ++release;
      promote(part1, scale1);
      left -= 2;
    }
    if (left == 1) {
      issue(part1, scale1, read);
      warpgroup_wait<1>();
      pipeline.consumer_release(release);
      promote(part0, scale0);
      warpgroup_wait<0>();
      promote(part1, scale1);
    } else {
      warpgroup_wait<0>();
      promote(part0, scale0);
    }
    // The last block's stage is released by mma_tail, as the base's.
  }
};

}  // namespace epx::cuda::grouped_fp8
