#include "cuda/router/router_lean.h"

#include "cuda/common/cuda_check.h"
#include "cuda/router/router_lean_kernels.cuh"

namespace epx::cuda {
namespace {

namespace rk = router_kernels;

template <int V, int SF, int D, bool kBias, bool kGroups>
void launch_one(int grid, cudaStream_t s, const rk::FwdParams& p) {
  const auto kernel = rk::route_forward_lean_kernel<V, SF, D, kBias, kGroups>;
  constexpr int smem = rk::lean_smem_bytes<V>();
  // At E = 512 the ring of staged rows (32 KB) and the static arrays (~20 KB) pass the default 48 KB:
  // opt in on the current device at every launch, as the layout kernel does (a function attribute,
  // per device, not a stream operation: fine under graph capture). E <= 256 stays under it.
  if constexpr (V >= 16)
    EPX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  rk::launch_router_kernel("launch of route_forward_lean_kernel", kernel, grid, smem, s, p);
}

template <int V, int SF, int D>
void launch_features(int grid, cudaStream_t s, const rk::FwdParams& p) {
  const bool bias = p.bias != nullptr, groups = p.G > 1;
  if (bias && groups)
    launch_one<V, SF, D, true, true>(grid, s, p);
  else if (bias)
    launch_one<V, SF, D, true, false>(grid, s, p);
  else if (groups)
    launch_one<V, SF, D, false, true>(grid, s, p);
  else
    launch_one<V, SF, D, false, false>(grid, s, p);
}

// Cache depth D: 3 keys per lane for K <= 8, 4 above, so that a lane holding more than D of the
// K + 1 picks -- the fallback's trigger -- stays rare (~0.15% / ~0.1% of random rows at E = 256).
template <int V, int SF>
void launch_d(int grid, cudaStream_t s, const rk::FwdParams& p) {
  if (p.K <= 8)
    launch_features<V, SF, 3>(grid, s, p);
  else
    launch_features<V, SF, 4>(grid, s, p);
}

template <int V>
void launch_v(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  switch (sf) {
    case rk::kScoreSoftmax: launch_d<V, rk::kScoreSoftmax>(grid, s, p); break;
    case rk::kScoreSoftmaxAfterTopk: launch_d<V, rk::kScoreSoftmaxAfterTopk>(grid, s, p); break;
    default: launch_d<V, rk::kScoreSigmoid>(grid, s, p); break;
  }
}

}  // namespace

bool lean_router_supports(const rk::FwdParams& p, bool bf16) {
  if (bf16) return false;
  if (p.E != 128 && p.E != 256 && p.E != 512) return false;
  if (p.K > 16 || !p.vec_ok) return false;
  if (p.G <= 1) return true;
  const int V = p.E / 32;
  if (p.per * p.G != p.E || p.per % V != 0) return false;
  const int lpg = p.per / V;
  return (lpg & (lpg - 1)) == 0;
}

int lean_router_blocks(int E) {
  return sm_count() * (E >= 512 ? rk::LeanBounds<16>::kMinBlocks : rk::LeanBounds<8>::kMinBlocks);
}

void launch_route_forward_lean(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  switch (p.E) {
    case 128: launch_v<4>(sf, grid, s, p); break;
    case 256: launch_v<8>(sf, grid, s, p); break;
    default: launch_v<16>(sf, grid, s, p); break;
  }
}

}  // namespace epx::cuda
