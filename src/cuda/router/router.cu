// Launchers of the CUDA router (what the kernels share and their invariants: router_device.cuh).
//
// Chunking of route_forward's statistics. With Ct = max(8, ceil(T / kMaxChunks)) and L the tokens
// per sequence (T in global mode, seq_len in sequence mode) -- for the wide kernel kMaxChunks is
// replaced by its block count (2 per SM, fewer chunks: the bounds below only loosen) and Ct rounded
// up to a multiple of the block's 16 token streams:
//   L <= Ct: a chunk is a whole sequence (C = L, bps = 1) and writes prob_sum[s] itself;
//   L >  Ct: chunks of C = Ct tokens, bps = ceil(L / Ct) per sequence, reduced by the tree.
// In the second case S = T / L < T / Ct <= kMaxChunks and S * bps < T / Ct + S < 2 kMaxChunks =
// kRows0, bps <= kMaxChunks so a sequence has at most 16 fan-in groups, and a sequence with more
// than one group has L > 32 Ct, so S < 16 and S * groups <= 256 < kRows1: the scratch below always
// suffices (re-checked at run time). Blocks: min(chunks, kMaxChunks), looping over chunks, so the
// per-block scalar leaves also fit. Every one of these numbers depends on (T, seq_len) only, which is
// what makes the reductions' order, hence their bits, the same run to run.
#include "cuda/router/router.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/env_choice.h"
#include "cuda/common/cuda_check.h"
#include "cuda/router/router_aux_kernels.cuh"
#include "cuda/router/router_backward_kernels.cuh"
#include "cuda/router/router_fast_kernels.cuh"
#include "cuda/router/router_legacy_kernels.cuh"
#include "cuda/router/router_lean.h"
#include "cuda/router/router_split.h"
#include "cuda/router/router_wide.h"
#include "epx/error.h"

namespace epx::cuda {
namespace {

namespace rk = router_kernels;

static_assert(kRouterMaxExperts == rk::kMaxExperts && kRouterMaxTopk == rk::kMaxTopk &&
                  kRouterMaxGroups == rk::kMaxGroups,
              "router.h and router_device.cuh disagree on the limits");
static_assert(kRouterStatusBadExpertId == rk::kStatusBadId && kRouterStatusRepeatedExpertId == rk::kStatusRepeatedId &&
                  kRouterStatusStatisticsTimeout == rk::kStatusStatsTimeout,
              "status bits disagree");

using cuda::DeviceGuard;

// Scratch of one (device, stream): the stats reduction rows and tickets, and the status word.
// Tickets are returned to 0 by the kernel that completes them, so they are zeroed only here.
struct Scratch {
  unsigned long long* acc = nullptr;
  float* rows0 = nullptr;
  float* rows1 = nullptr;
  float* leaf_lse = nullptr;
  unsigned long long* leaf_cnt = nullptr;
  unsigned long long* leaves = nullptr;
  unsigned* cnt1 = nullptr;
  unsigned* cnt2 = nullptr;
  unsigned* ticket = nullptr;
  unsigned* status = nullptr;
};

// The scratch's layout; every slot of a pool has the same.
struct ScratchLayout {
  size_t rows0, rows1, lse, cnt, zero, acc, leaves, cnt1, cnt2, ticket, status, bytes;
};

ScratchLayout scratch_layout() {
  ScratchLayout l{};
  size_t off = 0;
  auto take = [&off](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  l.rows0 = take(sizeof(float) * rk::kRows0 * rk::kMaxExperts);
  l.rows1 = take(sizeof(float) * rk::kRows1 * rk::kMaxExperts);
  l.lse = take(sizeof(float) * rk::kMaxChunks);
  l.cnt = take(sizeof(unsigned long long) * rk::kMaxChunks);
  l.zero = off;
  l.acc = take(sizeof(unsigned long long) * rk::kRows0 * rk::kMaxExperts);
  l.leaves = take(sizeof(unsigned long long) * rk::kMaxChunks);
  l.cnt1 = take(sizeof(unsigned) * rk::kRows0);
  l.cnt2 = take(sizeof(unsigned) * rk::kMaxChunks);
  l.ticket = take(sizeof(unsigned));
  l.status = take(sizeof(unsigned));
  l.bytes = off;
  return l;
}

// Scratch slots are handed out to streams from per-device blocks of kSlotsPerBlock, allocated
// while no capture is running: a stream first seen during a CUDA graph capture (frameworks capture
// on a stream of their own after warming up on another) takes a free slot with no allocation, and
// only the capturable memset that zeroes its tickets.
constexpr int kSlotsPerBlock = 16;

Scratch& scratch_for(int device, cudaStream_t stream) {
  static std::mutex mu;
  // Never destroyed: the memory lives as long as the process (freeing it at exit would race the
  // driver's own teardown).
  static auto* cache = new std::map<std::pair<int, cudaStream_t>, Scratch>();
  static auto* free_slots = new std::map<int, std::vector<char*>>();
  static const ScratchLayout l = scratch_layout();
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(device, stream);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;

  std::vector<char*>& pool = (*free_slots)[device];
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (pool.empty()) {
    require_status(capturing == cudaStreamCaptureStatusNone, Status::kNotSupported, "epx::route_forward",
                   "a stream first used during a CUDA graph capture found no free router scratch on device ",
                   device, " (", cache->size(), " streams hold one); run the router once on any stream before capturing");
    char* block = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&block, l.bytes * kSlotsPerBlock));
    for (int i = kSlotsPerBlock - 1; i >= 0; --i) pool.push_back(block + i * l.bytes);
  }
  char* base = pool.back();
  pool.pop_back();
  EPX_CUDA_CHECK(cudaMemsetAsync(base + l.zero, 0, l.bytes - l.zero, stream));
  Scratch s;
  s.acc = reinterpret_cast<unsigned long long*>(base + l.acc);
  s.rows0 = reinterpret_cast<float*>(base + l.rows0);
  s.rows1 = reinterpret_cast<float*>(base + l.rows1);
  s.leaf_lse = reinterpret_cast<float*>(base + l.lse);
  s.leaf_cnt = reinterpret_cast<unsigned long long*>(base + l.cnt);
  s.leaves = reinterpret_cast<unsigned long long*>(base + l.leaves);
  s.cnt1 = reinterpret_cast<unsigned*>(base + l.cnt1);
  s.cnt2 = reinterpret_cast<unsigned*>(base + l.cnt2);
  s.ticket = reinterpret_cast<unsigned*>(base + l.ticket);
  s.status = reinterpret_cast<unsigned*>(base + l.status);
  return cache->emplace(key, s).first->second;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::atomic<int> g_router_kernel{-1};  // -1: not resolved yet, else a RouterKernel

// The fewest rows for which "auto" runs the lean kernel (about 1.3 rows per resident warp), and the split
// kernel for softmax scores (it takes sigmoid scores at any T).
constexpr int64_t kAutoLeanMinTokens = 4096;
constexpr int64_t kAutoSplitSoftmaxMinTokens = 8192;
constexpr int64_t kAutoLeanAfterTopkMinTokens = 16384;

RouterKernel resolve_router_kernel() {
  int k = g_router_kernel.load(std::memory_order_relaxed);
  if (k < 0) {
    const RouterKernel kinds[] = {RouterKernel::kAuto,  RouterKernel::kSplit,
                                  RouterKernel::kLean,  RouterKernel::kWide,
                                  RouterKernel::kFast,  RouterKernel::kFastOneTokenPerWarp,
                                  RouterKernel::kLegacy};
    const int i =
        ::epx::detail::env_choice("EPX_ROUTER_KERNEL", {"auto", "split", "lean", "wide", "fast", "fast1", "legacy"});
    int want = static_cast<int>(i < 0 ? RouterKernel::kAuto : kinds[i]);
    int expected = -1;
    g_router_kernel.compare_exchange_strong(expected, want);
    k = g_router_kernel.load(std::memory_order_relaxed);
    if (const char* dbg = std::getenv("EPX_DEBUG"); dbg != nullptr && std::strcmp(dbg, "0") != 0)
      std::fprintf(stderr, "epx: route_forward kernel: %s\n", router_kernel_name(static_cast<RouterKernel>(k)));
  }
  return static_cast<RouterKernel>(k);
}

// Where a forward kernel lets the next grid be scheduled (a RouterTrigger). By default the lean and split
// kernels trigger before their statistics tail and the others as their blocks start (H200, bench_router,
// same binary: lean 0.98-0.99x its time with the early trigger at T = 16384, E = 128-512, both score
// functions; wide 1.07x slower that way at E = 64, 1.00-1.015x at T = 4096 and 128).
// EPX_ROUTER_TRIGGER=start|stats|exit forces one for every kernel (read once).
int router_trigger(bool lean_tail) {
  static const int forced = ::epx::detail::env_choice("EPX_ROUTER_TRIGGER", {"start", "stats", "exit"});
  if (forced >= 0) return forced;
  return lean_tail ? rk::kTriggerBeforeStats : rk::kTriggerAtStart;
}

// Experts per lane: the smallest power of two with 32 * V >= E.
int lanes_v(int E) {
  int v = 1;
  while (32 * v < E) v *= 2;
  return v;
}

void check_limits(const char* fn, const RouterConfig& c) {
  require_status(c.num_experts <= kRouterMaxExperts, Status::kNotSupported, fn, "config.num_experts is ",
                 c.num_experts, ", the CUDA router supports at most ", kRouterMaxExperts, " experts");
  require_status(c.topk <= kRouterMaxTopk, Status::kNotSupported, fn, "config.topk is ", c.topk,
                 ", the CUDA router supports at most ", kRouterMaxTopk);
  require_status(c.num_groups <= kRouterMaxGroups, Status::kNotSupported, fn, "config.num_groups is ", c.num_groups,
                 ", the CUDA router supports at most ", kRouterMaxGroups, " groups");
}

void check_logits(const char* fn, DType dt) {
  require_status(dt == DType::kF32 || dt == DType::kBF16, Status::kNotSupported, fn, "logits are ", dtype_name(dt),
                 ", the CUDA router takes fp32 or bf16 logits (fp64 is the CPU reference's finite-difference mode)");
}

int score_kind(ScoreFunction f) {
  switch (f) {
    case ScoreFunction::kSoftmax: return rk::kScoreSoftmax;
    case ScoreFunction::kSoftmaxAfterTopk: return rk::kScoreSoftmaxAfterTopk;
    case ScoreFunction::kSigmoid: return rk::kScoreSigmoid;
  }
  return rk::kScoreSoftmax;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// What the choice of a route_forward kernel depends on: the logits and the expert / group shape.
rk::FwdParams shape_params(const RouterConfig& c, const TensorRef& logits) {
  rk::FwdParams p{};
  p.logits = logits.data();
  p.E = c.num_experts;
  p.K = c.topk;
  p.G = c.num_groups;
  p.group_topk = c.num_groups > 1 ? c.group_topk : 0;
  p.per = c.num_experts / c.num_groups;
  const int elem = static_cast<int>(dtype_size(logits.dtype()));
  p.vec_ok = aligned16(logits.data()) && (static_cast<int64_t>(p.E) * elem) % 16 == 0;
  return p;
}

template <int V, class LT, int TPW>
void launch_fast(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  void (*kernel)(rk::FwdParams) = rk::route_forward_fast_kernel<V, LT, rk::kScoreSigmoid, TPW>;
  if (sf == rk::kScoreSoftmax) kernel = rk::route_forward_fast_kernel<V, LT, rk::kScoreSoftmax, TPW>;
  if (sf == rk::kScoreSoftmaxAfterTopk) kernel = rk::route_forward_fast_kernel<V, LT, rk::kScoreSoftmaxAfterTopk, TPW>;
  rk::launch_router_kernel("launch of route_forward_fast_kernel", kernel, grid, 0, s, p);
}

template <int V, class LT>
void launch_legacy(int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  void (*kernel)(rk::FwdParams) = rk::route_forward_kernel<V, LT, rk::kScoreSigmoid>;
  if (sf == rk::kScoreSoftmax) kernel = rk::route_forward_kernel<V, LT, rk::kScoreSoftmax>;
  if (sf == rk::kScoreSoftmaxAfterTopk) kernel = rk::route_forward_kernel<V, LT, rk::kScoreSoftmaxAfterTopk>;
  rk::launch_router_kernel("launch of route_forward_kernel", kernel, grid, 0, s, p);
}

// Two tokens per warp (a half-warp each) where the shape allows it: at most 256 experts (16 per
// lane), K + 1 picks within 16 lanes, and groups, if any, on whole lanes of a power-of-two count.
bool two_tokens_per_warp(int V, const rk::FwdParams& p) {
  if (V > 8 || p.K > 15) return false;
  if (p.G <= 1) return true;
  const int v2 = 2 * V;
  if (p.per % v2 != 0) return false;
  const int lpg = p.per / v2;
  return (lpg & (lpg - 1)) == 0;
}

template <class LT>
void launch_forward_v(int V, int sf, int grid, cudaStream_t s, const rk::FwdParams& p) {
  const RouterKernel k = resolve_router_kernel();
  if (k == RouterKernel::kLegacy) {
    switch (V) {
      case 1: launch_legacy<1, LT>(sf, grid, s, p); break;
      case 2: launch_legacy<2, LT>(sf, grid, s, p); break;
      case 4: launch_legacy<4, LT>(sf, grid, s, p); break;
      case 8: launch_legacy<8, LT>(sf, grid, s, p); break;
      default: launch_legacy<16, LT>(sf, grid, s, p); break;
    }
    return;
  }
  if (k == RouterKernel::kFast && two_tokens_per_warp(V, p)) {  // kWide falls back to one token per warp
    switch (V) {
      case 1: launch_fast<2, LT, 2>(sf, grid, s, p); break;
      case 2: launch_fast<4, LT, 2>(sf, grid, s, p); break;
      case 4: launch_fast<8, LT, 2>(sf, grid, s, p); break;
      default: launch_fast<16, LT, 2>(sf, grid, s, p); break;
    }
    return;
  }
  switch (V) {
    case 1: launch_fast<1, LT, 1>(sf, grid, s, p); break;
    case 2: launch_fast<2, LT, 1>(sf, grid, s, p); break;
    case 4: launch_fast<4, LT, 1>(sf, grid, s, p); break;
    case 8: launch_fast<8, LT, 1>(sf, grid, s, p); break;
    default: launch_fast<16, LT, 1>(sf, grid, s, p); break;
  }
}

template <class LT>
void launch_backward_v(int V, int grid, cudaStream_t s, const rk::BwdParams& p) {
  void (*kernel)(rk::BwdParams) = rk::route_backward_kernel<16, LT>;
  if (V == 1) kernel = rk::route_backward_kernel<1, LT>;
  if (V == 2) kernel = rk::route_backward_kernel<2, LT>;
  if (V == 4) kernel = rk::route_backward_kernel<4, LT>;
  if (V == 8) kernel = rk::route_backward_kernel<8, LT>;
  rk::launch_router_kernel("launch of route_backward_kernel", kernel, grid, 0, s, p);
}

}  // namespace

const char* router_kernel_name(RouterKernel k) {
  switch (k) {
    case RouterKernel::kLegacy: return "legacy";
    case RouterKernel::kFastOneTokenPerWarp: return "fast1";
    case RouterKernel::kWide: return "wide";
    case RouterKernel::kLean: return "lean";
    case RouterKernel::kSplit: return "split";
    case RouterKernel::kAuto: return "auto";
    default: return "fast";
  }
}

void set_router_kernel(RouterKernel k) { g_router_kernel.store(static_cast<int>(k), std::memory_order_relaxed); }

RouterKernel router_kernel_in_use() { return resolve_router_kernel(); }

bool lean_router_serves(const RouterConfig& c, const TensorRef& logits) {
  return lean_router_supports(shape_params(c, logits), logits.dtype() == DType::kBF16);
}

bool split_router_serves(const RouterConfig& c, const TensorRef& logits) {
  rk::FwdParams p = shape_params(c, logits);
  static const float kSomeBias = 0.0f;  // only whether there is a bias is read
  p.bias = c.use_expert_bias ? &kSomeBias : nullptr;
  return split_router_supports(p, logits.dtype() == DType::kBF16, score_kind(c.score_function));
}

void route_forward(const RouterConfig& c, const TensorRef& logits, const TensorRef& expert_bias,
                   const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats,
                   Stream stream) {
  const char* fn = "epx::route_forward";
  check_limits(fn, c);
  check_logits(fn, logits.dtype());
  const int device = logits.device().index;
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  const int64_t T = logits.size(0);
  const int E = c.num_experts;
  float* prob = stats.prob_sum.defined() ? stats.prob_sum.ptr<float>() : nullptr;
  float* scal = stats.scalars.defined() ? stats.scalars.ptr<float>() : nullptr;
  if (T == 0) {  // the stats are written as zeros (an empty prob_sum in sequence mode)
    if (prob != nullptr && stats.prob_sum.nbytes() > 0)
      EPX_CUDA_CHECK(cudaMemsetAsync(prob, 0, stats.prob_sum.nbytes(), s));
    if (scal != nullptr) EPX_CUDA_CHECK(cudaMemsetAsync(scal, 0, stats.scalars.nbytes(), s));
    return;
  }
  const Scratch& sc = scratch_for(device, s);

  rk::FwdParams p = shape_params(c, logits);
  p.bias = expert_bias.defined() ? expert_bias.ptr<float>() : nullptr;
  p.topk_idx = topk_idx.data();
  p.topk_w = topk_weights.ptr<float>();
  p.prob_sum = prob;
  p.scalars = scal;
  p.T = T;
  p.idx64 = topk_idx.dtype() == DType::kI64;
  p.normalize = c.normalize_weights;
  p.scale = c.routed_scaling_factor;
  // The split, lean and wide kernels run one chunk per block (2 / 3 / 2 blocks per SM at E = 256); the
  // others up to kMaxChunks blocks. Split falls back to lean, lean to wide, then to the fast kernels, where
  // a shape is not served.
  const bool bf16 = logits.dtype() == DType::kBF16;
  const RouterKernel want = resolve_router_kernel();
  // auto (H200, bench_router, fp32 logits, same runs): split where it serves sigmoid scores (DeepSeek-V3,
  // T = 16384 / 4096 / 128: 0.71x lean's time / 0.79x wide's / 0.97x wide's; E = 512 0.66x lean's) and
  // softmax scores over at least kAutoSplitSoftmaxMinTokens rows (T = 16384: E = 256 0.94x lean's, E = 128
  // 0.85x, E = 512 0.92x; at T = 4096 lean was ahead, 8.6 against 9.0 us, before the split kernel's tile
  // arrived in quarters); else lean for softmax / sigmoid scores over at least kAutoLeanMinTokens rows
  // (0.88x wide's at T = 4096 softmax, 0.86x at T = 16384) and for softmax after top-k over at least
  // kAutoLeanAfterTopkMinTokens (0.94x wide's at T = 16384, the only size timed); else wide.
  const int64_t lean_min_rows =
      c.score_function == ScoreFunction::kSoftmaxAfterTopk ? kAutoLeanAfterTopkMinTokens : kAutoLeanMinTokens;
  const bool auto_lean = want == RouterKernel::kAuto && T >= lean_min_rows;
  const int sf = score_kind(c.score_function);
  const bool auto_split = want == RouterKernel::kAuto && (sf == rk::kScoreSigmoid || T >= kAutoSplitSoftmaxMinTokens);
  const bool split = (want == RouterKernel::kSplit || auto_split) && split_router_supports(p, bf16, sf);
  const bool lean = !split && (want == RouterKernel::kLean || want == RouterKernel::kSplit || auto_lean) &&
                    lean_router_supports(p, bf16);
  const bool wide = !split && !lean &&
                    (want == RouterKernel::kWide || want == RouterKernel::kLean || want == RouterKernel::kSplit ||
                     want == RouterKernel::kAuto) &&
                    wide_router_supports(p, bf16);
  p.trigger = router_trigger(lean || split);
  const int64_t max_chunks = split  ? std::min<int64_t>(rk::kMaxChunks, split_router_blocks())
                             : lean ? std::min<int64_t>(rk::kMaxChunks, lean_router_blocks(E))
                             : wide ? std::min<int64_t>(rk::kMaxChunks, wide_router_blocks())
                                    : rk::kMaxChunks;

  const int64_t L = c.aux_loss == AuxLossType::kSequence ? c.seq_len : T;
  const int64_t S = T / L;
  int64_t ct = std::max<int64_t>(8, ceil_div(T, max_chunks));
  if (wide) ct = ceil_div(ct, 2 * rk::kWarps) * (2 * rk::kWarps);  // whole rounds of the block's token pairs
  // lean: no rounding to whole rounds of the block's warps. That left SMs holding 2 and 3 blocks of 48
  // tokens at T = 16384 (342 blocks in 396 slots; Nsight Compute: the busiest SM active 1.46x the
  // average), where chunks of 42 fill 391 slots evenly.
  if (L <= ct) {
    p.C = L;
    p.bps = 1;
  } else {
    p.C = ct;
    p.bps = ceil_div(L, ct);
    const int64_t groups = ceil_div(p.bps, rk::kFanIn);
    require_status(S * p.bps <= rk::kRows0 && (groups == 1 || S * groups <= rk::kRows1) && groups <= rk::kFanIn,
                   Status::kInternal, fn, "stats chunking out of its scratch (T = ", T, ", seq_len = ", L, ")");
  }
  p.L = L;
  p.nchunks = S * p.bps;
  p.rows0 = sc.rows0;
  p.rows1 = sc.rows1;
  p.cnt1 = sc.cnt1;
  p.cnt2 = sc.cnt2;
  p.leaf_lse = sc.leaf_lse;
  p.leaf_cnt = sc.leaf_cnt;
  p.scal_ticket = sc.ticket;
  p.acc = sc.acc;
  // Replicas of each sequence's accumulators, and the sequences' own rows after them, all within kRows0 rows
  // (S * bps <= kRows0 and bps >= 2 where they are used, so rep >= 1).
  p.rep = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({rk::kAccReplicas, p.bps, rk::kRows0 / S - 1})));
  p.leaves = sc.leaves;
  p.status = sc.status;
  // prob_sum's fixed point: a sequence's sum for one expert is at most L (plus a unit per chunk), which must
  // stay below 2^53, under the arrival count in the accumulator's top bits: 2^32 units per 1 while L < 2^21.
  int fixed_shift = 0;
  while ((L >> fixed_shift) >= (int64_t{1} << 21)) ++fixed_shift;
  p.fixed_scale = std::ldexp(1.0f, 32 - fixed_shift);
  p.fixed_inv = std::ldexp(1.0f, fixed_shift - 32);

  const int V = lanes_v(E);
  // Grouped selection relies on a lane touching at most two groups (E / G > V, or V = 1).
  require_status(c.num_groups == 1 || V == 1 || p.per > V, Status::kInternal, fn, "group width ", p.per,
                 " not above the ", V, " experts per lane");
  const int grid = static_cast<int>(std::min<int64_t>(p.nchunks, max_chunks));
  if (split)
    launch_route_forward_split(sf, grid, s, p);
  else if (lean)
    launch_route_forward_lean(sf, grid, s, p);
  else if (wide)
    launch_route_forward_wide(sf, grid, s, p);
  else if (logits.dtype() == DType::kF32)
    launch_forward_v<float>(V, sf, grid, s, p);
  else
    launch_forward_v<__nv_bfloat16>(V, sf, grid, s, p);
}

void count_routed(const RouterConfig& c, const TensorRef& routed, const RouterStats& stats, Stream stream) {
  const char* fn = "epx::count_routed";
  check_limits(fn, c);
  const int device = routed.device().index;
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  const TensorRef& counts = stats.counts;
  if (counts.nbytes() > 0) EPX_CUDA_CHECK(cudaMemsetAsync(counts.data(), 0, counts.nbytes(), s));
  const int64_t T = routed.size(0);
  if (T == 0) return;
  const Scratch& sc = scratch_for(device, s);
  const bool seq = c.aux_loss == AuxLossType::kSequence;
  const int64_t L = seq ? c.seq_len : T;
  const int grid = static_cast<int>(std::min<int64_t>(ceil_div(T, 256), 4LL * sm_count()));
  const int idx64 = routed.dtype() == DType::kI64;
  if (counts.dtype() == DType::kF64)
    rk::count_routed_kernel<double><<<grid, 256, 0, s>>>(routed.data(), idx64, T, c.topk, c.num_experts, L, !seq,
                                                         counts.ptr<double>(), sc.status);
  else
    rk::count_routed_kernel<float><<<grid, 256, 0, s>>>(routed.data(), idx64, T, c.topk, c.num_experts, L, !seq,
                                                        counts.ptr<float>(), sc.status);
  EPX_CHECK_LAUNCH("count_routed_kernel");
}

void router_losses(const RouterConfig& c, const RouterStats& stats, const TensorRef& losses, Stream stream) {
  const int device = losses.device().index;
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  const int mode = c.aux_loss == AuxLossType::kGlobalBatch ? 1 : c.aux_loss == AuxLossType::kSequence ? 2 : 0;
  const int64_t S = mode == 2 ? stats.prob_sum.size(0) : 1;
  DType fdt = DType::kF32;
  for (const TensorRef* t : {&stats.scalars, &stats.prob_sum, &stats.counts})
    if (t->defined()) {
      fdt = t->dtype();
      break;
    }
  auto run = [&](auto acc_tag, auto out_tag) {
    using Acc = decltype(acc_tag);
    using Out = decltype(out_tag);
    const Acc* prob = mode != 0 ? stats.prob_sum.ptr<Acc>() : nullptr;
    const Acc* cnt = mode != 0 ? stats.counts.ptr<Acc>() : nullptr;
    const Acc* scal = stats.scalars.defined() ? stats.scalars.ptr<Acc>() : nullptr;
    rk::router_losses_kernel<Acc, Out><<<1, 256, 0, s>>>(
        prob, cnt, scal, losses.ptr<Out>(), c.num_experts, c.topk, S, mode, static_cast<Acc>(c.aux_loss_coeff),
        static_cast<Acc>(c.z_loss_coeff), static_cast<Acc>(c.seq_len));
    EPX_CHECK_LAUNCH("router_losses_kernel");
  };
  const bool out64 = losses.dtype() == DType::kF64;
  if (fdt == DType::kF64) {
    if (out64)
      run(double(), double());
    else
      run(double(), float());
  } else {
    if (out64)
      run(float(), double());
    else
      run(float(), float());
  }
}

void route_backward(const RouterConfig& c, const TensorRef& logits, const TensorRef& topk_idx,
                    const TensorRef& d_topk_weights, const RouterStats& stats, double d_aux, double d_z,
                    const TensorRef& d_logits, Stream stream) {
  const char* fn = "epx::route_backward";
  check_limits(fn, c);
  check_logits(fn, logits.dtype());
  const int device = logits.device().index;
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  const int64_t T = logits.size(0);
  if (T == 0) return;
  const Scratch& sc = scratch_for(device, s);
  const int E = c.num_experts, K = c.topk;

  rk::BwdParams p{};
  p.logits = logits.data();
  p.topk_idx = topk_idx.data();
  p.d_w = d_topk_weights.defined() ? d_topk_weights.ptr<float>() : nullptr;
  p.scalars = stats.scalars.defined() ? stats.scalars.ptr<float>() : nullptr;
  p.d_logits = d_logits.data();
  p.status = sc.status;
  p.T = T;
  p.L = c.aux_loss == AuxLossType::kSequence ? c.seq_len : T;
  p.E = E;
  p.K = K;
  p.sf = score_kind(c.score_function);
  p.idx64 = topk_idx.dtype() == DType::kI64;
  p.normalize = c.normalize_weights;
  p.scale = c.routed_scaling_factor;
  const int elem = static_cast<int>(dtype_size(logits.dtype()));
  p.vec_ok = aligned16(logits.data()) && aligned16(d_logits.data()) && (static_cast<int64_t>(E) * elem) % 16 == 0;
  // The reference's constant factors, in the same float operations.
  if (c.aux_loss != AuxLossType::kNone && c.aux_loss_coeff > 0 && d_aux != 0) {
    const float base =
        static_cast<float>(d_aux) * c.aux_loss_coeff * static_cast<float>(E) / static_cast<float>(K);
    p.counts = stats.counts.ptr<float>();
    p.aux_base = base;
    if (c.aux_loss == AuxLossType::kGlobalBatch) {
      p.aux_mode = 1;
    } else {
      const float L = static_cast<float>(c.seq_len);
      p.aux_mode = 2;
      p.aux_seq = base / (L * L) / static_cast<float>(T / c.seq_len);
    }
  }
  p.z_base = c.z_loss_coeff > 0 && d_z != 0 ? static_cast<float>(d_z) * c.z_loss_coeff : 0.0f;

  const int grid = static_cast<int>(std::min<int64_t>(ceil_div(T, rk::kWarps), 8LL * sm_count()));
  const int V = lanes_v(E);
  if (logits.dtype() == DType::kF32)
    launch_backward_v<float>(V, grid, s, p);
  else
    launch_backward_v<__nv_bfloat16>(V, grid, s, p);
}

void update_expert_bias(const TensorRef& expert_bias, const TensorRef& counts, float rate, Stream stream) {
  DeviceGuard guard(expert_bias.device().index);
  const cudaStream_t s = to_cuda(stream);
  const int64_t E = expert_bias.size(0);
  if (counts.dtype() == DType::kF64)
    rk::update_expert_bias_kernel<double><<<1, 1024, 0, s>>>(expert_bias.ptr<float>(), counts.ptr<double>(), E, rate);
  else
    rk::update_expert_bias_kernel<float><<<1, 1024, 0, s>>>(expert_bias.ptr<float>(), counts.ptr<float>(), E, rate);
  EPX_CHECK_LAUNCH("update_expert_bias_kernel");
}

uint32_t router_status(int device, Stream stream, bool clear) {
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  const Scratch& sc = scratch_for(device, s);
  EPX_CUDA_CHECK(cudaStreamSynchronize(s));
  uint32_t v = 0;
  EPX_CUDA_CHECK(cudaMemcpy(&v, sc.status, sizeof(v), cudaMemcpyDeviceToHost));
  if (clear) EPX_CUDA_CHECK(cudaMemsetAsync(sc.status, 0, sizeof(unsigned), s));
  return v;
}

}  // namespace epx::cuda
