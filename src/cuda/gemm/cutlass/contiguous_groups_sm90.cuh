// Grouped GEMMs over m-grouped contiguous rows: one GEMM over all groups' rows, whose 128-row
// tiles each read the weights of the group their rows belong to (the bf16 forward and the FP8
// block-scaled forward build on it: grouped_forward_contiguous_sm90.cu, grouped_fp8_contiguous_sm90.cu).
//
// The pointer-array kernels (grouped_sm90.cuh, grouped_fp8_sm90.cuh) give every group its own
// problem, so a CTA that moves to a tile of another group rewrites and fences its TMA descriptors
// first (A, B and the output's, in the producer and in both consumer warp groups, the latter on the
// tensor cores' critical path). With 128 groups of 256 rows a persistent CTA changes group on nearly
// every tile, and the FP8 kernel ran 15% slower than on the same rows in 32 groups (bench/NOTES.md).
//
// Here A (and its scales) and the output are single tensors over all rows, B is one [G, N, K]
// tensor, and the only per-group fact a tile needs is which weights to load: a table from 128-row
// block to group, written on the device by setup_kernel from the offsets. No descriptor is ever
// rewritten. The price is the layout: every group must start at a multiple of 128 rows (a dispatch
// with align = 128), since a tile's rows must belong to one group and its TMA store cannot stop at a
// group boundary. Padding rows are computed like data (each output row depends on its own input row
// only) and the caller zeroes them after.
//
// Built from CUTLASS's non-pointer-array pieces: its collectives (our overlapped promotion in the
// FP8 mma()), its cooperative kernel and epilogue, and its persistent scheduler. Replaced:
//  - GroupsMainloop: B's descriptor spans all groups (L = G), load() takes B's tile from the tile's
//    group and A's from the one row block, load_auxiliary() B's FP8 scales likewise;
//  - TileScheduler: hands out only the tiles of rows below the device-side end of the last group,
//    band by band (a group's row blocks, then its next N tile), the order of the pointer-array kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cuda/gemm/cutlass/staged_tile_epilogue_sm90.cuh"
#include "epx/error.h"

namespace epx::cuda::contiguous {

inline constexpr int kTileRows = 128;

// Whether a collective scales its operands blockwise (the FP8 one: A's scales by TMA with A, B's by
// the auxiliary producer warp).
template <class C, class = void>
struct IsBlockScaled : std::false_type {};
template <class C>
struct IsBlockScaled<C, std::void_t<decltype(C::ScaleMsPerTile)>> : std::true_type {};

// The element type a collective's TMA descriptors are built for (the bf16 one reads its operands as
// same-width integers).
template <class C, class = void>
struct TmaElementB {
  using type = typename C::ElementB;
};
template <class C>
struct TmaElementB<C, std::void_t<typename C::InternalElementB>> {
  using type = typename C::InternalElementB;
};

template <class Base>
struct GroupsMainloop : Base {
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::GmemTiledCopyB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  static constexpr bool kScaled = IsBlockScaled<Base>::value;

  static_assert(cute::size(ClusterShape{}) == 1, "no multicast: every CTA loads its own tiles");
  static_assert(cute::size<0>(TileShape{}) == kTileRows, "a tile's rows are one 128-row block");

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
    const auto* ptr_b = reinterpret_cast<typename TmaElementB<Base>::type const*>(args.ptr_B);
    cute::Tensor b = make_tensor(ptr_b, make_layout(make_shape(N, K, args.groups), args.dB));
    p.tma_load_b =
        make_tma_copy_B_sm90(GmemTiledCopyB{}, b, SmemLayoutB{}(_, _, Int<0>{}), TileShape{}, ClusterShape{});
    p.groups = args.groups;
    p.tile_group = args.tile_group;
    return p;
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape, Params const& p) const {
    using namespace cute;
    auto inputs = Base::load_init(problem_shape, p);
    auto [M, N, K, L] = problem_shape;
    cute::Tensor mB = p.tma_load_b.get_tma_tensor(make_shape(N, K, p.groups));
    cute::Tensor gB = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BLK_N, BLK_K, n, k, g)
    if constexpr (kScaled) return make_tuple(get<0>(inputs), gB, get<2>(inputs), get<3>(inputs));
    else return make_tuple(get<0>(inputs), gB);
  }

  // The producer warp's TMA loads of one tile: A's rows (and their scales) from row block m, B's
  // tile from the weights of block m's group.
  template <class Inputs, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState write, Inputs const& inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile, int k_tile_count, int /*thread_idx*/,
                           uint32_t /*block_rank_in_cluster*/, TensorStorage& smem) {
    using namespace cute;
    const int leader = elect_one_sync();
    const auto m = get<0>(blk_coord);
    const auto n = get<1>(blk_coord);
    const int group = p.tile_group[m];

    cute::Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, stage)
    cute::Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, stage)
    cute::Tensor gA = get<0>(inputs)(_, _, m, _, 0);      // (BLK_M, BLK_K, k)
    cute::Tensor gB = get<1>(inputs)(_, _, n, _, group);  // (BLK_N, BLK_K, k)
    auto tma_a = p.tma_load_a.get_slice(0);
    auto tma_b = p.tma_load_b.get_slice(0);
    cute::Tensor tAgA = tma_a.partition_S(gA);
    cute::Tensor tAsA = tma_a.partition_D(sA);
    cute::Tensor tBgB = tma_b.partition_S(gB);
    cute::Tensor tBsB = tma_b.partition_D(sB);
    // A's scales, one per row, TMA-loaded with A (FP8 only).
    auto scales = [&] {
      if constexpr (kScaled) {
        static_assert(Base::IsTmaLoadSFA && !Base::IsTmaLoadSFB,
                      "A's scales by TMA (one per row), B's by cp.async (one per tile)");
        cute::Tensor sSFA =
            make_tensor(make_smem_ptr(smem.smem_SFA.data()), filter_zeros(typename Base::SmemLayoutSFA{}));
        cute::Tensor gSFA =
            local_tile(get<2>(inputs), make_tile(Int<Base::ScaleMsPerTile>{}, Int<1>{}), make_coord(m, _, 0));
        auto tma_sfa = p.tma_load_sfa.get_slice(0);
        return make_tuple(tma_sfa.partition_S(gSFA), tma_sfa.partition_D(sSFA));
      } else {
        return 0;
      }
    }();

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(write);
      const int stage = write.index();
      typename MainloopPipeline::ProducerBarrierType* bar = pipeline.producer_get_barrier(write);
      if (leader) {
        copy(p.tma_load_a.with(*bar, 0), tAgA(_, _, _, *k_tile), tAsA(_, _, _, stage));
        copy(p.tma_load_b.with(*bar, 0), tBgB(_, _, _, *k_tile), tBsB(_, _, _, stage));
        if constexpr (kScaled)
          copy(p.tma_load_sfa.with(*bar, 0), get<0>(scales)(_, _, _, *k_tile), get<1>(scales)(_, _, _, stage));
      }
      ++k_tile;
      ++write;
    }
  }

  // The auxiliary producer warp's cp.async of B's scales (FP8 only): the base's, at the tile's group.
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

// The persistent scheduler over the tiles of rows [0, *row_end). CUTLASS's persistent scheduler for
// the kernel's static interface (grid, k tiles, epilogue), with its own tile order: bands of
// `band_blocks` 128-row blocks, each band's tiles with the row block fastest, then the N tile, the
// bands in row order. With a band as tall as a group (the host picks it from the average group) the
// CTAs running at once cover a few N tiles of one group's rows: the group's rows stay in L2 while its
// weights stream through once, as in the pointer-array kernels' group-by-group order; N fastest
// instead re-read a large group's whole weight matrix for every row block. Every tile below the cut
// precedes every tile above it, so the cut is a tile count.
class TileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    const int32_t* row_end = nullptr;  // device: one past the last row of the last group's last block
    int band_blocks = 1;
  };
  struct Params : Base::Params {
    const int32_t* row_end = nullptr;
    uint64_t n_tiles = 0;
    int tile_rows = 0;
    int band_blocks = 1;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        uint32_t epilogue_subtiles = 1, uint32_t k_tile_alignment = 1u) {
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, tile_shape, cluster_shape, hw_info,
                                                                  args, workspace, epilogue_subtiles, k_tile_alignment);
    p.row_end = args.row_end;
    p.tile_rows = static_cast<int>(cute::size<0>(tile_shape));
    p.n_tiles = static_cast<uint64_t>(cute::ceil_div(cute::get<1>(problem_shape), cute::size<1>(tile_shape)));
    p.band_blocks = args.band_blocks > 0 ? args.band_blocks : 1;
    return p;
  }

  CUTLASS_DEVICE explicit TileScheduler(Params const& p) : Base(p) {
    row_blocks_ = (static_cast<uint64_t>(*p.row_end) + p.tile_rows - 1) / p.tile_rows;
    n_tiles_ = p.n_tiles;
    band_ = static_cast<uint64_t>(p.band_blocks);
    tiles_ = row_blocks_ * n_tiles_;
    next_ = blockIdx.x + static_cast<uint64_t>(blockIdx.y) * gridDim.x +
            static_cast<uint64_t>(blockIdx.z) * gridDim.x * gridDim.y;
    stride_ = static_cast<uint64_t>(gridDim.x) * gridDim.y * gridDim.z;
  }

  CUTLASS_DEVICE WorkTileInfo work_at(uint64_t i) const {
    if (i >= tiles_) return WorkTileInfo::invalid_work_tile();
    const uint64_t first = i / (band_ * n_tiles_) * band_;  // the band's first row block
    const uint64_t rest = i - first * n_tiles_;
    const uint64_t height = row_blocks_ - first < band_ ? row_blocks_ - first : band_;  // the last band may be short
    return {static_cast<int32_t>(first + rest % height), static_cast<int32_t>(rest / height), 0, true};
  }

  // What the kernel calls on the scheduler object: the base's, on this order.
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return work_at(next_);
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work_at(next_); }
  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) { next_ += stride_ * count; }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const {
    return !work_at(next_ + stride_ * count).is_valid();
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo info, Pipeline&, PipelineState) {
    return fetch_next_work(info);
  }

 private:
  uint64_t row_blocks_ = 0, n_tiles_ = 0, band_ = 1, tiles_ = 0, next_ = 0, stride_ = 1;
};

// The tag that selects it in CUTLASS's kernel (TileSchedulerSelector below).
struct Tiles {};

// Block b (128 rows) -> the group its first row belongs to: the last g with offsets[g] <= 128 b
// (empty groups share their successor's offset, so the last one is the group with rows; a block in
// the padding between groups gets the group before it and computes padding). Block 0 of the grid
// also writes row_end: the end of the last group's last 128-row block.
// (In an unnamed namespace: each translation unit that launches it has its own copy.)
namespace {
__global__ void setup_kernel(const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows, int groups,
                             int64_t row_blocks, int32_t* __restrict__ tile_group, int32_t* __restrict__ row_end) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < row_blocks) {
    const int64_t row = b * kTileRows;
    int lo = 0, hi = groups;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (offsets[mid] <= row) lo = mid;
      else hi = mid;
    }
    tile_group[b] = lo;
  }
  if (blockIdx.x != 0) return;
  __shared__ int32_t end;
  if (threadIdx.x == 0) end = 0;
  __syncthreads();
  int32_t mine = 0;
  for (int g = threadIdx.x; g < groups; g += blockDim.x)
    if (rows[g] > 0) mine = max(mine, (offsets[g] + rows[g] + kTileRows - 1) / kTileRows * kTileRows);
  atomicMax(&end, mine);
  __syncthreads();
  if (threadIdx.x == 0) *row_end = end;
}
}  // namespace

// The band of the tile order: the average group's row blocks, rounded down to a power of two, 1 to 64.
inline int band_blocks(int64_t total_rows, int groups) {
  const int64_t per_group = groups > 0 ? total_rows / groups / kTileRows : 1;
  int band = 1;
  while (band < 64 && 2 * band <= per_group) band *= 2;
  return band;
}

// The device tables of one launch, in the kernel's cached array buffer (grown on demand).
struct Tables {
  int32_t* tile_group;  // [row_blocks]
  int32_t* row_end;     // one int32
  int64_t row_blocks;   // ceil(total_rows / 128)
};

inline Tables write_tables(grouped::Cache& c, const int32_t* offsets, const int32_t* rows, int groups,
                           int64_t total_rows, cudaStream_t s) {
  Tables t;
  t.row_blocks = (total_rows + kTileRows - 1) / kTileRows;
  grouped::grow(c.arrays, c.arrays_bytes, static_cast<size_t>(t.row_blocks + 1) * sizeof(int32_t));
  t.tile_group = static_cast<int32_t*>(c.arrays);
  t.row_end = t.tile_group + t.row_blocks;
  const int threads = 256;
  const int blocks = static_cast<int>(std::max<int64_t>(1, (t.row_blocks + threads - 1) / threads));
  setup_kernel<<<blocks, threads, 0, s>>>(offsets, rows, groups, t.row_blocks, t.tile_group, t.row_end);
  EPX_CHECK_LAUNCH("contiguous setup_kernel");
  return t;
}

// The output's epilogue arguments: CUTLASS's epilogue (alpha 1, no source operand) ...
template <class EpilogueArgs>
void set_output(EpilogueArgs& e, void* out, int64_t ld_out, int64_t, int64_t, const char*) {
  e.thread.alpha = 1.0f;
  e.ptr_D = static_cast<std::remove_reference_t<decltype(e.ptr_D)>>(out);
  e.dD = cute::make_stride(ld_out, cute::_1{}, static_cast<int64_t>(0));
  e.dC = e.dD;
}
// ... or the staged tile's tensor map over all rows (staged_tile_epilogue_sm90.cuh).
inline void set_output(staged_tile::TmaStoreArguments& e, void* out, int64_t ld_out, int64_t total_rows, int64_t N,
                       const char* fn) {
  const CUresult r = staged_tile::encode_output_map(e, out, total_rows, N, 1, ld_out, ld_out * total_rows);
  require_status(r == CUDA_SUCCESS, Status::kCudaError, fn, "cuTensorMapEncodeTiled failed (CUresult ",
                 static_cast<int>(r), ") for ", total_rows, " rows of ", N, " columns, row stride ", ld_out);
}

// One launch of a contiguous kernel: its tables, the arguments every such kernel takes alike (A and
// the output over all rows, B (N, K, group) with its group stride, the scheduler's cut and band),
// then `more` (args, tables) for a kernel's own (the FP8 scales), then CUTLASS's checks and the
// launch. fn names the op in errors, rule what its shapes must satisfy.
template <class Gemm, class More>
void launch(int cache_id, GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
            const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream,
            const char* fn, const char* rule, More&& more) {
  using Kernel = typename Gemm::GemmKernel;
  if (groups == 0 || total_rows == 0) return;
  cudaStream_t s = to_cuda(stream);
  grouped::Cache& c = grouped::cache_for(cache_id);
  const Tables tables = write_tables(c, offsets, rows, groups, total_rows, s);
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {static_cast<int>(total_rows), static_cast<int>(N), static_cast<int>(K), 1};
  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<const typename Kernel::ElementA*>(a.ptr);
  ml.dA = cute::make_stride(a.ld, cute::_1{}, static_cast<int64_t>(0));
  ml.ptr_B = static_cast<const typename Kernel::ElementB*>(b.ptr);
  // N contiguous (the bf16 forward's w_g [K, N]) or K contiguous (dgrad's and FP8's [N, K]).
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(typename Kernel::StrideB{}))>>::value)
    ml.dB = cute::make_stride(cute::_1{}, b.ld, b.group_stride);
  else
    ml.dB = cute::make_stride(b.ld, cute::_1{}, b.group_stride);
  ml.groups = groups;
  ml.tile_group = tables.tile_group;
  set_output(args.epilogue, out, ld_out, total_rows, N, fn);
  args.hw_info = grouped::hardware_info();
  args.scheduler.row_end = tables.row_end;
  args.scheduler.band_blocks = band_blocks(total_rows, groups);
  more(args, tables);
  grouped::launch<Gemm>(args, c, s, fn, K, N, rule);
}

}  // namespace epx::cuda::contiguous

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<epx::cuda::contiguous::Tiles, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = epx::cuda::contiguous::TileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
