#include "cuda/router/router_lane.h"

#include "cuda/common/cuda_check.h"
#include "cuda/router/router_lane_kernels.cuh"

namespace epx::cuda {
namespace {

namespace rk = router_kernels;

template <int E, int SF, bool kBias>
void launch_one(int grid, cudaStream_t s, const rk::FwdParams& p) {
  const auto kernel = rk::route_forward_lane_kernel<E, SF, kBias>;
  constexpr int smem = rk::lane_smem_bytes<E>();
  // The staged tiles pass the default 48 KB: opt in on the current device at every launch (a
  // function attribute, not a stream operation: fine under graph capture).
  EPX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, rk::kThreads, smem, s>>>(p);
  EPX_CHECK_LAUNCH("route_forward_lane_kernel");
}

template <int E, int SF>
void launch_bias(int grid, cudaStream_t s, const rk::FwdParams& p) {
  if (p.bias != nullptr)
    launch_one<E, SF, true>(grid, s, p);
  else
    launch_one<E, SF, false>(grid, s, p);
}

template <int E>
void launch_e(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  if (sf == rk::kScoreSoftmax)
    launch_bias<E, rk::kScoreSoftmax>(grid, s, p);
  else
    launch_bias<E, rk::kScoreSigmoid>(grid, s, p);
}

}  // namespace

bool lane_router_supports(const rk::FwdParams& p, int sf, bool bf16) {
  if (bf16 || (p.E != 128 && p.E != 256)) return false;
  if (p.K > rk::kLaneSlots - 1 || !p.vec_ok || p.G > 1) return false;
  return sf == rk::kScoreSoftmax || sf == rk::kScoreSigmoid;
}

int lane_router_blocks() { return sm_count(); }

void launch_route_forward_lane(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  if (p.E == 128)
    launch_e<128>(sf, grid, s, p);
  else
    launch_e<256>(sf, grid, s, p);
}

}  // namespace epx::cuda
