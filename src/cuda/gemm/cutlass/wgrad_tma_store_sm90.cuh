// Wgrad with overwritten bf16 gradients on cooperative 128x256 tiles whose epilogue stages the whole
// tile once and leaves it to the TMA unit.
//
// Why: with an expert's ~256 rows as the contraction, a wgrad tile's MMAs are short and its output
// large, and the epilogue decides the rate. Without any epilogue the cooperative and ping-pong mainloops
// both run FC1's DeepSeek-V3 wgrad at the forward's rate (~2.5-2.8 ms on an H200), CUTLASS's epilogues
// take it to ~4.2 ms (bench/NOTES.md). CUTLASS's TMA epilogue stores sub-tiles through two small
// buffers and waits on the store two sub-tiles back before writing the next, so the math warp groups
// wait on the stores inside every tile. Here the whole tile (64 KB) is staged at once: both warp groups
// convert their accumulators into it (stmatrix, 16 a thread), fence, synchronise, and one thread issues four box stores
// without waiting for them; the next tile's epilogue waits for their reads before it writes the buffer,
// by which time a whole tile of MMAs has hidden them. The price is shared memory: three mainloop stages
// instead of four.
//
// The gradients must be evenly strided (group g at out + g * group_stride, rows of N elements), which
// wgrad's are: one [G, K, N] tensor map then addresses every group, so no descriptor is rewritten when
// a CTA moves to another group.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include "cutlass/arch/barrier.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"

namespace epx::cuda::wgrad_tma {

using namespace cute;

inline constexpr int kTileRows = 128, kTileCols = 256;
inline constexpr int kBoxCols = 64;  // a 128-byte-swizzled box is at most 128 bytes wide

struct TmaStoreArguments {
  CUtensorMap tmap;  // [G, K, N] bf16, boxes of kTileRows x kBoxCols, 128-byte swizzle
};

class CoopTmaStoreEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementAccumulator = float;
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using InternalStrideC = cute::Stride<int64_t, _1, _0>;
  using InternalStrideD = InternalStrideC;
  using StrideC = InternalStrideC*;
  using StrideD = InternalStrideD*;
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
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
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
  CUTLASS_HOST_DEVICE explicit CoopTmaStoreEpilogue(Params const& p) : p_(p) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // Byte offset of tile element (r, c): box c / 64, then row r's 128 bytes with 16-byte chunk
  // (c % 64) / 8 XOR (r mod 8). The 8 rows of an 8x8 matrix a stmatrix writes then fall in 8 different
  // 16-byte bank groups.
  static CUTLASS_DEVICE int staged_byte(int r, int c) {
    return (c / kBoxCols) * (kTileRows * 128) + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2;
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK blk_shape, BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char* smem) {
    static_assert(is_static<FrgLayout>::value, "the accumulator's layout must be static");
    static_assert(size<0>(BlockShapeMNK{}) == kTileRows && size<1>(BlockShapeMNK{}) == kTileCols,
                  "cooperative 128x256 tiles");
    constexpr int kValues = static_cast<int>(size(FrgLayout{}));
    static_assert(kValues * 256 == kTileRows * kTileCols, "the two warp groups hold the whole tile");
    constexpr int kThreads = 256;
    const int barrier_id = static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);

    // The previous tile's boxes must have left the buffer (issued a whole tile of MMAs ago).
    if (thread_idx == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id);
    // A warp group's m64n256 accumulator: thread t of warp w holds, for each 8-column block j, columns
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
      // Rows past K and columns past N are clipped by the tensor map's bounds.
      auto [m_coord, n_coord, k_coord, group] = blk_coord;
      const int m0 = static_cast<int>(m_coord) * kTileRows, n0 = static_cast<int>(n_coord) * kTileCols;
      const uint64_t map = reinterpret_cast<uint64_t>(&p_.tmap);
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kTileCols / kBoxCols; ++b)
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
                     "r"(s_buf + b * kTileRows * 128), "r"(n0 + b * kBoxCols), "r"(m0), "r"(static_cast<int>(group))
                     : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }

 private:
  Params const& p_;
};

// CUTLASS's adapter for operator-style epilogues, with two changes: tensor-map storage of its own (the
// stock one types it as the epilogue's shared storage and so reserves the 64 KB buffer twice), and a
// store_tail, run once at the kernel's end, that waits until the last boxes have been read out of
// shared memory.
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

// bf16 activations [rows, K] (A, read as column-major [K, rows]) and gradients of the next layer
// [rows, N] (B, row-major); cooperative 128x256x64 tiles, no cluster.
struct CoopTmaStoreWgradKernel {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = void;
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using Epilogue = TmaStoreAdapter<CoopTmaStoreEpilogue>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::ColumnMajor*, 8, ElementB,
      cutlass::layout::RowMajor*, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(CoopTmaStoreEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Types = grouped::KernelTypes<grouped::GroupShape, Mainloop, Epilogue>;
  using GemmKernel = typename Types::GemmKernel;
  using Gemm = typename Types::Gemm;
  using StrideA = typename Types::StrideA;
  using StrideB = typename Types::StrideB;
  using StrideC = typename Types::StrideC;
  using Shape3 = typename Types::Shape3;
};

}  // namespace epx::cuda::wgrad_tma
