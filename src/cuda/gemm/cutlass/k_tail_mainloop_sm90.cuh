// The bf16 pointer-array mainloop of the wgrad kernels without the MMAs of a group's last K block that
// lie wholly past the group's rows.
//
// A wgrad contracts over each group's rows (K = the group's row count) in 64-deep K blocks, four
// 16-deep MMAs each. An expert's row count is rarely a multiple of 64 (the layer's routing gives
// 215-289 rows an expert at DeepSeek-V3's 2-GPU shape, ~128 on one GPU), and CUTLASS's mainloop runs
// all four MMAs of the last block on the zeros TMA fills in past the group's end: at ~4.5 blocks a
// tile that is ~1.5 wasted MMAs in 18, and the wgrad's mainloop is bound by its MMAs. Here the last
// block issues only the ceil(rows left / 16) MMAs that touch a real row; the MMAs it drops would add
// products of zeros (both operands are past the group's end), so the accumulators get the same values
// (a -0 sum stays -0 where the full sequence would add +0 to it; the two compare equal).
//
// The consumer warp groups do not know the tile's group, so the producer tells them, as the
// row-aware forward of an earlier trial did: before a tile's first stage is acquired, it writes the
// number of MMAs of the tile's last K block into a small ring in shared memory. Its arrive on that
// stage's full barrier releases the write and the consumers' wait on it acquires it. A slot is
// rewritten kRing tiles later, which needs the producer to have acquired kRing - 1 more stages (every
// tile has at least one), which needs the consumers to have released the slot's first stage, after
// they read it: kRing >= Stages + 1. The ring lives behind the pipeline's barriers (PipelineStorage);
// load() and mma() find it from the pipeline's first full barrier, the first member of that storage.
// In the ping-pong kernel the two consumer warp groups take the producer's tiles in turn (the first
// warp group the even ones), so a warp group's j-th tile is the producer's 2j + (its index - 1); that
// needs every tile to have K blocks, as every tile of a grouped wgrad does (a group without rows has
// no tiles). Only what the kernel calls differently is replaced: tensors_perform_update() (notes the
// group's rows), load() (fills the ring, then the base's loads) and mma() (the base's sequence of
// waits, MMAs and releases, with the last block trimmed). EPX_WGRAD_K_TAIL=full issues every MMA (the
// base's work, for comparisons).
#pragma once

#include <cstddef>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/dispatch_policy.hpp"

namespace epx::cuda {

/// EPX_WGRAD_K_TAIL=trim (the default) or full: whether the wgrad kernels built on KTailMainloop (the
/// cooperative one with TMA-stored tiles, the ping-pong ones without a source operand) skip the MMAs
/// of a group's last K block that lie past its rows (k_tail_mainloop_sm90.cuh).
bool wgrad_trims_k_tail();

}  // namespace epx::cuda

namespace epx::cuda::grouped {

template <class Base>
struct KTailMainloop : Base {
  using typename Base::Arguments;
  using typename Base::DispatchPolicy;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;

  static constexpr int kRing = 16;
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kMmaK = cute::size<2>(typename TiledMma::AtomShape_MNK{});
  static constexpr int kMmasPerBlock = kBlockK / kMmaK;
  // the consumer warp groups alternate tiles (ping-pong) rather than share each one (cooperative)
  static constexpr bool kAlternating =
      cute::is_base_of_v<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong, typename DispatchPolicy::Schedule>;
  static_assert(DispatchPolicy::Stages + 1 <= kRing, "a ring slot must outlive the stages a tile can run ahead");
  static_assert(Base::K_PIPE_MMAS == 1, "one K block's MMAs in flight, as the base's mainloop");
  static_assert(kMmasPerBlock * kMmaK == kBlockK && kMmasPerBlock > 1, "K blocks of several whole MMAs");

  struct PipelineStorage : Base::PipelineStorage {
    int last_block_mmas[kRing];  // the producer's ring: MMAs of each tile's last K block
  };
  static_assert(std::is_standard_layout_v<typename Base::PipelineStorage> &&
                    offsetof(typename Base::PipelineStorage, full_barrier_) == 0,
                "the pipeline's first full barrier starts its storage");

  // The ring of the storage `pipeline` was built on.
  static CUTLASS_DEVICE int* ring_of(MainloopPipeline& pipeline) {
    auto* first_full_barrier = pipeline.producer_get_barrier(PipelineState{});
    return reinterpret_cast<PipelineStorage*>(first_full_barrier)->last_block_mmas;
  }

  struct Params : Base::Params {
    bool trim = true;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shapes, args, workspace);
    p.trim = wgrad_trims_k_tail();
    return p;
  }

  // Producer: called before a group's first tile with that group's shape (K = the group's rows).
  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& inputs, typename Base::Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    group_k_ = static_cast<int>(cute::get<2>(problem_shape_mnkl));
    return Base::tensors_perform_update(inputs, params, problem_shape_mnkl, next_batch);
  }

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    if (k_tile_count > 0) {  // the consumers count only tiles with K blocks too
      const int rows_in_last = group_k_ - (k_tile_count - 1) * kBlockK;  // in [1, kBlockK] for a whole K range
      const int mmas = rows_in_last >= 1 && rows_in_last <= kBlockK ? (rows_in_last + kMmaK - 1) / kMmaK
                                                                     : kMmasPerBlock;
      if (cute::elect_one_sync()) ring_of(pipeline)[tiles_loaded_ % kRing] = mmas;
      __syncwarp();  // before the elected lane's arrive on the first stage (inside the base's load)
      ++tiles_loaded_;
    }
    Base::load(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord, k_tile_iter, k_tile_count,
               thread_idx, block_rank_in_cluster, shared_tensors);
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator lives in registers");
    if (k_tile_count <= 0) return;

    cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (M, K, stage)
    cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (N, K, stage)
    constexpr int kWarpGroups = cute::size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout wg_threads = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int wg = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto wg_mma = tiled_mma.get_slice(wg_threads(wg));
    cute::Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // smem descriptors (MMA, MMA_M, MMA_K, stage)
    cute::Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));
    static_assert(decltype(size<2>(tCrA))::value == kMmasPerBlock, "a K block's MMAs along the fragment's K mode");

    PipelineState release = smem_pipe_read;
    pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
    // After the first stage's wait: the producer wrote the slot before that stage's arrive.
    // Consumer warp groups are 1 and 2 (the producer's is 0).
    const int tile = kAlternating ? 2 * tiles_computed_ + (cutlass::canonical_warp_group_idx() - 1) : tiles_computed_;
    const int slot = ring_of(pipeline)[tile % kRing];
    ++tiles_computed_;
    const int last_mmas = params.trim ? slot : kMmasPerBlock;

    // One K block's first `n` MMAs as one batch; the accumulators start from zero where `first`. Each
    // count is straight-line code of its own: MMAs under a condition inside one batch make ptxas
    // inject fences between them (C7519).
    auto block = [&](auto n, int stage, bool first) {
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      tiled_mma.accumulate_ = first ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < decltype(n)::value; ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
    };
    auto trimmed_block = [&](int mmas, int stage, bool first) {
      static_assert(kMmasPerBlock == 4, "one case per MMA count of a 64-deep block of 16-deep MMAs");
      switch (mmas) {
        case 1: block(Int<1>{}, stage, first); break;
        case 2: block(Int<2>{}, stage, first); break;
        case 3: block(Int<3>{}, stage, first); break;
        default: block(Int<4>{}, stage, first); break;
      }
    };

    // First K block (also the last where the group has <= 64 rows).
    if (k_tile_count == 1) trimmed_block(last_mmas, smem_pipe_read.index(), true);
    else block(Int<kMmasPerBlock>{}, smem_pipe_read.index(), true);
    ++smem_pipe_read;
    warpgroup_fence_operand(accum);

    // The rest: one K block in flight, the stage before it released once its MMAs are done; the
    // last stage is released by the base's mma_tail().
    CUTLASS_PRAGMA_NO_UNROLL
    for (--k_tile_count; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      if (k_tile_count == 1) trimmed_block(last_mmas, smem_pipe_read.index(), false);
      else block(Int<kMmasPerBlock>{}, smem_pipe_read.index(), false);
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      pipeline.consumer_release(release);
      ++smem_pipe_read;
      ++release;
    }
    warpgroup_fence_operand(accum);
  }

 private:
  int group_k_ = 0;         // producer: rows of the group being loaded
  int tiles_loaded_ = 0;    // producer: tiles with K blocks loaded so far
  int tiles_computed_ = 0;  // consumers: tiles with K blocks this warp group computed so far
};

}  // namespace epx::cuda::grouped
