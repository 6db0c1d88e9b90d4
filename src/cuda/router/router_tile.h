// Launcher of the tile route_forward kernel (router_tile_kernels.cuh), in its own translation unit
// so that its instantiations compile in parallel with the other router kernels.
#pragma once

#include <cuda_runtime.h>

#include "cuda/router/router_kernels.cuh"

namespace epx::cuda {

/// Whether the tile kernel handles this shape: fp32 logits, E in {128, 256}, K <= 16, rows 16-byte
/// aligned (p.vec_ok), and no groups or a power-of-two G whose groups hold at least 8 experts.
bool tile_router_supports(const router_kernels::FwdParams& p, bool bf16);

/// Blocks of the tile kernel resident on this device at once (its chunks of tokens: one per block).
int tile_router_blocks(int E);

/// Tokens a block takes per round (a chunk is rounded up to a multiple of it).
int tile_router_block_tokens();

/// Queues the tile kernel (sf: router_kernels::ScoreKind) on `stream`; the shape must be supported.
void launch_route_forward_tile(int sf, int grid, cudaStream_t stream, const router_kernels::FwdParams& p);

}  // namespace epx::cuda
