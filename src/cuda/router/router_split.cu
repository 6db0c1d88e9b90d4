#include "cuda/router/router_split.h"

#include "cuda/common/cuda_check.h"
#include "cuda/router/router_split_kernels.cuh"

namespace epx::cuda {
namespace {

namespace rk = router_kernels;

template <int E, int SF, bool kBias, int GPT>
void launch_one(int grid, cudaStream_t s, const rk::FwdParams& p) {
  const auto kernel = rk::route_forward_split_kernel<E, SF, kBias, GPT>;
  constexpr int smem = rk::split_smem_bytes();
  // The tiles (64 KB) pass the default 48 KB of dynamic shared memory: opt in on the current device at
  // every launch (a function attribute, per device, not a stream operation: fine under graph capture).
  EPX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  rk::launch_router_kernel("launch of route_forward_split_kernel", kernel, grid, smem, s, p);
}

// Groups per lane: none, one of 64 experts or two of 32.
int groups_per_lane(const rk::FwdParams& p) { return p.G <= 1 ? 0 : p.per == 64 ? 1 : 2; }

template <int E, bool kBias>
void launch_groups(int grid, cudaStream_t s, const rk::FwdParams& p) {
  switch (groups_per_lane(p)) {
    case 0: launch_one<E, rk::kScoreSigmoid, kBias, 0>(grid, s, p); break;
    case 1: launch_one<E, rk::kScoreSigmoid, kBias, 1>(grid, s, p); break;
    default: launch_one<E, rk::kScoreSigmoid, kBias, 2>(grid, s, p); break;
  }
}

template <int E>
void launch_e(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  if (sf == rk::kScoreSoftmax)
    launch_one<E, rk::kScoreSoftmax, false, 0>(grid, s, p);
  else if (p.bias != nullptr)
    launch_groups<E, true>(grid, s, p);
  else
    launch_groups<E, false>(grid, s, p);
}

}  // namespace

bool split_router_supports(const rk::FwdParams& p, bool bf16, int sf) {
  if (bf16 || !p.vec_ok) return false;
  if (p.E != 128 && p.E != 256 && p.E != 512) return false;
  if (p.K < 1 || p.K > 8) return false;
  if (sf == rk::kScoreSoftmax) return p.bias == nullptr && p.G <= 1;
  if (sf != rk::kScoreSigmoid) return false;
  return p.G <= 1 || (p.per * p.G == p.E && (p.per == 32 || p.per == 64));
}

int split_router_blocks() { return sm_count() * rk::kSplitBlocksPerSm; }

void launch_route_forward_split(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  switch (p.E) {
    case 128: launch_e<128>(sf, grid, s, p); break;
    case 256: launch_e<256>(sf, grid, s, p); break;
    default: launch_e<512>(sf, grid, s, p); break;
  }
}

}  // namespace epx::cuda
