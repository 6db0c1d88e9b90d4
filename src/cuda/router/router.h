// CUDA router: the device twin of every op in epx/router.h (semantics there and in
// src/ref/router.cpp). Host-only declarations: no CUDA types, so src/moe/router_ops.cpp includes it
// under EPX_HAVE_CUDA.
//
// The public entry points validate shapes, dtypes, devices and the config once; these launchers
// only check what the kernels add (the limits below, fp64 logits) and queue work on `stream`:
// no host synchronisation, no allocation after the first call per (device, stream), which
// allocates the small scratch the deterministic reductions use (~7 MB, kept for the process).
// Call once outside CUDA-graph capture per (device, stream) before capturing.
//
// Device-detected problems. Expert ids only the device sees (count_routed's routed_experts,
// route_backward's topk_idx) that lie outside [-1, E) or repeat within a row are treated as masked
// (-1) -- the reference throws instead -- and set a bit in a status word kept per (device,
// stream); router_status() reads it (synchronising the stream: not for hot paths).
#pragma once

#include <cstdint>

#include "epx/router.h"
#include "epx/tensor.h"

namespace epx::cuda {

/// Limits of the CUDA kernels (the public ops raise kNotSupported naming them).
constexpr int kRouterMaxExperts = 512;
constexpr int kRouterMaxTopk = 16;
constexpr int kRouterMaxGroups = 16;

/// Status bits (see router_status).
constexpr uint32_t kRouterStatusBadExpertId = 1u;       // an id outside [-1, E)
constexpr uint32_t kRouterStatusRepeatedExpertId = 2u;  // an expert named twice in one row
// route_forward's last block waited too long for another block's statistics (never expected: each block
// publishes them before it takes its ticket); scalars then lack that block's share.
constexpr uint32_t kRouterStatusStatisticsTimeout = 4u;

/// Which kernel route_forward runs (EPX_ROUTER_KERNEL, read once): "auto" (default: "split" where it
/// serves the shape for sigmoid scores, and for softmax scores over at least 8192 rows;
/// else "lean" where it serves the shape over at least 4096 rows (16384 for softmax after top-k); else
/// "wide"; chosen on the H200 timings in bench/NOTES.md), "wide" (two tokens per warp with fast exponentials,
/// where the shape allows -- fp32 logits, E in {64, 128, 256}, aligned rows, groups of 32/64/128
/// experts -- else "fast1"), "lean" (one token per warp with fast exponentials and no max
/// subtraction, fp32 logits, E in {128, 256, 512}, groups a power-of-two number of 32nds of E; rows
/// it cannot vouch for go through fast1's code; else as "wide"), "fast1" (the fast kernel, one token
/// per warp), "split" (a token split over E / 64 lanes, top-k by sorting networks in each lane's
/// registers: fp32 logits, E in {128, 256, 512}, K <= 8, softmax without a bias or groups, sigmoid with
/// groups of 32 or 64 experts or none; rows it cannot vouch for go through fast1's code; else as
/// "lean"), "fast" (two tokens per warp where the shape allows, else one) or "legacy" (the earlier
/// kernel), kept so that a GPU run and the tests can compare them. fast, fast1 and legacy give the
/// same topk_idx and topk_weights bits; wide, lean and split agree with them (and the reference) on the
/// selection of well-separated scores and on weights within a few 1e-6 relative
/// (router_wide_kernels.cuh, router_lean_kernels.cuh, router_split_kernels.cuh). prob_sum and
/// scalars[0] differ between kernels in rounding; each is deterministic run to run.
enum class RouterKernel : int {
  kFast = 0,
  kFastOneTokenPerWarp = 1,
  kLegacy = 2,
  kWide = 3,
  kLean = 4,
  kAuto = 5,
  kSplit = 6
};
void set_router_kernel(RouterKernel k);
RouterKernel router_kernel_in_use();
/// Whether "lean" serves these logits and this config (else route_forward runs wide or fast1 in its
/// place): fp32, E in {128, 256, 512}, K <= 16, 16-byte aligned rows, groups a power-of-two number of
/// 32nds of E. Only the logits' dtype, shape and address are read.
bool lean_router_serves(const RouterConfig& config, const TensorRef& logits);
/// Whether "split" serves these logits and this config (else route_forward runs lean in its place).
bool split_router_serves(const RouterConfig& config, const TensorRef& logits);
const char* router_kernel_name(RouterKernel k);

/// logits fp32 or bf16 [T, E]; everything else as in epx::route_forward.
void route_forward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                   const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats,
                   Stream stream);

/// stats.counts fp32 or fp64 (exact while every count stays below 2^24 in fp32).
void count_routed(const RouterConfig& config, const TensorRef& routed_experts, const RouterStats& stats,
                  Stream stream);

/// losses fp32 or fp64, written on the device from the device stats.
void router_losses(const RouterConfig& config, const RouterStats& stats, const TensorRef& losses, Stream stream);

/// logits / d_logits fp32 or bf16.
void route_backward(const RouterConfig& config, const TensorRef& logits, const TensorRef& topk_idx,
                    const TensorRef& d_topk_weights, const RouterStats& stats, double d_aux, double d_z,
                    const TensorRef& d_logits, Stream stream);

void update_expert_bias(const TensorRef& expert_bias, const TensorRef& counts, float rate, Stream stream);

/// The status bits recorded by the router ops queued on (device, stream) so far; synchronises the
/// stream. `clear` resets the word (stream-ordered) after reading it.
uint32_t router_status(int device, Stream stream, bool clear = true);

}  // namespace epx::cuda
