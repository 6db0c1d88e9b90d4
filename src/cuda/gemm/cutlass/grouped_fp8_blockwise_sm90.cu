// FP8 e4m3 forward with DeepSeek-V3's block scales (activations 1x128, weights 128x128, fp32 scales
// applied to the fp32 accumulator once per 128-deep K block), bf16 out: CUTLASS 3's pointer-array
// blockwise-scaled kernel (TMA + WGMMA, cooperative, persistent). Hopper's FP8 WGMMA reads both
// operands K-major, hence the transposed weights, and the kernel reads each group's activation
// scales M-major from a block of its own (see grouped_gemm_cuda.h for both layouts).
#include "cuda/gemm/cutlass/grouped_sm90.cuh"
#include "cutlass/detail/blockwise_scale_layout.hpp"

namespace epx::cuda {
namespace {

using namespace cute;

struct Fp8Kernel {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // x rows, K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // w^T rows, K contiguous
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignC = 8;
  using TileShape = cute::Shape<_128, _128, _128>;
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementOut, LayoutC*, kAlignC, ElementOut,
      LayoutC*, kAlignC, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

struct Fp8Arrays {
  Fp8Kernel::Shape3* shapes;
  const Fp8Kernel::ElementA** a;
  const Fp8Kernel::ElementB** b;
  const Fp8Kernel::ElementOut** c;
  Fp8Kernel::ElementOut** d;
  const float** sfa;
  const float** sfb;
  Fp8Kernel::StrideA* sa;
  Fp8Kernel::StrideB* sb;
  Fp8Kernel::StrideC* sc;
  Fp8Kernel::LayoutSFA* lsfa;
  Fp8Kernel::LayoutSFB* lsfb;
};

__global__ void fp8_setup_kernel(Fp8Arrays arr, const uint8_t* a, const float* a_scales, const uint8_t* bt,
                                 const float* b_scales, cutlass::bfloat16_t* out, int64_t ld_out, int64_t K, int64_t N,
                                 const int32_t* offsets, const int32_t* rows, int groups) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int m = rows[g];
  const int64_t off = offsets[g];
  const int64_t kb = K / 128, nb = N / 128;
  arr.shapes[g] = Fp8Kernel::Shape3(m, static_cast<int>(N), static_cast<int>(K));
  arr.a[g] = reinterpret_cast<const Fp8Kernel::ElementA*>(a + off * K);
  arr.b[g] = reinterpret_cast<const Fp8Kernel::ElementB*>(bt + g * N * K);
  arr.c[g] = out + off * ld_out;
  arr.d[g] = out + off * ld_out;
  arr.sfa[g] = a_scales + off * kb;
  arr.sfb[g] = b_scales + g * kb * nb;
  arr.sa[g] = grouped::with_ld<Fp8Kernel::StrideA>(K);
  arr.sb[g] = grouped::with_ld<Fp8Kernel::StrideB>(K);
  arr.sc[g] = grouped::with_ld<Fp8Kernel::StrideC>(ld_out);
  arr.lsfa[g] = Fp8Kernel::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, static_cast<int>(N), static_cast<int>(K), 1));
  arr.lsfb[g] = Fp8Kernel::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, static_cast<int>(N), static_cast<int>(K), 1));
}

constexpr int kFp8CacheId = 100;  // apart from the bf16 kernels' cache ids

}  // namespace

void grouped_forward_fp8_blockwise(const void* a, const float* a_scales, const void* bt, const float* b_scales,
                                   void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                   const int32_t* rows, int groups, Stream stream) {
  using K_ = Fp8Kernel;
  if (groups == 0) return;
  cudaStream_t s = to_cuda(stream);
  grouped::Cache& c = grouped::cache_for(kFp8CacheId);
  auto up = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t G = static_cast<size_t>(groups);
  const size_t need = up(G * sizeof(K_::Shape3)) + 6 * up(G * sizeof(void*)) + up(G * sizeof(K_::StrideA)) +
                      up(G * sizeof(K_::StrideB)) + up(G * sizeof(K_::StrideC)) + up(G * sizeof(K_::LayoutSFA)) +
                      up(G * sizeof(K_::LayoutSFB));
  if (c.arrays_bytes < need) {
    if (c.arrays) EPX_CUDA_CHECK(cudaFree(c.arrays));
    EPX_CUDA_CHECK(cudaMalloc(&c.arrays, need));
    c.arrays_bytes = need;
  }
  char* p = static_cast<char*>(c.arrays);
  auto take = [&](size_t bytes) {
    char* at = p;
    p += up(bytes);
    return at;
  };
  Fp8Arrays arr;
  arr.shapes = reinterpret_cast<K_::Shape3*>(take(G * sizeof(K_::Shape3)));
  arr.a = reinterpret_cast<const K_::ElementA**>(take(G * sizeof(void*)));
  arr.b = reinterpret_cast<const K_::ElementB**>(take(G * sizeof(void*)));
  arr.c = reinterpret_cast<const K_::ElementOut**>(take(G * sizeof(void*)));
  arr.d = reinterpret_cast<K_::ElementOut**>(take(G * sizeof(void*)));
  arr.sfa = reinterpret_cast<const float**>(take(G * sizeof(void*)));
  arr.sfb = reinterpret_cast<const float**>(take(G * sizeof(void*)));
  arr.sa = reinterpret_cast<K_::StrideA*>(take(G * sizeof(K_::StrideA)));
  arr.sb = reinterpret_cast<K_::StrideB*>(take(G * sizeof(K_::StrideB)));
  arr.sc = reinterpret_cast<K_::StrideC*>(take(G * sizeof(K_::StrideC)));
  arr.lsfa = reinterpret_cast<K_::LayoutSFA*>(take(G * sizeof(K_::LayoutSFA)));
  arr.lsfb = reinterpret_cast<K_::LayoutSFB*>(take(G * sizeof(K_::LayoutSFB)));
  fp8_setup_kernel<<<(groups + 127) / 128, 128, 0, s>>>(
      arr, static_cast<const uint8_t*>(a), a_scales, static_cast<const uint8_t*>(bt), b_scales,
      static_cast<cutlass::bfloat16_t*>(out), ld_out, K, N, offsets, rows, groups);
  EPX_CHECK_LAUNCH("grouped fp8 setup_kernel");

  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = dev;
  hw.sm_count = sm_count();
  typename K_::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, arr.shapes, nullptr},
                                    {arr.a, arr.sa, arr.b, arr.sb, arr.sfa, arr.lsfa, arr.sfb, arr.lsfb},
                                    {{}, arr.c, arr.sc, arr.d, arr.sc},
                                    hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  typename K_::Gemm gemm;
  require_status(gemm.can_implement(args) == cutlass::Status::kSuccess, Status::kNotSupported,
                 "epx::grouped_gemm_forward_fp8", "CUTLASS cannot run this grouped problem (K = ", K, ", N = ", N,
                 "; both must be multiples of 128)");
  const size_t ws = K_::Gemm::get_workspace_size(args);
  if (c.workspace_bytes < ws) {
    if (c.workspace) EPX_CUDA_CHECK(cudaFree(c.workspace));
    EPX_CUDA_CHECK(cudaMalloc(&c.workspace, ws));
    c.workspace_bytes = ws;
  }
  require_status(gemm.initialize(args, c.workspace, s) == cutlass::Status::kSuccess, Status::kCudaError,
                 "epx::grouped_gemm_forward_fp8", "CUTLASS initialize failed");
  require_status(gemm.run(s) == cutlass::Status::kSuccess, Status::kCudaError, "epx::grouped_gemm_forward_fp8",
                 "CUTLASS run failed");
  EPX_CHECK_LAUNCH("CUTLASS grouped FP8 GEMM");
}

}  // namespace epx::cuda
