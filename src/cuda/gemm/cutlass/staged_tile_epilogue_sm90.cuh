// An epilogue for cooperative kernels (two consumer warp groups, 128-row tiles) that stages the whole
// output tile once and leaves it to the TMA unit.
//
// Why: CUTLASS's TMA epilogue stores sub-tiles through two small buffers and waits on the store two
// sub-tiles back before writing the next, so the math warp groups wait on the stores inside every tile.
// Where a tile's MMAs are short (a wgrad's ~256-row contraction, a forward's K = 2048, FP8's doubled
// rate) that wait decides the rate (bench/NOTES.md). Here the whole tile is staged at once: both warp
// groups convert their accumulators into it (stmatrix, four 8x8 matrices a store), fence, synchronise,
// and one thread issues a bulk tensor store per 64-column box without waiting for it; the next tile's
// epilogue waits for their reads before it writes the buffer, by which time a whole tile of MMAs has hidden
// them. The price is shared memory (64 KB for 128 x 256 tiles), which the mainloop's stages give up.
//
// The output is bf16, addressed by one [L, M, N] tensor map whose bounds clip the tiles: so the rows of
// one L index must be evenly strided and a tile must never cross into rows it does not own (wgrad's
// per-group gradients; a contiguous kernel's 128-row-aligned groups, whose tiles end in their own
// group's padding rows). Results are bit-identical to CUTLASS's epilogue without a source operand
// (alpha = 1: round-to-nearest of the fp32 accumulator).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <type_traits>

#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace epx::cuda::staged_tile {

using namespace cute;

inline constexpr int kTileRows = 128;
inline constexpr int kBoxCols = 64;  // a 128-byte-swizzled box is at most 128 bytes wide

struct TmaStoreArguments {
  CUtensorMap tmap;  // [L, M, N] bf16, boxes of kTileRows x kBoxCols, 128-byte swizzle
};

// Whether out can be the tensor map's base with these strides (elements): a 16-byte aligned base and
// 16-byte multiples for the row and L strides.
inline bool tma_output_supported(const void* out, int64_t N, int64_t row_stride, int64_t l_stride) {
  return reinterpret_cast<uintptr_t>(out) % 16 == 0 && N % 8 == 0 && row_stride % 8 == 0 && l_stride % 8 == 0;
}

// The tensor map of a bf16 output [L, M, N] with those strides (elements).
inline CUresult encode_output_map(TmaStoreArguments& args, void* out, int64_t M, int64_t N, int64_t L,
                                  int64_t row_stride, int64_t l_stride) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(M), static_cast<cuuint64_t>(L)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_stride) * 2, static_cast<cuuint64_t>(l_stride) * 2};
  const cuuint32_t box[3] = {kBoxCols, kTileRows, 1}, element_strides[3] = {1, 1, 1};
  return cutlass::call_cuTensorMapEncodeTiled(&args.tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, out, dims, strides, box,
                                             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                             CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// kTileCols: the tile's N (128 or 256). kPtrArray: for CUTLASS's pointer-array kernels (L = the group)
// or its plain ones (L = the batch index).
template <int kTileCols, bool kPtrArray>
class Epilogue {
  static_assert(kTileCols % kBoxCols == 0, "whole boxes");

 public:
  using EpilogueSchedule = std::conditional_t<kPtrArray, cutlass::epilogue::PtrArrayNoSmemWarpSpecialized,
                                              cutlass::epilogue::NoSmemWarpSpecialized>;
  using DispatchPolicy = EpilogueSchedule;
  using ElementAccumulator = float;
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using InternalStrideC = cute::Stride<int64_t, _1, _0>;
  using InternalStrideD = InternalStrideC;
  using StrideC = std::conditional_t<kPtrArray, InternalStrideC*, InternalStrideC>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  // Named by CUTLASS's device adapter only; the conversion below is the epilogue's whole arithmetic.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;

  // The tile as kTileCols / kBoxCols boxes of kTileRows rows of 128 bytes (the TMA's swizzled layout).
  struct SharedStorage {
    alignas(1024) __nv_bfloat16 tile[kTileRows * kTileCols];
  };
  using Arguments = TmaStoreArguments;
  using Params = TmaStoreArguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int = 0) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  // p is the kernel's own grid-constant parameter: the TMA unit reads the descriptor at its address.
  CUTLASS_HOST_DEVICE explicit Epilogue(Params const& p) : p_(p) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // Byte offset of tile element (r, c): box c / 64, then row r's 128 bytes with 16-byte chunk
  // (c % 64) / 8 XOR (r mod 8). The 8 rows of an 8x8 matrix a stmatrix writes then fall in 8 different
  // 16-byte bank groups.
  static CUTLASS_DEVICE int staged_byte(int r, int c) {
    return (c / kBoxCols) * (kTileRows * 128) + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2;
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char* smem) {
    static_assert(is_static<FrgLayout>::value, "the accumulator's layout must be static");
    static_assert(size<0>(BlockShapeMNK{}) == kTileRows && size<1>(BlockShapeMNK{}) == kTileCols,
                  "cooperative tiles of kTileRows x kTileCols");
    constexpr int kValues = static_cast<int>(size(FrgLayout{}));
    static_assert(kValues * 256 == kTileRows * kTileCols, "the two warp groups hold the whole tile");
    constexpr int kThreads = 256;
    const int barrier_id = static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);

    // The previous tile's boxes must have left the buffer (issued a whole tile of MMAs ago).
    if (thread_idx == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id);
    // A warp group's m64nN accumulator: thread t of warp w holds, for each 8-column block j, columns
    // 8 j + 2 (t % 4) + {0, 1} of rows 16 w + t / 4 (values 4 j, 4 j + 1) and 16 w + t / 4 + 8 (4 j + 2,
    // 4 j + 3): the fragment of four 8x8 matrices a stmatrix.x4 writes, two blocks at a time. Lane l
    // gives the address of row l % 8 of matrix l / 8 (top / bottom half of block j, then of j + 1).
    (void)tiled_mma;
    const int lane = thread_idx % 32, q = lane / 8;
    const int row = (thread_idx / 128) * 64 + (thread_idx / 32 % 4) * 16 + (q & 1) * 8 + lane % 8;
    const uint32_t s_buf = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    auto pack = [&](int i) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(acc(i), acc(i + 1));
      return *reinterpret_cast<const uint32_t*>(&v);
    };
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kTileCols / 8; j += 2) {
      const uint32_t at = s_buf + static_cast<uint32_t>(staged_byte(row, 8 * (j + q / 2)));
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(pack(4 * j)),
                   "r"(pack(4 * j + 2)), "r"(pack(4 * j + 4)), "r"(pack(4 * j + 6))
                   : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the writes, visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id);
    if (thread_idx == 0) {
      // Rows past M and columns past N are clipped by the tensor map's bounds.
      auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
      const int m0 = static_cast<int>(m_coord) * kTileRows, n0 = static_cast<int>(n_coord) * kTileCols;
      const uint64_t map = reinterpret_cast<uint64_t>(&p_.tmap);
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kTileCols / kBoxCols; ++b)
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
                     "r"(s_buf + b * kTileRows * 128), "r"(n0 + b * kBoxCols), "r"(m0), "r"(static_cast<int>(l_coord))
                     : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }

 private:
  Params const& p_;
};

// CUTLASS's adapter for operator-style epilogues, with two changes: tensor-map storage of its own (the
// stock one types it as the epilogue's shared storage and so reserves the staging buffer twice in the
// pointer-array kernels), and a store_tail, run once at the kernel's end, that waits until the last
// boxes have been read out of shared memory.
template <class EpilogueOp>
class TmaStoreAdapter : public cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp>;

 public:
  struct TensorMapStorage {};
  using Base::Base;

  CUTLASS_DEVICE auto load_init(typename EpilogueOp::Params const&, TensorMapStorage&, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }
  CUTLASS_DEVICE auto store_init(typename EpilogueOp::Params const&, TensorMapStorage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }
  template <bool IsLoad, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, typename EpilogueOp::Params const&,
                                                cute::TmaDescriptor const*, ProblemShapeMNKL, int32_t, int32_t) {}
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, cute::TmaDescriptor const*, int32_t) {}
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState>
  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadState load_state, StorePipeline, StoreState store_state) {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    return cute::make_tuple(load_state, store_state);
  }
};

template <int kTileCols, bool kPtrArray>
using StagedTileEpilogue = TmaStoreAdapter<Epilogue<kTileCols, kPtrArray>>;

}  // namespace epx::cuda::staged_tile
