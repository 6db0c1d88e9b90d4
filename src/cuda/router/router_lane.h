// Launcher of the lane route_forward kernel (router_lane_kernels.cuh), in its own translation unit
// so that its instantiations compile in parallel with the other router kernels'.
#pragma once

#include <cuda_runtime.h>

#include "cuda/router/router_kernels.cuh"

namespace epx::cuda {

namespace router_kernels {
constexpr int kLaneTiles = 4;                       // tiles of 32 tokens a block holds (a warp pair each)
constexpr int kLaneRoundTokens = 32 * kLaneTiles;  // tokens a block routes per round
constexpr int kLaneSlots = 9;                       // sorted keys a lane keeps: K + 1 for every K <= 8
}  // namespace router_kernels

/// Whether the lane kernel handles this shape: fp32 logits, E in {128, 256}, K <= 8, softmax or
/// sigmoid scores (sf: router_kernels::ScoreKind), no groups, rows 16-byte aligned (p.vec_ok).
bool lane_router_supports(const router_kernels::FwdParams& p, int sf, bool bf16);

/// Blocks the lane kernel wants on this device (one per SM; a chunk of tokens each).
int lane_router_blocks();

/// Queues the lane kernel on `stream`; the shape must be supported and the chunks whole rounds of
/// router_kernels::kLaneRoundTokens tokens (but the last of a sequence).
void launch_route_forward_lane(int sf, int grid, cudaStream_t stream, const router_kernels::FwdParams& p);

}  // namespace epx::cuda
