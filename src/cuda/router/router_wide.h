// Launcher of the wide route_forward kernel (router_wide_kernels.cuh), in its own translation unit
// so that its instantiations compile in parallel with router.cu's.
#pragma once

#include <cuda_runtime.h>

#include "cuda/router/router_device.cuh"

namespace epx::cuda {

/// Whether the wide kernel handles this shape: fp32 logits, E in {64, 128, 256}, K <= 16, rows
/// 16-byte aligned (p.vec_ok), and no groups or groups of 32, 64 or 128 experts (at most 8).
bool wide_router_supports(const router_kernels::FwdParams& p, bool bf16);

/// Blocks the wide kernel wants on this device (its chunks of tokens: one per block).
int wide_router_blocks();

/// Queues the wide kernel (sf: router_kernels::ScoreKind, fp32 logits) on `stream`; the shape must be
/// supported.
void launch_route_forward_wide(int sf, int grid, cudaStream_t stream, const router_kernels::FwdParams& p);

}  // namespace epx::cuda
