// FP8 e4m3 forward with DeepSeek-V3's block scales (activations 1x128, weights 128x128, fp32 scales
// applied to the fp32 accumulator once per 128-deep K block), bf16 out: CUTLASS 3's pointer-array
// blockwise-scaled kernels (TMA + WGMMA, persistent) with our mainloop, which promotes K block k
// while block k + 1's MMAs run (fp8_overlapped_promotion_sm90.cuh; CUTLASS's own mainloop waits for
// each block's MMAs first and idles the tensor cores meanwhile), in two schedules:
//  - cooperative: 128x128x128 tiles, both consumer warp groups on one tile
//    (grouped_fp8_blockwise_sm90.cu);
//  - ping-pong: 64x128x128 tiles, one per consumer warp group, the two groups' tiles alternating, so
//    one group's epilogue runs under the other's MMAs (grouped_fp8_blockwise_pingpong_sm90.cu).
// Hopper's FP8 WGMMA reads both operands K-major, hence the transposed weights, and the kernels read
// each group's activation scales M-major from a block of its own (see grouped_gemm_cuda.h for both
// layouts). One translation unit per schedule, so they compile in parallel.
#pragma once

#include <type_traits>

#include "cuda/gemm/cutlass/fp8_overlapped_promotion_sm90.cuh"
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cutlass/detail/blockwise_scale_layout.hpp"

namespace epx::cuda::grouped_fp8 {

using namespace cute;

// Cooperative: no source operand C (the forward overwrites its output; C's shared-memory stages go
// to the mainloop) and 128x64 epilogue sub-tiles (two stores per tile instead of CUTLASS's four).
// On an H200 both together were 1.01-1.08x the same kernel with C and CUTLASS's sub-tiles, most at
// the short contractions (K = 2048) where the epilogue weighs most (bench/NOTES.md).
struct Cooperative {
  using TileShape = cute::Shape<_128, _128, _128>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using EpilogueTile = cute::Shape<_128, _64>;
  static constexpr bool kNoSource = true;
  static constexpr bool kOverlapPromotion = true;
  static constexpr int kCacheId = 100;  // apart from the bf16 kernels' cache ids
};
struct Pingpong {
  using TileShape = cute::Shape<_64, _128, _128>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  static constexpr bool kOverlapPromotion = true;
  static constexpr int kCacheId = 101;
};
// Trials (-DEPX_GEMM_TRIALS=ON), each bit-identical to the shipped schedule it derives from:
// CUTLASS's own mainloop, which waits for a K block's MMAs before promoting them (1.05-1.20x slower
// on an H200) ...
template <class Schedule, int kId>
struct WaitingPromotion : Schedule {
  static constexpr bool kOverlapPromotion = false;
  static constexpr int kCacheId = kId;
};
// ... cooperative tiles in clusters of two that share one operand's tiles through TMA multicast (B
// along M, A along N), since the 128x128x128 FP8 tile moves 32 KB from L2 per 4.2 MFLOP, twice the
// bf16 kernel's bytes per FLOP (on an H200 at its power cap within 3% of Cooperative, 2x1 1.5x
// slower at decode) ...
template <int kM, int kN, int kId>
struct CooperativeCluster : Cooperative {
  using ClusterShape = cute::Shape<cute::Int<kM>, cute::Int<kN>, _1>;
  static constexpr int kCacheId = kId;
};
// ... and the cooperative epilogue with the source operand C and CUTLASS's sub-tiles (the shipped one
// until the contest above), without C with CUTLASS's sub-tiles, or with 128x128 ones.
struct CooperativeWithSource : Cooperative {
  using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
  static constexpr bool kNoSource = false;
  static constexpr int kCacheId = 114;
};
template <class EpiTile, int kId>
struct CooperativeEpilogueTile : Cooperative {
  using EpilogueTile = EpiTile;
  static constexpr int kCacheId = kId;
};

template <class Schedule>
struct Fp8Parts {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // x rows, K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // w^T rows, K contiguous
  static constexpr int kAlignAB = 16;
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using ElementC = std::conditional_t<grouped::HasNoSource<Schedule>::value, void, ElementOut>;
  using Epilogue = grouped::PtrArrayEpilogue<TileShape, ClusterShape, ElementOut, typename Schedule::EpilogueSchedule,
                                             typename grouped::EpilogueTileOf<Schedule>::type, ElementC>;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::KernelSchedule>::CollectiveOp;
  using Mainloop = std::conditional_t<Schedule::kOverlapPromotion, OverlappedPromotionMainloop<BuiltMainloop>,
                                      BuiltMainloop>;
};

template <class Schedule>
struct Fp8Kernel : Fp8Parts<Schedule>,
                   grouped::KernelTypes<grouped::GroupShape, typename Fp8Parts<Schedule>::Mainloop,
                                        typename Fp8Parts<Schedule>::Epilogue> {};

template <class K_>
struct Fp8Arrays {
  typename K_::Shape3* shapes;
  const typename K_::ElementA** a;
  const typename K_::ElementB** b;
  const typename K_::ElementOut** c;
  typename K_::ElementOut** d;
  const float** sfa;
  const float** sfb;
  typename K_::StrideA* sa;
  typename K_::StrideB* sb;
  typename K_::StrideC* sc;
  typename K_::LayoutSFA* lsfa;
  typename K_::LayoutSFB* lsfb;
};

template <class K_>
__global__ void fp8_setup_kernel(Fp8Arrays<K_> arr, const uint8_t* a, const float* a_scales, const uint8_t* bt,
                                 const float* b_scales, cutlass::bfloat16_t* out, int64_t ld_out, int64_t K, int64_t N,
                                 const int32_t* offsets, const int32_t* rows, int groups) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int m = rows[g];
  const int64_t off = offsets[g];
  const int64_t kb = K / 128, nb = N / 128;
  arr.shapes[g] = typename K_::Shape3(m, static_cast<int>(N), static_cast<int>(K));
  arr.a[g] = reinterpret_cast<const typename K_::ElementA*>(a + off * K);
  arr.b[g] = reinterpret_cast<const typename K_::ElementB*>(bt + g * N * K);
  arr.c[g] = out + off * ld_out;
  arr.d[g] = out + off * ld_out;
  arr.sfa[g] = a_scales + off * kb;
  arr.sfb[g] = b_scales + g * kb * nb;
  arr.sa[g] = grouped::with_ld<typename K_::StrideA>(K);
  arr.sb[g] = grouped::with_ld<typename K_::StrideB>(K);
  arr.sc[g] = grouped::with_ld<typename K_::StrideC>(ld_out);
  arr.lsfa[g] = K_::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, static_cast<int>(N), static_cast<int>(K), 1));
  arr.lsfb[g] = K_::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, static_cast<int>(N), static_cast<int>(K), 1));
}

// The launch of one schedule (the arguments as grouped_forward_fp8_blockwise's).
template <class Schedule>
void forward(const void* a, const float* a_scales, const void* bt, const float* b_scales, void* out, int64_t ld_out,
             int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  using K_ = Fp8Kernel<Schedule>;
  if (groups == 0) return;
  cudaStream_t s = to_cuda(stream);
  grouped::Cache& c = grouped::cache_for(Schedule::kCacheId);
  Fp8Arrays<K_> arr;
  grouped::carve_arrays(c, groups, [&](grouped::ArrayCarver& k) {
    arr.shapes = k.next<typename K_::Shape3>();
    arr.a = k.next<const typename K_::ElementA*>();
    arr.b = k.next<const typename K_::ElementB*>();
    arr.c = k.next<const typename K_::ElementOut*>();
    arr.d = k.next<typename K_::ElementOut*>();
    arr.sfa = k.next<const float*>();
    arr.sfb = k.next<const float*>();
    arr.sa = k.next<typename K_::StrideA>();
    arr.sb = k.next<typename K_::StrideB>();
    arr.sc = k.next<typename K_::StrideC>();
    arr.lsfa = k.next<typename K_::LayoutSFA>();
    arr.lsfb = k.next<typename K_::LayoutSFB>();
  });
  fp8_setup_kernel<K_><<<(groups + 127) / 128, 128, 0, s>>>(
      arr, static_cast<const uint8_t*>(a), a_scales, static_cast<const uint8_t*>(bt), b_scales,
      static_cast<cutlass::bfloat16_t*>(out), ld_out, K, N, offsets, rows, groups);
  EPX_CHECK_LAUNCH("grouped fp8 setup_kernel");

  typename K_::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, arr.shapes, nullptr},
                                    {arr.a, arr.sa, arr.b, arr.sb, arr.sfa, arr.lsfa, arr.sfb, arr.lsfb},
                                    {{}, nullptr, arr.sc, arr.d, arr.sc},
                                    grouped::hardware_info()};
  args.epilogue.thread.alpha = 1.0f;
  if constexpr (!std::is_void_v<typename K_::ElementC>) {
    args.epilogue.ptr_C = arr.c;
    args.epilogue.thread.beta = 0.0f;
  }
  grouped::launch<typename K_::Gemm>(args, c, s, "epx::grouped_gemm_forward_fp8", K, N,
                                     "both must be multiples of 128");
}

}  // namespace epx::cuda::grouped_fp8
