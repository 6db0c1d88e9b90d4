// Wgrad with overwritten bf16 gradients whose cooperative tiles leave by TMA box stores from one staged
// tile: see wgrad_tma_store_sm90.cuh.
#include "cuda/gemm/cutlass/wgrad_tma_store_sm90.cuh"
#include "epx/error.h"

namespace epx::cuda {

bool wgrad_coop_tma_supports(const void* out, int64_t N, int64_t out_group_stride) {
  return staged_tile::tma_output_supported(out, N, N, out_group_stride);
}

void grouped_wgrad_bf16_out_coop_tma(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                     int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     Stream stream) {
  using Kn = wgrad_tma::CoopTmaStoreWgradKernel;
  const char* fn = "epx::grouped_wgrad_bf16_out_coop_tma";
  require(wgrad_coop_tma_supports(out, N, out_group_stride), fn, "the gradient must start on 16 bytes and N (", N,
          ") and the group stride (", out_group_stride, ") be multiples of 8 elements");
  if (groups == 0) return;
  cudaStream_t s = to_cuda(stream);
  grouped::Cache& c = grouped::cache_for(14);  // apart from the run() kernels (0-11) and the contiguous ones (12, 13)
  const grouped::Arrays<Kn> arr =
      grouped::device_arrays<Kn>(c, s, grouped::Mode::kWgrad, a, d, static_cast<cutlass::bfloat16_t*>(out), N,
                                 out_group_stride, K, N, offsets, rows, groups);
  staged_tile::TmaStoreArguments epi;
  const CUresult r = staged_tile::encode_output_map(epi, out, K, N, groups, N, out_group_stride);
  require_status(r == CUDA_SUCCESS, Status::kCudaError, fn, "cuTensorMapEncodeTiled failed (CUresult ",
                 static_cast<int>(r), ") for K = ", K, ", N = ", N, ", ", groups, " groups");
  typename Kn::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, arr.shapes, nullptr},
                                    {arr.a, arr.sa, arr.b, arr.sb},
                                    epi,
                                    grouped::hardware_info()};
  grouped::launch<typename Kn::Gemm>(args, c, s, fn, K, N, "rows and columns must be multiples of 8 elements");
}

}  // namespace epx::cuda
