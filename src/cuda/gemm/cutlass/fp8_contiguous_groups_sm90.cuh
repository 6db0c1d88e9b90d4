// The FP8 block-scaled forward over m-grouped contiguous rows: one GEMM over all groups' rows, whose
// tiles each read the weights of the group their rows belong to.
//
// The pointer-array kernels (grouped_fp8_sm90.cuh) give every group its own problem, so a CTA that
// moves to a tile of another group rewrites and fences its TMA descriptors first (A, B and the
// output's, in the producer and in both consumer warp groups, the latter on the tensor cores'
// critical path). With 128 groups of 256 rows a persistent CTA changes group on nearly every tile,
// and the FP8 kernel ran 15% slower than on the same rows in 32 groups (bench/NOTES.md).
//
// Here A, its scales and the output are single tensors over all rows, B is one [G, N, K] tensor,
// and the only per-group fact a tile needs is which weights to load: a table from 128-row tile to
// group, written on the device by a setup kernel from the offsets. No descriptor is ever rewritten.
// The price is the layout: every group must start at a multiple of 128 rows (a dispatch with
// align = 128), since a tile's rows must belong to one group and its TMA store cannot stop at a group
// boundary. Padding rows are computed like data (each output row depends on its own input row only)
// and the caller zeroes them after.
//
// Built from CUTLASS's non-pointer-array pieces: its blockwise FP8 collective (our overlapped
// promotion in mma()), its cooperative kernel and epilogue, and its persistent scheduler. Replaced:
//  - ContiguousGroupsMainloop: B's descriptor spans all groups (L = G), load() takes B's tile from
//    the tile's group and A's from the one row block, load_auxiliary() B's scales likewise;
//  - ContiguousTileScheduler: hands out only the tiles of rows below the device-side end of the last
//    group, in row-block-major order (a block's N tiles, then the next block's), so the CTAs running
//    at once share one group's weights in L2.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace epx::cuda::grouped_fp8 {

inline constexpr int kContiguousTileRows = 128;

template <class Base>
struct ContiguousGroupsMainloop : Base {
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::ElementB;
  using typename Base::GmemTiledCopyB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::TensorStorage;
  using typename Base::TileShape;

  static_assert(cute::size(ClusterShape{}) == 1, "no multicast: every CTA loads its own tiles");
  static_assert(cute::size<0>(TileShape{}) == kContiguousTileRows, "a tile's rows are one 128-row block");
  static_assert(Base::IsTmaLoadSFA && !Base::IsTmaLoadSFB,
                "A's scales by TMA (one per row), B's by cp.async (one per tile)");

  struct Arguments : Base::Arguments {
    int groups = 1;
    const int32_t* tile_group = nullptr;  // [row blocks]: the group of 128-row block m
  };
  struct Params : Base::Params {
    int groups = 1;
    const int32_t* tile_group = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    using namespace cute;
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    // B over every group: (N, K, G), so that the L coordinate picks a group's weights.
    Tensor b = make_tensor(args.ptr_B, make_layout(make_shape(N, K, args.groups), args.dB));
    p.tma_load_b = make_tma_copy_B_sm90(GmemTiledCopyB{}, b, SmemLayoutB{}(_, _, Int<0>{}), TileShape{}, ClusterShape{});
    p.groups = args.groups;
    p.tile_group = args.tile_group;
    return p;
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape, Params const& p) const {
    using namespace cute;
    auto inputs = Base::load_init(problem_shape, p);
    auto [M, N, K, L] = problem_shape;
    Tensor mB = p.tma_load_b.get_tma_tensor(make_shape(N, K, p.groups));
    Tensor gB = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BLK_N, BLK_K, n, k, g)
    return make_tuple(get<0>(inputs), gB, get<2>(inputs), get<3>(inputs));
  }

  // The producer warp's TMA loads of one tile: A's rows and their scales from row block m, B's tile
  // from the weights of block m's group.
  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState write,
                           cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile, int k_tile_count, int /*thread_idx*/,
                           uint32_t /*block_rank_in_cluster*/, TensorStorage& smem) {
    using namespace cute;
    const int leader = elect_one_sync();
    const auto m = get<0>(blk_coord);
    const auto n = get<1>(blk_coord);
    const int group = p.tile_group[m];

    Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, stage)
    Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, stage)
    Tensor sSFA = make_tensor(make_smem_ptr(smem.smem_SFA.data()), filter_zeros(SmemLayoutSFA{}));
    Tensor gA = get<0>(inputs)(_, _, m, _, 0);      // (BLK_M, BLK_K, k)
    Tensor gB = get<1>(inputs)(_, _, n, _, group);  // (BLK_N, BLK_K, k)
    Tensor gSFA = local_tile(get<2>(inputs), make_tile(Int<Base::ScaleMsPerTile>{}, Int<1>{}), make_coord(m, _, 0));

    auto tma_a = p.tma_load_a.get_slice(0);
    auto tma_b = p.tma_load_b.get_slice(0);
    auto tma_sfa = p.tma_load_sfa.get_slice(0);
    Tensor tAgA = tma_a.partition_S(gA);
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(gB);
    Tensor tBsB = tma_b.partition_D(sB);
    Tensor tSgS = tma_sfa.partition_S(gSFA);
    Tensor tSsS = tma_sfa.partition_D(sSFA);

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(write);
      const int stage = write.index();
      typename MainloopPipeline::ProducerBarrierType* bar = pipeline.producer_get_barrier(write);
      if (leader) {
        copy(p.tma_load_a.with(*bar, 0), tAgA(_, _, _, *k_tile), tAsA(_, _, _, stage));
        copy(p.tma_load_b.with(*bar, 0), tBgB(_, _, _, *k_tile), tBsB(_, _, _, stage));
        copy(p.tma_load_sfa.with(*bar, 0), tSgS(_, _, _, *k_tile), tSsS(_, _, _, stage));
      }
      ++k_tile;
      ++write;
    }
  }

  // The auxiliary producer warp's cp.async of B's scales: the base's, at the tile's group.
  template <class Inputs, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& p, MainloopPipeline pipeline, PipelineState write,
                                     Inputs const& inputs, BlockCoord const& blk_coord, KTileIterator k_tile,
                                     int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                                     TensorStorage& smem) {
    const auto m = cute::get<0>(blk_coord);
    const auto coord = cute::make_coord(m, cute::get<1>(blk_coord), cute::get<2>(blk_coord), p.tile_group[m]);
    Base::load_auxiliary(p, pipeline, write, inputs, coord, k_tile, k_tile_count, thread_idx, block_rank_in_cluster,
                         smem);
  }
};

// The persistent scheduler over the tiles of rows [0, *row_end): CUTLASS's, with its tile count cut
// on the device and its order fixed to N fastest without swizzle, so that tile t is row block
// t / n_tiles and every tile below the cut precedes every tile above it.
class ContiguousTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    const int32_t* row_end = nullptr;  // device: one past the last row of the last group's last block
  };
  struct Params : Base::Params {
    const int32_t* row_end = nullptr;
    uint64_t n_tiles = 0;
    int tile_rows = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        uint32_t epilogue_subtiles = 1, uint32_t k_tile_alignment = 1u) {
    Base::Arguments ordered = args;
    ordered.raster_order = RasterOrderOptions::AlongN;
    ordered.max_swizzle_size = 1;
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, tile_shape, cluster_shape, hw_info,
                                                                  ordered, workspace, epilogue_subtiles,
                                                                  k_tile_alignment);
    p.row_end = args.row_end;
    p.tile_rows = static_cast<int>(cute::size<0>(tile_shape));
    p.n_tiles = static_cast<uint64_t>(cute::ceil_div(cute::get<1>(problem_shape), cute::size<1>(tile_shape)));
    return p;
  }

  CUTLASS_DEVICE explicit ContiguousTileScheduler(Params const& p) : Base(p) {
    const uint64_t row_blocks = (static_cast<uint64_t>(*p.row_end) + p.tile_rows - 1) / p.tile_rows;
    if (row_blocks * p.n_tiles < scheduler_params.blocks_per_problem_)
      scheduler_params.blocks_per_problem_ = row_blocks * p.n_tiles;
  }
};

// The tag that selects it in CUTLASS's kernel (TileSchedulerSelector below).
struct ContiguousTiles {};

}  // namespace epx::cuda::grouped_fp8

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<epx::cuda::grouped_fp8::ContiguousTiles, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = epx::cuda::grouped_fp8::ContiguousTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
