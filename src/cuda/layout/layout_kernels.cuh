// Kernels of the device-side prepare; no floating point, integer atomics only where their order
// does not matter, so the layout is deterministic. Block b owns tokens [b*chunk, (b+1)*chunk), at
// most kMaxLayoutBlocks blocks.
//
// The default path is ONE launch, layout_kernel (nothing to clear beforehand, so it is one node of
// a CUDA graph). It is a latency chain (a few KB per block, 64 blocks on 132 SMs), so it is built
// to have few dependent global round trips and barriers on its critical path, which ends in the
// last block: 512 threads, one pair per thread and round (T = 4096, top-8: one round per block).
//  A. validate the chunk's ids (a bad slot is masked; the block keeps its first bad pair), write
//     the validated id to routed_experts, and rank every pair among the chunk's pairs to the same
//     expert in (token, slot) order (rounds of blockDim pairs: __match_any_sync ranks inside a
//     warp, per-warp counts in shared memory the warps before, a running histogram the rounds
//     before). The ids of the first kCachedRounds rounds are all loaded at the start (one round
//     trip), a repeated id within a token is found by warp shuffles (earlier slots in other warps
//     are re-read), and each pair's id and chunk rank stay in registers until phase C. Dropless,
//     each token's set of destination ranks is known here too (a 64-bit mask per token in shared
//     memory, set by 32-bit atomicOr on its halves), and so is the number of tokens this chunk
//     sends to each rank.
//  B. publish the block's expert histogram (and token counts) and raise flag A[b] (a CTA barrier,
//     then one release store); wait for the flags of the blocks before it (warp 0 polls, both
//     flags of a lane in flight at once, then an acquire fence), and sum their aggregates
//     (look-back over at most kMaxLayoutBlocks rows, each (column, half of the rows) one thread's
//     32 loads, every load of a thread issued before its first add: one L2 round trip), which
//     gives the chunk's offsets. A block only ever waits for lower blocks, which the hardware
//     dispatches first, so there is no deadlock without co-residency (the same argument as CUB's
//     decoupled look-back; besides, 64 blocks of one SM each are co-resident on an H100/H200).
//  C. positions = offset + chunk rank; positions >= capacity are dropped (drop by position). With a
//     capacity the destination masks come from the kept pairs only, so the token counts are
//     published in a second round (flag B) and looked back the same way. Token slots are then
//     written once, final.
//  D. the last block has seen every aggregate: it writes the totals (routed_counts, send_tokens),
//     the status (first bad pair of all blocks, overflow) and, for a one-rank group, the receive
//     side (padded offsets by a block scan), and merges the status into the group's. What it
//     reads from global memory (the blocks' first bad pairs, the group's status) is loaded with
//     its look-back, and the kept counts come from shared memory, so the tail has no round trip.
// Flags without clearing: the handle block holds a 64-bit generation g, read by thread 0 of every
// block at its start (that load precedes the block's release of flag A) and advanced by the last
// block once every flag of the launch has been seen (so every block has read it). A flag is set
// for this launch iff it holds flag_value(g, stage, b), a bijective mix of (g, stage, b): flags
// left by earlier launches hold other generations' values and never match, and a captured graph
// replays correctly because g lives in device memory. (Memory never written by prepare matches
// only if it happens to hold that exact 64-bit hash.)
//
// The legacy path (EPX_LAYOUT_KERNEL=legacy, kept to compare on the GPU) is three launches over
// the same chunks after two memsets of the status:
//  1. pair_count_kernel: phase A above, histogram -> block_hist[b].
//  2. pair_finalize_kernel: positions from the histograms of the chunks before, capacity; token
//     ranks per destination with ballots, in token order.
//  3. token_finalize_kernel: token slots become global by the same chunk prefix; block 0 writes
//     the totals and, for a one-rank group, the receive side.
// Drop by probability runs in front of either: pairs are listed per expert (positions from a
// dropless pass), each expert's block ranks its pairs by weight, and the ids of the pairs that lose
// are masked in a copy of the validated ids, which then goes through a dropless pass again.
#pragma once

#include <cstdint>

#include "cuda/common/block_ticket.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/gpu_scope_access.cuh"

namespace epx::cuda::layout {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxLayoutBlocks = 64;
constexpr int kMaxExperts = 1024;
constexpr int kMaxRanks = 64;

struct Params {
  const void* idx;  // [T, K] int32 or int64
  bool idx64;
  int T, K, E, R, Le;
  int chunk;     // tokens per block
  int capacity;  // per-expert pairs kept (0 = all)
  int32_t* routed;      // [T, K]
  int32_t* pair_pos;    // [T, K]
  int32_t* local_rank;  // [T, K] scratch
  int32_t* block_hist;  // [blocks, E] scratch
  int32_t* block_tok;   // [blocks, R] scratch
  int32_t* token_slot;  // [T, R]
  int32_t* send_tokens; // [R]
  int32_t* counts;      // [E] routed_counts
  int32_t* status;      // [4]
  // one-rank groups: receive side
  bool local;
  int align;
  int64_t recv_capacity;
  int32_t* recv_pairs;  // [1, E]
  int32_t* recv_tokens; // [1]
  int32_t* expert_rows; // [E]
  int32_t* expert_offsets;  // [E + 1]
  // the group's sticky status (first error of any handle; see Group::check()), or null
  int32_t* group_status;    // [5] {overflow rows (max), bad pair, its id, kind, K of that handle}
  // layout_kernel only
  int32_t* block_bad;            // [kMaxLayoutBlocks] first bad pair of each block
  unsigned long long* sync;      // [1 + 2 * kMaxLayoutBlocks]: generation, flags A, flags B
  int pass;                      // kPassOnly, kPassFirst (of two: drop by probability), kPassSecond
};

enum Pass : int { kPassOnly = 0, kPassFirst = 1, kPassSecond = 2 };

__device__ __forceinline__ int64_t load_id(const Params& p, int64_t i) {
  return p.idx64 ? static_cast<const int64_t*>(p.idx)[i] : static_cast<const int32_t*>(p.idx)[i];
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

__global__ void __launch_bounds__(kThreads) pair_count_kernel(Params p) {
  extern __shared__ int32_t smem[];
  int32_t* hist = smem;                // [E]
  int32_t* wcnt = smem + p.E;          // [kWarps][E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < p.E * (kWarps + 1); i += blockDim.x) smem[i] = 0;
  __syncthreads();
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * p.chunk;
  const int64_t t1 = min(static_cast<int64_t>(p.T), t0 + p.chunk);
  const int64_t npairs = t1 > t0 ? (t1 - t0) * p.K : 0;
  for (int64_t base = 0; base < npairs; base += blockDim.x) {
    const int64_t q = base + threadIdx.x;
    const bool active = q < npairs;
    const int64_t gp = t0 * p.K + q;
    int key = -2;  // inactive lanes: a key no real pair has
    if (active) {
      const int64_t e = load_id(p, gp);
      key = -1;
      if (e != -1) {
        if (e < 0 || e >= p.E) {
          atomicMin(&p.status[1], static_cast<int32_t>(gp));
        } else {
          const int64_t row = gp - gp % p.K;
          bool repeated = false;
          for (int64_t j = row; j < gp; ++j) repeated |= load_id(p, j) == e;
          if (repeated) atomicMin(&p.status[1], static_cast<int32_t>(gp));
          else key = static_cast<int>(e);
        }
      }
      p.routed[gp] = key;
    }
    const unsigned mask = __match_any_sync(0xffffffffu, key);
    const int lane_rank = __popc(mask & lanemask_lt());
    const bool leader = lane_rank == 0;
    if (leader && key >= 0) wcnt[warp * p.E + key] = __popc(mask);
    __syncthreads();
    if (key >= 0) {
      int r = hist[key] + lane_rank;
      for (int w = 0; w < warp; ++w) r += wcnt[w * p.E + key];
      p.local_rank[gp] = r;
    } else if (active) {
      p.local_rank[gp] = -1;
    }
    __syncthreads();
    if (leader && key >= 0) {
      atomicAdd(&hist[key], __popc(mask));
      wcnt[warp * p.E + key] = 0;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) p.block_hist[blockIdx.x * p.E + e] = hist[e];
  (void)lane;
}

__global__ void __launch_bounds__(kThreads) pair_finalize_kernel(Params p) {
  extern __shared__ int32_t smem[];
  int32_t* off = smem;                    // [E] pairs of the chunks before this one
  int32_t* wtok = smem + p.E;             // [kWarps][R]
  int32_t* tokhist = wtok + kWarps * p.R; // [R]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.x;
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
    int32_t before = 0, total = 0;
    for (int j = 0; j < static_cast<int>(gridDim.x); ++j) {
      const int32_t c = p.block_hist[j * p.E + e];
      if (j < b) before += c;
      total += c;
    }
    off[e] = before;
    if (b == 0) p.counts[e] = p.capacity > 0 ? min(total, p.capacity) : total;
  }
  for (int i = threadIdx.x; i < kWarps * p.R + p.R; i += blockDim.x) wtok[i] = 0;
  // Details of the first bad pair for the host message (Group::check()), from the ids as given:
  // only the first pass over them fills status[3], a later pass over masked ids must not.
  if (b == 0 && threadIdx.x == 0 && p.status[3] == 0) {
    const int32_t bad = p.status[1];
    if (bad >= 0 && static_cast<int64_t>(bad) < static_cast<int64_t>(p.T) * p.K) {
      const int64_t e = load_id(p, bad);
      p.status[2] = static_cast<int32_t>(e);
      p.status[3] = (e < 0 || e >= p.E) ? 1 : 2;
    }
  }
  __syncthreads();
  const int64_t t0 = static_cast<int64_t>(b) * p.chunk;
  const int64_t t1 = min(static_cast<int64_t>(p.T), t0 + p.chunk);
  for (int64_t gp = t0 * p.K + threadIdx.x; gp < t1 * p.K; gp += blockDim.x) {
    int32_t e = p.routed[gp];
    int32_t pos = -1;
    if (e >= 0) {
      pos = off[e] + p.local_rank[gp];
      if (p.capacity > 0 && pos >= p.capacity) {
        e = -1;
        pos = -1;
      }
    }
    p.routed[gp] = e;
    p.pair_pos[gp] = pos;
  }
  __syncthreads();  // the kept routing of the whole chunk is visible to the block
  // Token slots per destination rank, in token order: rounds of blockDim tokens.
  for (int64_t base = t0; base < t1; base += blockDim.x) {
    const int64_t t = base + threadIdx.x;
    uint64_t bits = 0;
    if (t < t1)
      for (int k = 0; k < p.K; ++k) {
        const int32_t e = p.routed[t * p.K + k];
        if (e >= 0) bits |= uint64_t(1) << (e / p.Le);
      }
    for (int d = 0; d < p.R; ++d) {
      const unsigned bal = __ballot_sync(0xffffffffu, (bits >> d) & 1);
      if (lane == 0) wtok[warp * p.R + d] = __popc(bal);
    }
    __syncthreads();
    // Same ballots again: each lane's prefix inside its warp plus the warps before it.
    for (int d = 0; d < p.R; ++d) {
      const unsigned bal = __ballot_sync(0xffffffffu, (bits >> d) & 1);
      if (t < t1) {
        int32_t slot = -1;
        if ((bits >> d) & 1) {
          slot = tokhist[d] + __popc(bal & lanemask_lt());
          for (int w = 0; w < warp; ++w) slot += wtok[w * p.R + d];
        }
        p.token_slot[t * p.R + d] = slot;
      }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) {
      int32_t sum = 0;
      for (int w = 0; w < kWarps; ++w) sum += wtok[w * p.R + d];
      tokhist[d] += sum;
    }
    __syncthreads();
  }
  for (int d = threadIdx.x; d < p.R; d += blockDim.x) p.block_tok[b * p.R + d] = tokhist[d];
}

// The group keeps the first bad pair of any handle and the largest overflow, so an error survives
// the handle that saw it until Group::check() reads it.
__device__ __forceinline__ void merge_status(const Params& p) {
  int32_t* g = p.group_status;
  if (!g) return;
  if (p.status[0] > g[0]) g[0] = p.status[0];
  if (g[1] == 0x7f7f7f7f && p.status[1] != 0x7f7f7f7f) {
    g[1] = p.status[1];
    g[2] = p.status[2];
    g[3] = p.status[3];
    g[4] = p.K;
  }
}

__global__ void __launch_bounds__(kThreads) token_finalize_kernel(Params p) {
  __shared__ int32_t off[kMaxRanks];
  __shared__ int32_t scan[kThreads];
  const int b = blockIdx.x;
  for (int d = threadIdx.x; d < p.R; d += blockDim.x) {
    int32_t before = 0, total = 0;
    for (int j = 0; j < static_cast<int>(gridDim.x); ++j) {
      const int32_t c = p.block_tok[j * p.R + d];
      if (j < b) before += c;
      total += c;
    }
    off[d] = before;
    if (b == 0) {
      p.send_tokens[d] = total;
      if (p.local) p.recv_tokens[d] = total;
    }
  }
  __syncthreads();
  const int64_t t0 = static_cast<int64_t>(b) * p.chunk;
  const int64_t t1 = min(static_cast<int64_t>(p.T), t0 + p.chunk);
  for (int64_t i = t0 * p.R + threadIdx.x; i < t1 * p.R; i += blockDim.x) {
    const int32_t s = p.token_slot[i];
    if (s >= 0) p.token_slot[i] = off[i % p.R] + s;
  }
  if (b != 0) return;
  if (!p.local) {
    if (threadIdx.x == 0) merge_status(p);
    return;
  }
  // One-rank group: every expert is local; padded exclusive scan of the kept counts over E.
  int64_t carry = 0;
  for (int base = 0; base < p.E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int32_t rows = e < p.E ? p.counts[e] : 0;
    const int32_t padded = static_cast<int32_t>((static_cast<int64_t>(rows) + p.align - 1) / p.align * p.align);
    if (e < p.E) {
      p.expert_rows[e] = rows;
      p.recv_pairs[e] = rows;
    }
    scan[threadIdx.x] = padded;
    __syncthreads();
    for (int s = 1; s < blockDim.x; s <<= 1) {  // Hillis-Steele inclusive scan
      const int32_t v = threadIdx.x >= s ? scan[threadIdx.x - s] : 0;
      __syncthreads();
      scan[threadIdx.x] += v;
      __syncthreads();
    }
    if (e < p.E) p.expert_offsets[e] = static_cast<int32_t>(carry + scan[threadIdx.x] - padded);
    carry += scan[blockDim.x - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.expert_offsets[p.E] = static_cast<int32_t>(carry);
    p.status[0] = carry > p.recv_capacity ? static_cast<int32_t>(carry - p.recv_capacity) : 0;
    merge_status(p);
  }
}

// ---- one launch: layout_kernel ------------------------------------------------------------------

// layout_kernel runs one pair per thread in a round, so with 512 threads a chunk of 64 tokens of
// top-8 is a single round (one wave of id loads, one set of barriers) and the look-back has a
// thread for each (column, half of the rows). One block per SM anyway (at most kMaxLayoutBlocks).
constexpr int kLayoutThreads = 512;
constexpr int kLayoutWarps = kLayoutThreads / 32;
// Rounds whose ids, keys and chunk ranks stay in registers from phase A to phase C (later rounds go
// through p.local_rank and p.routed in global memory, an extra L2 round trip).
constexpr int kCachedRounds = 2;

// splitmix64's finaliser: a bijection of 64-bit words, so distinct (g, stage, b) give distinct flags.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned long long flag_value(unsigned long long g, int stage, int b) {
  return mix64(g * 256ull + static_cast<unsigned long long>(stage) * kMaxLayoutBlocks + static_cast<unsigned>(b));
}

// Publishes this block's aggregates (written before the call by any thread of the block): the
// barrier orders every thread's writes before thread 0's release store of the flag, which makes
// them visible device-wide with it (the pattern of cooperative groups' grid sync and CUTLASS's
// GenericBarrier: one releasing thread after a CTA barrier, not a fence in every thread).
__device__ __forceinline__ void publish(unsigned long long* flag, unsigned long long value) {
  __syncthreads();
  if (threadIdx.x == 0) store_release_gpu(flag, value);
}

// Waits until blocks 0..b-1 have raised their flag of this stage; then their aggregates may be read
// (with ld.cg: they were written after this kernel started). Each lane polls two flags with both
// loads in flight at once, without sleeping (at most 64 blocks poll, and the wait is short: every
// block does the same work), and an acquire fence once all are seen.
__device__ __forceinline__ void wait_for_lower(const unsigned long long* flags, unsigned long long g, int stage, int b) {
  static_assert(kMaxLayoutBlocks <= 64, "two flags per lane");
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const bool has0 = lane < b, has1 = lane + 32 < b;
    const unsigned long long want0 = flag_value(g, stage, lane), want1 = flag_value(g, stage, lane + 32);
    for (;;) {
      const unsigned long long f0 = has0 ? load_relaxed_gpu(flags + lane) : want0;
      const unsigned long long f1 = has1 ? load_relaxed_gpu(flags + lane + 32) : want1;
      if (__all_sync(0xffffffffu, f0 == want0 && f1 == want1)) break;
    }
    fence_acq_rel_gpu();  // acquire only: not the fence.sc of __threadfence() (block_ticket.cuh)
  }
  __syncthreads();
}

// v[u] = a[u * stride] for u < m (m <= 32), else 0; loads only, so that a caller can put several
// such batches in flight before the first add.
// (A running pointer: per-load 64-bit products cost several instructions a load, and issuing them
// is much of the look-back's time in a block of 16 warps.)
__device__ __forceinline__ void load_rows32(const int32_t* a, int stride, int m, int32_t (&v)[32]) {
#pragma unroll
  for (int u = 0; u < 32; ++u) {
    v[u] = u < m ? __ldcg(a) : 0;
    a += stride;
  }
}

// The look-back: sums over the rows j < n (n <= kMaxLayoutBlocks) of aggregates other blocks wrote
// during this launch (ld.cg): off[e] over block_hist for e < E (with_hist), tokoff[d] over
// block_tok for d < R (with_tok). A work item is a (column, half of the rows), at most 32 loads;
// each thread takes two items and issues all of their loads before the first add, so with E + R <=
// blockDim the look-back costs one L2 round trip (more columns take more passes). Partial sums
// meet in part[] (2 * (E + R) ints). Integer addition: the order of the sums does not matter.
__device__ __forceinline__ void look_back(const Params& p, int n, bool with_hist, bool with_tok, int32_t* part,
                                          int32_t* off, int32_t* tokoff) {
  static_assert(kMaxLayoutBlocks <= 64, "two halves of at most 32 rows");
  const int nh = with_hist ? p.E : 0, cols = nh + (with_tok ? p.R : 0), items = 2 * cols;
  for (int i0 = threadIdx.x; i0 < items; i0 += 2 * blockDim.x) {
    int32_t v0[32], v1[32];
    const int i1 = i0 + blockDim.x;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = k == 0 ? i0 : i1;
      const int h = i >= cols ? 1 : 0, c = i - h * cols;  // item i: column c, rows [32h, 32h + 32)
      const int m = i < items ? max(0, min(n - 32 * h, 32)) : 0;
      const bool hc = c < nh;
      const int stride = hc ? p.E : p.R;
      const int32_t* a = (hc ? p.block_hist + c : p.block_tok + (c - nh)) + static_cast<int64_t>(32 * h) * stride;
      load_rows32(a, stride, m, k == 0 ? v0 : v1);
    }
    int32_t s0 = 0, s1 = 0;
#pragma unroll
    for (int u = 0; u < 32; ++u) {
      s0 += v0[u];
      s1 += v1[u];
    }
    part[i0] = s0;
    if (i1 < items) part[i1] = s1;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const int32_t s = part[c] + part[c + cols];
    if (c < nh)
      off[c] = s;
    else
      tokoff[c - nh] = s;
  }
  __syncthreads();
}

// Tokens [t0, t1) of the chunk against their destination masks bits[t - t0]: with `write`, token
// t's slot among the chunk's tokens to rank d (token order), plus base[d], goes to token_slot;
// either way tokcnt[d] ends as the chunk's number of tokens to d. tokcnt must be zero on entry.
__device__ __forceinline__ void token_pass(const Params& p, const uint64_t* bits, int64_t t0, int64_t t1,
                                           int32_t* wtok, int32_t* tokcnt, const int32_t* base, bool write) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (!write) {
    for (int64_t b0 = t0; b0 < t1; b0 += blockDim.x) {  // block-uniform trip count
      const int64_t t = b0 + threadIdx.x;
      const uint64_t m = t < t1 ? bits[t - t0] : 0;
      for (int d = 0; d < p.R; ++d) {
        const unsigned bal = __ballot_sync(0xffffffffu, (m >> d) & 1);
        if (lane == 0 && bal) atomicAdd(&tokcnt[d], __popc(bal));
      }
    }
    __syncthreads();
    return;
  }
  for (int64_t b0 = t0; b0 < t1; b0 += blockDim.x) {
    const int64_t t = b0 + threadIdx.x;
    const uint64_t m = t < t1 ? bits[t - t0] : 0;
    for (int d = 0; d < p.R; ++d) {
      const unsigned bal = __ballot_sync(0xffffffffu, (m >> d) & 1);
      if (lane == 0) wtok[warp * p.R + d] = __popc(bal);
    }
    __syncthreads();
    // Each lane's prefix inside its warp plus the warps before it (same ballots again).
    for (int d = 0; d < p.R; ++d) {
      const unsigned bal = __ballot_sync(0xffffffffu, (m >> d) & 1);
      if (t < t1) {
        int32_t slot = -1;
        if ((m >> d) & 1) {
          slot = base[d] + tokcnt[d] + __popc(bal & lanemask_lt());
          for (int w = 0; w < warp; ++w) slot += wtok[w * p.R + d];
        }
        p.token_slot[t * p.R + d] = slot;
      }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) {
      int32_t sum = 0;
      for (int w = 0; w < kLayoutWarps; ++w) sum += wtok[w * p.R + d];
      tokcnt[d] += sum;
    }
    __syncthreads();
  }
}

// Exclusive scan of one int64 per thread over the block (kLayoutThreads), in thread order.
__device__ __forceinline__ int64_t block_exclusive_scan(int64_t v, int64_t* s_warp, int64_t* total) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  int64_t before = 0, all = 0;
  for (int w = 0; w < kLayoutWarps; ++w) {
    if (w < warp) before += s_warp[w];
    all += s_warp[w];
  }
  *total = all;
  return before + x - v;
}

// Sets bit `bit` of the 64-bit mask w with a 32-bit shared atomic on the half that holds it (a
// 64-bit atomicOr on shared memory compiles to a compare-and-swap loop, which the pairs of one token
// then retry against each other).
__device__ __forceinline__ void set_bit64(uint64_t* w, int bit) {
  unsigned* half = reinterpret_cast<unsigned*>(w) + (bit >> 5);  // little-endian: bits 0-31 first
  atomicOr(half, 1u << (bit & 31));
}

// Shared memory of layout_kernel (dynamic, in bytes).
__host__ __device__ inline size_t layout_smem_bytes(int E, int R, int chunk) {
  return sizeof(uint64_t) * static_cast<size_t>(chunk) +
         sizeof(int32_t) * (static_cast<size_t>(E) * (kLayoutWarps + 2) + static_cast<size_t>(kLayoutWarps) * R + 3 * R);
}

__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(Params p) {
  // Launched after the previous grid (cuda/common/dependent_launch.cuh); the next grid (prepare's
  // exchange) is small, so it may take its SM now and wait there for this grid's results.
  cuda::wait_for_previous_grid();
  cuda::allow_next_grid();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint64_t* bits = reinterpret_cast<uint64_t*>(smem_raw);  // [chunk] destination ranks of each token
  int32_t* hist = reinterpret_cast<int32_t*>(bits + p.chunk);  // [E] this chunk's pairs per expert
  int32_t* wcnt = hist + p.E;                                  // [kLayoutWarps][E]; look-back partials after A
  int32_t* off = wcnt + kLayoutWarps * p.E;                    // [E] pairs of the chunks before
  int32_t* wtok = off + p.E;                                   // [kLayoutWarps][R]
  int32_t* tokcnt = wtok + kLayoutWarps * p.R;                 // [R] this chunk's tokens per rank
  int32_t* tokoff = tokcnt + p.R;                              // [R] tokens of the chunks before
  int32_t* tokrun = tokoff + p.R;                              // [R] running count of the final pass
  __shared__ unsigned long long s_gen;
  __shared__ int32_t s_bad;
  __shared__ int64_t s_scan[kLayoutWarps];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.x, last = gridDim.x - 1;
  const bool dropless = p.capacity <= 0;
  const int64_t t0 = static_cast<int64_t>(b) * p.chunk;
  const int64_t t1 = min(static_cast<int64_t>(p.T), t0 + p.chunk);
  const int64_t nt = t1 > t0 ? t1 - t0 : 0;
  const int64_t npairs = nt * p.K;
  const int64_t pair0 = t0 * p.K;  // a multiple of K: a pair's slot is q % K

  // The generation (only thread 0 needs it before the publish barrier) and the ids of the cached
  // rounds: every load goes out here, so their round trips overlap each other and the clearing.
  unsigned long long g = 0;
  if (threadIdx.x == 0) g = __ldcg(p.sync);
  int64_t craw[kCachedRounds];
#pragma unroll
  for (int c = 0; c < kCachedRounds; ++c) {
    const int64_t q = static_cast<int64_t>(c) * blockDim.x + threadIdx.x;
    craw[c] = q < npairs ? load_id(p, pair0 + q) : -1;
  }
  if (threadIdx.x == 0) s_bad = 0x7f7f7f7f;
  for (int64_t i = threadIdx.x; i < nt; i += blockDim.x) bits[i] = 0;
  for (int i = threadIdx.x; i < p.E * (kLayoutWarps + 1); i += blockDim.x) hist[i] = 0;  // hist and wcnt
  for (int i = threadIdx.x; i < 3 * p.R; i += blockDim.x) tokcnt[i] = 0;               // tokcnt, tokoff, tokrun
  __syncthreads();

  // ---- A: validate, rank within the chunk ----
  int ckey[kCachedRounds], crank[kCachedRounds];
#pragma unroll
  for (int c = 0; c < kCachedRounds; ++c) ckey[c] = crank[c] = -1;
  const int dmax = min(p.K - 1, 31);  // earlier slots of a token that a shuffle can reach
  int slot0 = 0;                      // base % K
  int round = 0;
  for (int64_t base = 0; base < npairs; base += blockDim.x, ++round) {
    const int64_t q = base + threadIdx.x;
    const bool active = q < npairs;
    const int64_t gp = pair0 + q;
    int64_t e = -1;
    if (round < kCachedRounds) {
#pragma unroll
      for (int c = 0; c < kCachedRounds; ++c)
        if (c == round) e = craw[c];
    } else if (active) {
      e = load_id(p, gp);
    }
    // A repeat of an id earlier in the same token is a bad pair. Lane l holds pair q - (lane - l),
    // so earlier slots in this warp come by shuffles of the candidate key (-1 for ids out of range,
    // which can never equal a valid id); slots before the warp (tokens straddling warps, or K > 32)
    // are read again from memory.
    const int slot = (slot0 + static_cast<int>(threadIdx.x)) % p.K;
    const int v = (e >= 0 && e < p.E) ? static_cast<int>(e) : -1;
    bool repeated = false;
    for (int d = 1; d <= dmax; ++d) {  // warp-uniform trip count
      const int w = __shfl_up_sync(0xffffffffu, v, d);
      if (d <= slot && d <= lane) repeated |= w == v;
    }
    int key = -2;  // inactive lanes: a key no real pair has
    if (active) {
      key = -1;
      if (e != -1) {
        if (v >= 0)
          for (int d = lane + 1; d <= slot; ++d) repeated |= load_id(p, gp - d) == e;
        if (v < 0 || repeated) atomicMin(&s_bad, static_cast<int32_t>(gp));
        else key = v;
      }
      p.routed[gp] = key;
      if (dropless && key >= 0) set_bit64(&bits[static_cast<int>(q) / p.K], key / p.Le);
    }
    const unsigned mask = __match_any_sync(0xffffffffu, key);
    const int lane_rank = __popc(mask & lanemask_lt());
    const bool leader = lane_rank == 0;
    if (leader && key >= 0) wcnt[warp * p.E + key] = __popc(mask);
    __syncthreads();
    int rank = -1;
    if (key >= 0) {
      rank = hist[key] + lane_rank;
      for (int w = 0; w < warp; ++w) rank += wcnt[w * p.E + key];
    }
    if (round < kCachedRounds) {
#pragma unroll
      for (int c = 0; c < kCachedRounds; ++c)
        if (c == round) {
          ckey[c] = key;
          crank[c] = rank;
        }
    } else if (key >= 0) {
      p.local_rank[gp] = rank;
    }
    __syncthreads();
    if (leader && key >= 0) {
      atomicAdd(&hist[key], __popc(mask));
      wcnt[warp * p.E + key] = 0;
    }
    __syncthreads();
    slot0 = (slot0 + static_cast<int>(blockDim.x)) % p.K;
  }
  if (dropless) token_pass(p, bits, t0, t1, wtok, tokcnt, nullptr, false);

  // ---- B: publish, look back ----
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) p.block_hist[b * p.E + e] = hist[e];
  if (dropless)
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) p.block_tok[b * p.R + d] = tokcnt[d];
  if (threadIdx.x == 0) {
    p.block_bad[b] = s_bad;
    s_gen = g;  // for warp 0 after the publish barrier
  }
  publish(p.sync + 1 + b, flag_value(g, 0, b));
  wait_for_lower(p.sync + 1, s_gen, 0, b);
  // The last block's tail needs every block's first bad pair and the group's status: those loads go
  // out with the look-back's, one round trip for both.
  int32_t bad = 0x7f7f7f7f, grp0 = 0, grp1 = 0, prev1 = 0, prev2 = 0, prev3 = 0;
  if (b == last) {
    if (threadIdx.x < 32) {
      const int nb = static_cast<int>(gridDim.x);
      const int32_t x0 = lane < nb ? __ldcg(p.block_bad + lane) : 0x7f7f7f7f;
      const int32_t x1 = lane + 32 < nb ? __ldcg(p.block_bad + lane + 32) : 0x7f7f7f7f;
      bad = min(x0, x1);
    }
    if (threadIdx.x == 0 && p.pass != kPassFirst) {
      if (p.group_status) {
        grp0 = p.group_status[0];
        grp1 = p.group_status[1];
      }
      if (p.pass == kPassSecond) {  // the first pass's record of the ids as given
        prev1 = p.status[1];
        prev2 = p.status[2];
        prev3 = p.status[3];
      }
    }
  }
  look_back(p, b, true, dropless, wcnt, off, tokoff);

  // ---- C: positions, capacity, token slots ----
  round = 0;
  for (int64_t q = threadIdx.x; q < npairs; q += blockDim.x, ++round) {
    const int64_t gp = pair0 + q;
    int32_t e = -1, lr = -1;
    if (round < kCachedRounds) {
#pragma unroll
      for (int c = 0; c < kCachedRounds; ++c)
        if (c == round) {
          e = ckey[c];
          lr = crank[c];
        }
    } else {
      e = p.routed[gp];
      if (e >= 0) lr = p.local_rank[gp];
    }
    int32_t pos = -1;
    if (e >= 0) {
      pos = off[e] + lr;
      if (!dropless && pos >= p.capacity) {
        e = -1;
        pos = -1;
      }
      if (!dropless) p.routed[gp] = e;
      if (!dropless && e >= 0) set_bit64(&bits[static_cast<int>(q) / p.K], e / p.Le);
    }
    p.pair_pos[gp] = pos;
  }
  __syncthreads();
  if (!dropless) {
    token_pass(p, bits, t0, t1, wtok, tokcnt, nullptr, false);
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) p.block_tok[b * p.R + d] = tokcnt[d];
    publish(p.sync + 1 + kMaxLayoutBlocks + b, flag_value(s_gen, 1, b));
    wait_for_lower(p.sync + 1 + kMaxLayoutBlocks, s_gen, 1, b);
    look_back(p, b, false, true, wcnt, off, tokoff);
  }
  token_pass(p, bits, t0, t1, wtok, tokrun, tokoff, true);

  if (b != last) return;
  // ---- D: the last block has seen every aggregate ----
  for (int d = threadIdx.x; d < p.R; d += blockDim.x) {
    const int32_t total = tokoff[d] + tokcnt[d];
    p.send_tokens[d] = total;
    if (p.local) p.recv_tokens[d] = total;
  }
  // Kept pairs per expert and, for a one-rank group, the padded exclusive scan over E (each thread
  // a run of consecutive experts, then a block scan of the runs). The counts come from shared
  // memory both times, never read back from the stores.
  auto kept_of = [&](int e) {
    const int32_t total = off[e] + hist[e];
    return dropless ? total : min(total, p.capacity);
  };
  auto padded = [&](int32_t rows) { return (static_cast<int64_t>(rows) + p.align - 1) / p.align * p.align; };
  const int per = (p.E + kLayoutThreads - 1) / kLayoutThreads;
  const int e_begin = min(p.E, static_cast<int>(threadIdx.x) * per), e_end = min(p.E, e_begin + per);
  int64_t run = 0;
  for (int e = e_begin; e < e_end; ++e) {
    const int32_t kept = kept_of(e);
    p.counts[e] = kept;
    if (p.local) {
      p.expert_rows[e] = kept;
      p.recv_pairs[e] = kept;
      run += padded(kept);
    }
  }
  int64_t all = 0;
  if (p.local) {  // block-uniform
    int64_t at = block_exclusive_scan(run, s_scan, &all);
    for (int e = e_begin; e < e_end; ++e) {
      p.expert_offsets[e] = static_cast<int32_t>(at);
      at += padded(kept_of(e));
    }
  }
  // First bad pair over every block (loaded with the look-back): one redux in warp 0.
  if (threadIdx.x < 32) bad = __reduce_min_sync(0xffffffffu, bad);
  if (threadIdx.x == 0) {
    if (p.local) p.expert_offsets[p.E] = static_cast<int32_t>(all);
    // status[0]: the overflow of the final routing (a multi-rank group fills it after the exchange).
    const int32_t s0 = (p.local && p.pass != kPassFirst && all > p.recv_capacity)
                           ? static_cast<int32_t>(all - p.recv_capacity)
                           : 0;
    p.status[0] = s0;
    int32_t s1 = prev1, s2 = prev2, s3 = prev3;
    if (p.pass != kPassSecond) {  // the ids as given are those of the first (or only) pass
      int32_t id = 0, kind = 0;
      if (bad != 0x7f7f7f7f) {
        const int64_t e = load_id(p, bad);
        id = static_cast<int32_t>(e);
        kind = (e < 0 || e >= p.E) ? 1 : 2;
      }
      s1 = bad;
      s2 = id;
      s3 = kind;
      p.status[1] = s1;
      p.status[2] = s2;
      p.status[3] = s3;
    }
    // The group keeps the first bad pair of any handle and the largest overflow (merge_status, with
    // this handle's values from registers and the group's loaded with the look-back).
    if (p.pass != kPassFirst && p.group_status) {
      int32_t* gs = p.group_status;
      if (s0 > grp0) gs[0] = s0;
      if (grp1 == 0x7f7f7f7f && s1 != 0x7f7f7f7f) {
        gs[1] = s1;
        gs[2] = s2;
        gs[3] = s3;
        gs[4] = p.K;
      }
    }
    // Every block read g before raising its flag A, and every flag has been seen: the next launch
    // may use the next generation.
    *reinterpret_cast<volatile unsigned long long*>(p.sync) = g + 1;
  }
}

// ---- drop by probability --------------------------------------------------------------------

// Lists every valid pair under its expert at expert_start[e] + position (positions from a dropless
// pass), so each expert's pairs sit contiguously in (token, slot) order; copies the validated ids
// to masked_ids, which rank_by_weight_kernel then masks.
__global__ void list_pairs_kernel(const int32_t* routed, const int32_t* pair_pos, const int32_t* counts, int E,
                                  int64_t npairs, int32_t* list, int32_t* masked_ids) {
  __shared__ int32_t start[kMaxExperts];
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int e = 0; e < E; ++e) {
      start[e] = acc;
      acc += counts[e];
    }
  }
  __syncthreads();
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < npairs;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = routed[q];
    masked_ids[q] = e;
    if (e >= 0) list[start[e] + pair_pos[q]] = static_cast<int32_t>(q);
  }
}

// One block per expert: a pair survives if fewer than `capacity` pairs of the expert beat it
// (larger weight, or equal weight and earlier position; NaN ranks last). Losers get id -1 in
// masked_ids (a copy of the validated routing), winners keep theirs.
__global__ void rank_by_weight_kernel(const int32_t* list, const int32_t* counts, const float* weights, int E,
                                      int capacity, int32_t* masked_ids) {
  const int e = blockIdx.x;
  __shared__ int32_t start_s;
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int j = 0; j < e; ++j) acc += counts[j];
    start_s = acc;
  }
  __syncthreads();
  const int32_t n = counts[e], start = start_s;
  if (n <= capacity) return;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t pi = list[start + i];
    float wi = weights[pi];
    if (wi != wi) wi = -INFINITY;
    int32_t beaten_by = 0;
    for (int32_t j = 0; j < n && beaten_by < capacity; ++j) {
      float wj = weights[list[start + j]];
      if (wj != wj) wj = -INFINITY;
      beaten_by += (wj > wi) || (wj == wi && j < i);
    }
    if (beaten_by >= capacity) masked_ids[pi] = -1;
  }
}

}  // namespace epx::cuda::layout
