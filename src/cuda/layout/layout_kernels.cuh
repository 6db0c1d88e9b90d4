// Kernels of the device-side prepare. Three launches over the same token chunks (block b owns
// tokens [b*chunk, (b+1)*chunk)); no floating point, integer atomics only where their order does
// not matter, so the layout is deterministic.
//
//  1. pair_count_kernel: validates ids (a bad slot is masked and the first bad pair recorded with
//     atomicMin in status[1]), writes the validated id to routed_experts, and ranks every pair
//     among the chunk's pairs to the same expert in (token, slot) order: rounds of blockDim pairs,
//     __match_any_sync gives the rank inside a warp, per-warp counts in shared memory give the
//     warps before, a running histogram gives the rounds before. Block histogram -> block_hist[b].
//  2. pair_finalize_kernel: a pair's position among this rank's pairs to its expert is the sum of
//     the histograms of the chunks before (at most kMaxLayoutBlocks rows) plus its chunk rank;
//     positions >= capacity are dropped (drop by position). Then each token's set of destination
//     ranks is known: tokens are ranked per destination with ballots, in token order.
//  3. token_finalize_kernel: token slots become global by the same chunk prefix; block 0 writes
//     the totals and, for a one-rank group, the receive side (padded offsets, overflow word).
// Drop by probability runs in front of these: pairs are listed per expert (positions from passes
// 1-2 without capacity), each expert's block ranks its pairs by weight, and the ids of the pairs
// that lose are masked in a copy of topk_idx, which then goes through passes 1-3 dropless.
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
};

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

// ---- drop by probability --------------------------------------------------------------------

// Lists every valid pair under its expert at expert_start[e] + position (positions from passes 1-2
// run without capacity), so each expert's pairs sit contiguously in (token, slot) order.
__global__ void list_pairs_kernel(const int32_t* routed, const int32_t* pair_pos, const int32_t* counts, int E,
                                  int64_t npairs, int32_t* list) {
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
