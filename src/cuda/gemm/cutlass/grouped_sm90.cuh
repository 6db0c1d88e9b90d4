// One CUTLASS 3 pointer-array grouped GEMM (TMA + WGMMA, warp-specialised cooperative, persistent),
// and the setup kernel that builds its per-group problem shapes, pointers and strides from the
// device-side offsets/rows. Each .cu next to this file instantiates one layout combination, so the
// three kernels compile in parallel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/default_epilogue.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "core/gemm_sm_limit.h"
#include "cuda/common/cuda_check.h"
#include "cuda/gemm/cutlass/k_tail_mainloop_sm90.cuh"
#include "cuda/gemm/grouped_gemm_cuda.h"

namespace epx::cuda::grouped {

using namespace cute;

enum class Mode { kForward, kDgrad, kWgrad };

// Two warp groups on one 128x256 tile: the most math per byte, best when every tile has a long
// contraction (forward, dgrad).
struct Cooperative {
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// Cooperative for the forward and dgrad, which overwrite their outputs: no source operand C (its
// shared-memory stages go to the mainloop) and 128x64 epilogue sub-tiles (CUTLASS picks 128x32). On an
// H200, in two interleaved contests (bench_grouped_gemm --forward, trials build), 1.01-1.03x
// Cooperative at every forward shape and 1.01-1.03x at dgrad, bit-identical; without C but with
// CUTLASS's sub-tiles it was level, with 128x128 ones (CooperativeNoSource below) 0.96-1.03x.
struct CooperativeOverwrite : Cooperative {
  using EpilogueTile = cute::Shape<_128, _64>;
  static constexpr bool kNoSource = true;
};
// Two warp groups on alternating 128x128 tiles: one stores its tile while the other computes, which
// pays off when the contraction is short and the output large (wgrad over a few hundred rows per
// expert writes a whole [K, N] gradient per expert).
struct Pingpong {
  using TileShape = cute::Shape<_128, _128, _64>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Cooperative 128x256 tiles without the source operand C (no beta: overwriting only) and with
// 128x128 epilogue sub-tiles instead of CUTLASS's 128x32: the shared memory C's stages held goes to
// the mainloop, and each tile's epilogue is two stores instead of eight. For wgrad with overwritten
// bf16 gradients, where the epilogue writes a whole [K, N] gradient after a short contraction: on an
// H200, 9-11% faster than either schedule above at DeepSeek-V3's shapes (128 groups x 256 rows) and
// within 3% of ping-pong at 32 groups x 1024 rows (bench_grouped_gemm --wgrad CASE trials). Not for
// the forward and dgrad: with their long contractions it was 5-12% slower than Cooperative
// (bench_grouped_gemm with -DEPX_GEMM_TRIALS=ON).
struct CooperativeNoSource {
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using EpilogueTile = cute::Shape<_128, _128>;
  static constexpr bool kNoSource = true;
};

// Ping-pong 128x128 tiles without the source operand C, with 64x64 epilogue sub-tiles (CUTLASS's
// choice: 64x32), in pairs along M that share their B tile by TMA multicast: one warp group stores
// its tile while the other computes, the shared memory C's stages held goes to the mainloop, and B
// is read from L2 once per pair. For wgrad with overwritten bf16 gradients, whose M is the hidden or
// FFN size (always whole tile pairs at real shapes). On an H200, timed interleaved at the sustained
// clock (bench_grouped_gemm --wgrad CASE trials): 1.13x CooperativeNoSource at DeepSeek-V3's shapes
// with 256 rows a group and 1.11x at 32 groups x 1024 rows (the 2x1 cluster gives 1-2% and 8% of
// that), 0.9x at 128 rows a group, where wgrad_schedule() keeps CooperativeNoSource.
// Its mainloop issues only the MMAs of a group's last K block that reach its rows (k_tail_mainloop_sm90.cuh).
struct PingpongNoSource {
  using TileShape = cute::Shape<_128, _128, _64>;
  using ClusterShape = cute::Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using EpilogueTile = cute::Shape<_64, _64>;
  static constexpr bool kNoSource = true;
  static constexpr bool kTrimmedKTail = true;
};

// Cooperative tiles in pairs along M that share their B tile through TMA multicast: half the B
// traffic from L2, for GEMMs whose short contraction leaves them bound by operand loads (wgrad).
struct CooperativeCluster2x1 {
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// The same in pairs along N sharing their A tile: a group's M tiles need not come in pairs (a group
// with an odd tile count leaves half a 2x1 cluster idle on its last tile), its N tiles always do
// when N is a multiple of 512. Trials only: for the forward and dgrad both cluster shapes were within
// 3% of Cooperative on an H200 at its power cap (bench/NOTES.md).
struct CooperativeCluster1x2 {
  using TileShape = cute::Shape<_128, _256, _64>;
  using ClusterShape = cute::Shape<_1, _2, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// A schedule may set the epilogue's sub-tile (EpilogueTile; CUTLASS's choice otherwise) and drop
// the source operand C (kNoSource: no beta, no shared memory for C stages).
template <class S, class = void>
struct EpilogueTileOf {
  using type = cutlass::epilogue::collective::EpilogueTileAuto;
};
template <class S>
struct EpilogueTileOf<S, std::void_t<typename S::EpilogueTile>> {
  using type = typename S::EpilogueTile;
};
template <class S, class = void>
struct HasNoSource : std::false_type {};
template <class S>
struct HasNoSource<S, std::void_t<decltype(S::kNoSource)>> : std::bool_constant<S::kNoSource> {};
template <class S, class = void>
struct TrimsKTail : std::false_type {};
template <class S>
struct TrimsKTail<S, std::void_t<decltype(S::kTrimmedKTail)>> : std::bool_constant<S::kTrimmedKTail> {};

// The pointer-array epilogue of every grouped kernel: D = alpha * the fp32 accumulator + beta * C,
// converted to ElementOut, row-major, 16-byte aligned rows (ElementC void: D = the accumulator).
template <class TileShape, class ClusterShape, class ElementOut, class EpilogueSchedule,
          class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto, class ElementC = ElementOut>
using PtrArrayEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpiTile, float, float, ElementC,
    cutlass::layout::RowMajor*, 16 / sizeof(ElementOut), ElementOut, cutlass::layout::RowMajor*,
    16 / sizeof(ElementOut), EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementOut, float, ElementC>>::CollectiveOp;

// An SM90 block's shared memory (227 KB). The sm90 pointer-array kernels do not check their storage
// against it at compile time; a kernel over it fails only at run time, in CUTLASS's initialize. The
// forward's and dgrad's kernels (CooperativeOverwrite) use all of it.
constexpr int kSm90SmemBytes = 232448;

// What a launcher needs of a grouped kernel made of this mainloop and epilogue.
template <class ProblemShape_, class Mainloop, class Epilogue>
struct KernelTypes {
  using ProblemShape = ProblemShape_;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  static_assert(GemmKernel::SharedStorageSize <= kSm90SmemBytes, "the kernel's shared memory exceeds the SM's");
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

using GroupShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

// The bf16 grouped kernels' operands and collectives (the launcher's view: Kernel below).
template <class LayoutA, class LayoutB, class ElementOut, class Schedule>
struct Bf16Parts {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  static constexpr int kAlignAB = 8;
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;
  using ElementC = std::conditional_t<HasNoSource<Schedule>::value, void, ElementOut>;
  using Epilogue = PtrArrayEpilogue<TileShape, ClusterShape, ElementOut, typename Schedule::EpilogueSchedule,
                                    typename EpilogueTileOf<Schedule>::type, ElementC>;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB, LayoutB*, kAlignAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::MainloopSchedule>::CollectiveOp;
  using Mainloop = std::conditional_t<TrimsKTail<Schedule>::value, KTailMainloop<BuiltMainloop>, BuiltMainloop>;
};

template <class LayoutA, class LayoutB, class ElementOut, class Schedule = Cooperative,
          class Parts = Bf16Parts<LayoutA, LayoutB, ElementOut, Schedule>>
struct Kernel : Parts, KernelTypes<GroupShape, typename Parts::Mainloop, typename Parts::Epilogue> {};

// Sets the one dynamic (int64) mode of a cute stride: the leading dimension.
template <class S>
__device__ __forceinline__ S with_ld(int64_t ld) {
  S s{};
  if constexpr (cute::is_integral<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value &&
                !cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value)
    cute::get<0>(s) = ld;
  else
    cute::get<1>(s) = ld;
  return s;
}

template <class K>
struct Arrays {
  typename K::Shape3* shapes;
  const typename K::ElementA** a;
  const typename K::ElementB** b;
  const void** c;
  void** d;
  typename K::StrideA* sa;
  typename K::StrideB* sb;
  typename K::StrideC* sc;
};

template <class K, class Out>
__global__ void setup_kernel(Mode mode, Arrays<K> arr, GroupedOperand a, GroupedOperand b, Out* out, int64_t ld_out,
                             int64_t out_group_stride, int64_t Kd, int64_t N, const int32_t* offsets,
                             const int32_t* rows, int groups) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int32_t m = rows[g];
  const int64_t off = offsets[g];
  const auto* A = static_cast<const typename K::ElementA*>(a.ptr);
  const auto* B = static_cast<const typename K::ElementB*>(b.ptr);
  if (mode == Mode::kWgrad) {
    // out_g [Kd, N] = a_g^T . b_g: the contraction runs over the group's rows.
    arr.shapes[g] = typename K::Shape3(m > 0 ? static_cast<int>(Kd) : 0, static_cast<int>(N), m);
    arr.a[g] = A + off * a.ld;
    arr.b[g] = B + off * b.ld;
    Out* o = out + g * out_group_stride;
    arr.c[g] = o;
    arr.d[g] = o;
    arr.sc[g] = with_ld<typename K::StrideC>(N);
  } else {
    arr.shapes[g] = typename K::Shape3(m, static_cast<int>(N), static_cast<int>(Kd));
    arr.a[g] = A + off * a.ld;
    arr.b[g] = B + g * b.group_stride;
    Out* o = out + off * ld_out;
    arr.c[g] = o;
    arr.d[g] = o;
    arr.sc[g] = with_ld<typename K::StrideC>(ld_out);
  }
  arr.sa[g] = with_ld<typename K::StrideA>(a.ld);
  arr.sb[g] = with_ld<typename K::StrideB>(b.ld);
}

// Per-device cached arrays and workspace, grown on demand (outside the hot path after the first
// call of a shape class; a CUDA graph must be captured after a warm-up call).
struct Cache {
  void* arrays = nullptr;
  size_t arrays_bytes = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

inline Cache& cache_for(int kernel_id) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, Cache> caches;
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  return caches[{dev, kernel_id}];
}

// Grows a cached device buffer to at least `bytes` (its old contents are not kept).
inline void grow(void*& ptr, size_t& have, size_t bytes) {
  if (have >= bytes) return;
  if (ptr) EPX_CUDA_CHECK(cudaFree(ptr));
  EPX_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  have = bytes;
}

// Hands out per-group device arrays, each 256-byte aligned, one after the other from `base`; with
// a null base it only adds up the bytes they need.
struct ArrayCarver {
  size_t groups;
  char* base;
  size_t used = 0;
  template <class T>
  T* next() {
    T* at = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (groups * sizeof(T) + 255) / 256 * 256;
    return at;
  }
};

// Lays a kernel's per-group arrays out in its cached array buffer (grown on demand): `assign`
// takes each array with carver.next<T>() in a fixed order; it runs twice, to size the buffer and
// then to hand out the pointers.
template <class Assign>
void carve_arrays(Cache& c, int groups, Assign&& assign) {
  ArrayCarver size{static_cast<size_t>(groups), nullptr};
  assign(size);
  grow(c.arrays, c.arrays_bytes, size.used);
  ArrayCarver real{static_cast<size_t>(groups), static_cast<char*>(c.arrays)};
  assign(real);
}

// The order the persistent scheduler hands out each group's tiles in. Along M (CUTLASS's choice for
// grouped problems), the CTAs running at once share B (weight) tiles; along N they share A tiles;
// swizzle (1, 2, 4 or 8) walks blocks of that many tiles across the other dimension.
struct TileOrder {
  bool along_n = false;
  int swizzle = 1;
};

// CUTLASS's order (along M, no swizzle) unless EPX_GEMM_RASTER=m|n or EPX_GEMM_SWIZZLE=1|2|4|8 say
// otherwise (read at each call, so a benchmark can compare them in one process; none was faster in
// bench_grouped_gemm's trials, bench/NOTES.md).
inline TileOrder tile_order() {
  TileOrder order;
  if (const char* v = std::getenv("EPX_GEMM_RASTER"); v != nullptr && *v != '\0') {
    require(std::strcmp(v, "m") == 0 || std::strcmp(v, "n") == 0, "epx::grouped_gemm", "EPX_GEMM_RASTER is \"", v,
            "\", expected m or n");
    order.along_n = v[0] == 'n';
  }
  if (const char* v = std::getenv("EPX_GEMM_SWIZZLE"); v != nullptr && *v != '\0') {
    const int sw = std::atoi(v);
    require(sw == 1 || sw == 2 || sw == 4 || sw == 8, "epx::grouped_gemm", "EPX_GEMM_SWIZZLE is \"", v,
            "\", expected 1, 2, 4 or 8");
    order.swizzle = sw;
  }
  return order;
}

template <class Arguments>
void set_tile_order(Arguments& args) {
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  const TileOrder order = tile_order();
  args.scheduler.raster_order = order.along_n ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = order.swizzle;
}

// The persistent grid: every SM, or the caller's thread's limit (detail::GemmSmLimit).
inline cutlass::KernelHardwareInfo hardware_info() {
  cutlass::KernelHardwareInfo hw;
  EPX_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  const int limit = ::epx::detail::gemm_sm_limit();
  hw.sm_count = limit > 0 && limit < sm_count() ? limit : sm_count();
  return hw;
}

// Checks that CUTLASS can run `args`, sizes the cached workspace and launches on `s`. fn names the
// op in errors; Kd, N and `rule` say which shapes it was given and what they must satisfy.
template <class Gemm>
void launch(typename Gemm::Arguments args, Cache& c, cudaStream_t s, const char* fn, int64_t Kd, int64_t N,
            const char* rule) {
  set_tile_order(args);
  Gemm gemm;
  require_status(gemm.can_implement(args) == cutlass::Status::kSuccess, Status::kNotSupported, fn,
                 "CUTLASS cannot run this grouped problem (K = ", Kd, ", N = ", N, "; ", rule, ")");
  grow(c.workspace, c.workspace_bytes, Gemm::get_workspace_size(args));
  require_status(gemm.initialize(args, c.workspace, s) == cutlass::Status::kSuccess, Status::kCudaError, fn,
                 "CUTLASS initialize failed");
  require_status(gemm.run(s) == cutlass::Status::kSuccess, Status::kCudaError, fn, "CUTLASS run failed");
  EPX_CHECK_LAUNCH("CUTLASS grouped GEMM");
}

// The per-group problem shapes, pointers and strides of kernel K in c's array buffer, written on the
// device by setup_kernel (queued on s) from the device-side offsets / rows.
template <class K, class Out>
Arrays<K> device_arrays(Cache& c, cudaStream_t s, Mode mode, GroupedOperand a, GroupedOperand b, Out* out,
                        int64_t ld_out, int64_t out_group_stride, int64_t Kd, int64_t N, const int32_t* offsets,
                        const int32_t* rows, int groups) {
  Arrays<K> arr;
  carve_arrays(c, groups, [&](ArrayCarver& k) {
    arr.shapes = k.next<typename K::Shape3>();
    arr.a = k.next<const typename K::ElementA*>();
    arr.b = k.next<const typename K::ElementB*>();
    arr.c = k.next<const void*>();
    arr.d = k.next<void*>();
    arr.sa = k.next<typename K::StrideA>();
    arr.sb = k.next<typename K::StrideB>();
    arr.sc = k.next<typename K::StrideC>();
  });
  setup_kernel<K, Out><<<(groups + 127) / 128, 128, 0, s>>>(mode, arr, a, b, out, ld_out, out_group_stride, Kd, N,
                                                            offsets, rows, groups);
  EPX_CHECK_LAUNCH("grouped setup_kernel");
  return arr;
}

template <class K, class Out>
void run(int kernel_id, Mode mode, GroupedOperand a, GroupedOperand b, Out* out, int64_t ld_out,
         int64_t out_group_stride, int64_t Kd, int64_t N, float beta, const int32_t* offsets, const int32_t* rows,
         int groups, Stream stream) {
  if (groups == 0) return;
  cudaStream_t s = to_cuda(stream);
  Cache& c = cache_for(kernel_id);
  const Arrays<K> arr =
      device_arrays<K>(c, s, mode, a, b, out, ld_out, out_group_stride, Kd, N, offsets, rows, groups);

  using ElementOut = Out;
  typename K::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, arr.shapes, nullptr},
      {arr.a, arr.sa, arr.b, arr.sb},
      {{}, nullptr, arr.sc, reinterpret_cast<ElementOut**>(arr.d), arr.sc},
      hardware_info()};
  args.epilogue.thread.alpha = 1.0f;
  if constexpr (std::is_void_v<typename K::ElementC>) {
    require_status(beta == 0.0f, Status::kNotSupported, "epx::grouped_gemm",
                   "this kernel has no source operand: beta is ", beta, ", expected 0");
  } else {
    args.epilogue.ptr_C = reinterpret_cast<const ElementOut**>(arr.c);
    args.epilogue.thread.beta = beta;
  }
  launch<typename K::Gemm>(args, c, s, "epx::grouped_gemm", Kd, N, "rows and columns must be multiples of 8 elements");
}

}  // namespace epx::cuda::grouped
