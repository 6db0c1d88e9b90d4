#include "cuda/router/router_wide.h"

#include "cuda/router/router_wide_kernels.cuh"

namespace epx::cuda {
namespace {

namespace rk = router_kernels;

template <int NV>
void launch_nv(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  void (*kernel)(rk::FwdParams) = rk::route_forward_wide_kernel<NV, float, rk::kScoreSigmoid>;
  if (sf == rk::kScoreSoftmax) kernel = rk::route_forward_wide_kernel<NV, float, rk::kScoreSoftmax>;
  if (sf == rk::kScoreSoftmaxAfterTopk) kernel = rk::route_forward_wide_kernel<NV, float, rk::kScoreSoftmaxAfterTopk>;
  rk::launch_router_kernel("launch of route_forward_wide_kernel", kernel, grid, 0, s, p);
}

}  // namespace

bool wide_router_supports(const rk::FwdParams& p, bool bf16) {
  // bf16 logits (8-bit mantissas) tie often; ties of the truncated composite keys send the wide
  // kernel through its exact path, so on bf16 rows it only matches fast1 (H200, T = 16384, E = 256:
  // 29.2 against 30.2 us softmax, 33.1 against 33.6 us DeepSeek-V3; fp32: 19.7 / 29.9 against
  // 24.8 / 34.5 us). It runs on fp32 logits until equal full keys are told apart from collisions.
  if (bf16) return false;
  if (p.E != 64 && p.E != 128 && p.E != 256) return false;
  if (p.K > 16 || !p.vec_ok) return false;
  if (p.G <= 1) return true;
  return p.G <= 8 && p.per * p.G == p.E && (p.per == 32 || p.per == 64 || p.per == 128);
}

int wide_router_blocks() { return sm_count() * rk::kWideMinBlocks; }

void launch_route_forward_wide(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  switch (p.E) {
    case 64: launch_nv<4>(sf, grid, s, p); break;
    case 128: launch_nv<8>(sf, grid, s, p); break;
    default: launch_nv<16>(sf, grid, s, p); break;
  }
}

}  // namespace epx::cuda
