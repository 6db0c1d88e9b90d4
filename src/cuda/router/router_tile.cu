#include "cuda/router/router_tile.h"

#include <algorithm>
#include <atomic>

#include "cuda/common/cuda_check.h"
#include "cuda/router/router_tile_kernels.cuh"

namespace epx::cuda {
namespace {

namespace rk = router_kernels;

// Each instantiation needs its dynamic shared memory opted in, once per device.
constexpr int kMaxDevices = 64;

template <int E, int SF, int KMAX>
void launch_one(int grid, cudaStream_t s, const rk::FwdParams& p) {
  static std::atomic<bool> opted[kMaxDevices];
  constexpr int bytes = rk::TileLayout<E>::kBlockBytes;
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kMaxDevices || !opted[dev].load(std::memory_order_acquire)) {
    EPX_CUDA_CHECK(cudaFuncSetAttribute(rk::route_forward_tile_kernel<E, SF, KMAX>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (dev < kMaxDevices) opted[dev].store(true, std::memory_order_release);
  }
  rk::route_forward_tile_kernel<E, SF, KMAX><<<grid, rk::kThreads, bytes, s>>>(p);
  EPX_CHECK_LAUNCH("route_forward_tile_kernel");
}

template <int E, int KMAX>
void launch_sf(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  switch (sf) {
    case rk::kScoreSoftmax: launch_one<E, rk::kScoreSoftmax, KMAX>(grid, s, p); break;
    case rk::kScoreSoftmaxAfterTopk: launch_one<E, rk::kScoreSoftmaxAfterTopk, KMAX>(grid, s, p); break;
    default: launch_one<E, rk::kScoreSigmoid, KMAX>(grid, s, p); break;
  }
}

template <int E>
void launch_e(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  if (p.K <= 8)
    launch_sf<E, 8>(sf, grid, s, p);
  else
    launch_sf<E, 16>(sf, grid, s, p);
}

}  // namespace

bool tile_router_supports(const rk::FwdParams& p, bool bf16) {
  if (bf16 || !p.vec_ok) return false;
  if (p.E != 128 && p.E != 256) return false;
  if (p.K > 16) return false;
  if (p.G <= 1) return true;
  const bool pow2 = (p.G & (p.G - 1)) == 0;
  return pow2 && p.G <= rk::kMaxGroups && p.per * p.G == p.E && p.per >= rk::kSegment;
}

int tile_router_blocks(int E) {
  int dev = 0, smem = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  const int bytes = (E == 128 ? rk::TileLayout<128>::kBlockBytes : rk::TileLayout<256>::kBlockBytes) + 4096;
  return sm_count() * std::max(1, smem / bytes);
}

int tile_router_block_tokens() { return rk::kWarps * rk::kTileTokens; }

void launch_route_forward_tile(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  if (p.E == 128)
    launch_e<128>(sf, grid, s, p);
  else
    launch_e<256>(sf, grid, s, p);
}

}  // namespace epx::cuda
