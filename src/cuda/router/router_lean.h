// Launcher of the lean route_forward kernel (router_lean_kernels.cuh), in its own translation unit
// so that its instantiations compile in parallel with the other router kernels'.
#pragma once

#include <cuda_runtime.h>

#include "cuda/router/router_device.cuh"

namespace epx::cuda {

/// Whether the lean kernel handles this shape: fp32 logits, E in {128, 256, 512}, K <= 16, rows
/// 16-byte aligned (p.vec_ok), and no groups or groups of E / G experts, a multiple of E / 32 with a
/// power-of-two number of 32nds of E.
bool lean_router_supports(const router_kernels::FwdParams& p, bool bf16);

/// Blocks the lean kernel wants on this device (its chunks of tokens: one per block).
int lean_router_blocks(int E);

/// Queues the lean kernel (sf: router_kernels::ScoreKind) on `stream`; the shape must be supported.
void launch_route_forward_lean(int sf, int grid, cudaStream_t stream, const router_kernels::FwdParams& p);

}  // namespace epx::cuda
