// Launcher of the split route_forward kernel (router_split_kernels.cuh), in its own translation unit
// so that its instantiations compile in parallel with the other router kernels'.
#pragma once

#include <cuda_runtime.h>

#include "cuda/router/router_device.cuh"

namespace epx::cuda {

/// Whether the split kernel handles this shape: fp32 logits, E in {128, 256, 512}, K <= 8, rows 16-byte
/// aligned (p.vec_ok); softmax scores without a bias or groups, or sigmoid scores with groups of 32 or
/// 64 experts or none (sf: router_kernels::ScoreKind).
bool split_router_supports(const router_kernels::FwdParams& p, bool bf16, int sf);

/// Blocks the split kernel wants on this device (its chunks of tokens: one per block).
int split_router_blocks();

/// Queues the split kernel on `stream`; the shape must be supported.
void launch_route_forward_split(int sf, int grid, cudaStream_t stream, const router_kernels::FwdParams& p);

}  // namespace epx::cuda
