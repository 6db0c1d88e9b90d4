// Kernels of the device-side prepare; no floating point, integer atomics only where their order
// does not matter, so the layout is deterministic. Block b owns tokens [b*chunk, (b+1)*chunk), at
// most kMaxLayoutBlocks blocks.
//
// The default path is ONE launch, layout_kernel (nothing to clear beforehand, so it is one node of
// a CUDA graph):
//  A. validate the chunk's ids (a bad slot is masked; the block keeps its first bad pair), write
//     the validated id to routed_experts, and rank every pair among the chunk's pairs to the same
//     expert in (token, slot) order (rounds of blockDim pairs: __match_any_sync ranks inside a
//     warp, per-warp counts in shared memory the warps before, a running histogram the rounds
//     before). Dropless, each token's set of destination ranks is known here too (a 64-bit mask per
//     token in shared memory), and so is the number of tokens this chunk sends to each rank.
//  B. publish the block's expert histogram (and token counts) and raise flag A[b]; wait for the
//     flags of the blocks before it (look-back over at most kMaxLayoutBlocks aggregates, summed in
//     block order), which gives the chunk's offsets. A block only ever waits for lower blocks, which
//     the hardware dispatches first, so there is no deadlock without co-residency (the same
//     argument as CUB's decoupled look-back).
//  C. positions = offset + chunk rank; positions >= capacity are dropped (drop by position). With a
//     capacity the destination masks come from the kept pairs only, so the token counts are
//     published in a second round (flag B) and looked back the same way. Token slots are then
//     written once, final.
//  D. the last block has seen every aggregate: it writes the totals (routed_counts, send_tokens),
//     the status (first bad pair of all blocks, overflow) and, for a one-rank group, the receive
//     side (padded offsets by a block scan), and merges the status into the group's.
// Flags without clearing: the handle block holds a 64-bit generation g, read by every block at
// its start and advanced by the last block once every flag of the launch has been seen (so every
// block has read it). A flag is set for this launch iff it holds flag_value(g, stage, b), a
// bijective mix of (g, stage, b): flags left by earlier launches hold other generations' values and
// never match, and a captured graph replays correctly because g lives in device memory. (Memory
// never written by prepare matches only if it happens to hold that exact 64-bit hash.)
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

__device__ __forceinline__ unsigned long long load_volatile(const unsigned long long* a) {
  return *reinterpret_cast<const volatile unsigned long long*>(a);
}

// Publishes this block's aggregates (written before the call by any thread of the block): every
// write is made visible device-wide before the flag.
__device__ __forceinline__ void publish(unsigned long long* flag, unsigned long long value) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(flag) = value;
}

// Waits until blocks 0..b-1 have raised their flag of this stage; then their aggregates may be read
// (with ld.cg: they were written after this kernel started).
__device__ __forceinline__ void wait_for_lower(const unsigned long long* flags, unsigned long long g, int stage, int b) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    for (;;) {
      bool ok = true;
      for (int j = lane; j < b; j += 32) ok = ok && load_volatile(flags + j) == flag_value(g, stage, j);
      if (__all_sync(0xffffffffu, ok)) break;
      __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
}

// Sum of rows[j * stride + col] over j < n (n <= kMaxLayoutBlocks), written by other blocks of this
// launch (ld.cg). Loads go out 32 at a time so that the look-back costs two L2 round trips, not one
// per few rows; integer addition makes the order irrelevant.
__device__ __forceinline__ int32_t sum_column(const int32_t* rows, int stride, int col, int n) {
  static_assert(kMaxLayoutBlocks <= 64, "two batches of 32");
  int32_t total = 0;
#pragma unroll
  for (int j0 = 0; j0 < kMaxLayoutBlocks; j0 += 32) {
    if (j0 >= n) break;
    int32_t v[32];
#pragma unroll
    for (int u = 0; u < 32; ++u) v[u] = j0 + u < n ? __ldcg(rows + static_cast<int64_t>(j0 + u) * stride + col) : 0;
#pragma unroll
    for (int u = 0; u < 32; ++u) total += v[u];
  }
  return total;
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
      for (int w = 0; w < kWarps; ++w) sum += wtok[w * p.R + d];
      tokcnt[d] += sum;
    }
    __syncthreads();
  }
}

// Exclusive scan of one int64 per thread over the block (kThreads), in thread order.
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
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += s_warp[w];
    all += s_warp[w];
  }
  *total = all;
  return before + x - v;
}

// Shared memory of layout_kernel (dynamic, in bytes).
__host__ __device__ inline size_t layout_smem_bytes(int E, int R, int chunk) {
  return sizeof(uint64_t) * static_cast<size_t>(chunk) +
         sizeof(int32_t) * (static_cast<size_t>(E) * (kWarps + 2) + static_cast<size_t>(kWarps) * R + 3 * R);
}

__global__ void __launch_bounds__(kThreads) layout_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint64_t* bits = reinterpret_cast<uint64_t*>(smem_raw);  // [chunk] destination ranks of each token
  int32_t* hist = reinterpret_cast<int32_t*>(bits + p.chunk);  // [E] this chunk's pairs per expert
  int32_t* wcnt = hist + p.E;                                  // [kWarps][E]
  int32_t* off = wcnt + kWarps * p.E;                          // [E] pairs of the chunks before
  int32_t* wtok = off + p.E;                                   // [kWarps][R]
  int32_t* tokcnt = wtok + kWarps * p.R;                       // [R] this chunk's tokens per rank
  int32_t* tokoff = tokcnt + p.R;                              // [R] tokens of the chunks before
  int32_t* tokrun = tokoff + p.R;                              // [R] running count of the final pass
  __shared__ unsigned long long s_gen;
  __shared__ int32_t s_bad;
  __shared__ int64_t s_scan[kWarps];

  const int warp = threadIdx.x / 32;
  const int b = blockIdx.x, last = gridDim.x - 1;
  const bool dropless = p.capacity <= 0;
  const int64_t t0 = static_cast<int64_t>(b) * p.chunk;
  const int64_t t1 = min(static_cast<int64_t>(p.T), t0 + p.chunk);
  const int64_t nt = t1 > t0 ? t1 - t0 : 0;

  if (threadIdx.x == 0) {
    s_gen = __ldcg(p.sync);
    s_bad = 0x7f7f7f7f;
  }
  for (int64_t i = threadIdx.x; i < nt; i += blockDim.x) bits[i] = 0;
  for (int i = threadIdx.x; i < p.E * (kWarps + 1); i += blockDim.x) hist[i] = 0;  // hist and wcnt
  for (int i = threadIdx.x; i < 3 * p.R; i += blockDim.x) tokcnt[i] = 0;         // tokcnt, tokoff, tokrun
  __syncthreads();
  const unsigned long long g = s_gen;

  // ---- A: validate, rank within the chunk ----
  const int64_t npairs = nt * p.K;
  for (int64_t base = 0; base < npairs; base += blockDim.x) {
    const int64_t q = base + threadIdx.x;
    const bool active = q < npairs;
    const int64_t gp = t0 * p.K + q;
    int key = -2;  // inactive lanes: a key no real pair has
    if (active) {
      const int64_t e = load_id(p, gp);
      key = -1;
      if (e != -1) {
        bool bad = e < 0 || e >= p.E;
        if (!bad) {
          const int64_t row = gp - gp % p.K;
          for (int64_t j = row; j < gp; ++j) bad |= load_id(p, j) == e;
        }
        if (bad) atomicMin(&s_bad, static_cast<int32_t>(gp));
        else key = static_cast<int>(e);
      }
      p.routed[gp] = key;
      if (dropless && key >= 0) atomicOr(reinterpret_cast<unsigned long long*>(&bits[q / p.K]), 1ull << (key / p.Le));
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
    }
    __syncthreads();
    if (leader && key >= 0) {
      atomicAdd(&hist[key], __popc(mask));
      wcnt[warp * p.E + key] = 0;
    }
    __syncthreads();
  }
  if (dropless) token_pass(p, bits, t0, t1, wtok, tokcnt, nullptr, false);

  // ---- B: publish, look back ----
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) p.block_hist[b * p.E + e] = hist[e];
  if (dropless)
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) p.block_tok[b * p.R + d] = tokcnt[d];
  if (threadIdx.x == 0) p.block_bad[b] = s_bad;
  publish(p.sync + 1 + b, flag_value(g, 0, b));
  wait_for_lower(p.sync + 1, g, 0, b);
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) off[e] = sum_column(p.block_hist, p.E, e, b);
  if (dropless)
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) tokoff[d] = sum_column(p.block_tok, p.R, d, b);
  __syncthreads();

  // ---- C: positions, capacity, token slots ----
  for (int64_t q = threadIdx.x; q < npairs; q += blockDim.x) {
    const int64_t gp = t0 * p.K + q;
    int32_t e = p.routed[gp];
    int32_t pos = -1;
    if (e >= 0) {
      pos = off[e] + p.local_rank[gp];
      if (!dropless && pos >= p.capacity) {
        e = -1;
        pos = -1;
      }
      if (!dropless) p.routed[gp] = e;
      if (!dropless && e >= 0) atomicOr(reinterpret_cast<unsigned long long*>(&bits[q / p.K]), 1ull << (e / p.Le));
    }
    p.pair_pos[gp] = pos;
  }
  __syncthreads();
  if (!dropless) {
    token_pass(p, bits, t0, t1, wtok, tokcnt, nullptr, false);
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) p.block_tok[b * p.R + d] = tokcnt[d];
    publish(p.sync + 1 + kMaxLayoutBlocks + b, flag_value(g, 1, b));
    wait_for_lower(p.sync + 1 + kMaxLayoutBlocks, g, 1, b);
    for (int d = threadIdx.x; d < p.R; d += blockDim.x) tokoff[d] = sum_column(p.block_tok, p.R, d, b);
    __syncthreads();
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
  // a run of consecutive experts, then a block scan of the runs).
  const int per = (p.E + kThreads - 1) / kThreads;
  const int e_begin = min(p.E, static_cast<int>(threadIdx.x) * per), e_end = min(p.E, e_begin + per);
  int64_t run = 0;
  for (int e = e_begin; e < e_end; ++e) {
    const int32_t total = off[e] + hist[e];
    const int32_t kept = dropless ? total : min(total, p.capacity);
    p.counts[e] = kept;
    if (p.local) {
      p.expert_rows[e] = kept;
      p.recv_pairs[e] = kept;
      run += (static_cast<int64_t>(kept) + p.align - 1) / p.align * p.align;
    }
  }
  int64_t all = 0;
  if (p.local) {  // block-uniform
    int64_t at = block_exclusive_scan(run, s_scan, &all);
    for (int e = e_begin; e < e_end; ++e) {
      p.expert_offsets[e] = static_cast<int32_t>(at);
      at += (static_cast<int64_t>(p.counts[e]) + p.align - 1) / p.align * p.align;
    }
  }
  // First bad pair over every block: warp 0, two loads per lane, one redux.
  int32_t bad = 0x7f7f7f7f;
  if (threadIdx.x < 32) {
    for (int j = threadIdx.x; j < static_cast<int>(gridDim.x); j += 32) bad = min(bad, __ldcg(p.block_bad + j));
    bad = __reduce_min_sync(0xffffffffu, bad);
  }
  if (threadIdx.x == 0) {
    if (p.local) p.expert_offsets[p.E] = static_cast<int32_t>(all);
    // status[0]: the overflow of the final routing (a multi-rank group fills it after the exchange).
    p.status[0] = (p.local && p.pass != kPassFirst && all > p.recv_capacity)
                      ? static_cast<int32_t>(all - p.recv_capacity)
                      : 0;
    if (p.pass != kPassSecond) {  // the ids as given are those of the first (or only) pass
      int32_t id = 0, kind = 0;
      if (bad != 0x7f7f7f7f) {
        const int64_t e = load_id(p, bad);
        id = static_cast<int32_t>(e);
        kind = (e < 0 || e >= p.E) ? 1 : 2;
      }
      p.status[1] = bad;
      p.status[2] = id;
      p.status[3] = kind;
    }
    if (p.pass != kPassFirst) merge_status(p);
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
