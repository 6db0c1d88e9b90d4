// The zero-copy dispatch in one launch, the expansion overlapping the transfer.
//
// The phased dispatch (ep_kernels.cu) is  barrier -> send every row -> barrier -> expand, so the
// receiver's expansion into the expert-major layout (K / R rows written per received row: the
// larger part of dispatch's HBM traffic) starts only when the last row has crossed the link. Here
// the first blocks of the grid send and the others expand, in the same launch:
//  - a send warp writes its token's row, scales and routing meta into each remote destination's
//    window, then bumps the destination's arrival counter of that slot's chunk (kArrivalChunk slots
//    of one source) with a system-scope release;
//  - an expand block takes chunk items (source, chunk) in an order that follows the senders (chunk
//    index first), waits (acquire, with the group's timeout) until its remote chunk is complete,
//    subtracts what it consumed (the counters are back at zero when the op ends, ready for the next
//    one; the before-write barrier of that op orders the reset before any new arrival), and
//    expands each row into every expert row it feeds, loading the row once for all of them;
//  - rows a rank sends itself never go through its window: the expand blocks read them from x.
// No block waits on another block of its own grid, but ranks wait on each other's senders, so the
// whole grid must be resident (the launcher caps it by the occupancy); the senders come first.
// The per-element work is a copy, so results are bit-identical to the phased path and to the
// reference (same slots, same meta, same expert rows).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "comm/ep_device.cuh"
#include "cuda/common/cuda_check.h"

namespace epx::comm::ep_device {
namespace {

constexpr int kFanoutUnroll = 8;  // vectors per lane loaded once, then stored to every expert row

__device__ __forceinline__ void red_release_sys_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Arrival counter of chunk c of the slots source `src` writes into rank `dst`'s window.
__device__ __forceinline__ uint32_t* arrival(const DeviceGroup& g, int dst, int src, int c) {
  char* base = dst == g.rank ? reinterpret_cast<char*>(g.my_inbox) : reinterpret_cast<char*>(g.peer_inbox[dst]);
  return reinterpret_cast<uint32_t*>(base + inbox_bytes(g.R)) + static_cast<int64_t>(src) * arrival_chunks(g.max_tokens) + c;
}

// cg: past L1 (a window area peers wrote during this launch: a line this SM cached earlier, shared
// with a row that had not arrived then, must not be reused).
template <class V>
__device__ __forceinline__ V load_v(const V* p, bool cg) {
  static_assert(sizeof(V) == 16 || sizeof(V) == 1, "rows are copied in 16-byte vectors or bytes");
  if (!cg) return *p;
  if constexpr (sizeof(V) == 16) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    V r;
    memcpy(&r, &v, sizeof r);
    return r;
  } else {
    const unsigned char v = __ldcg(reinterpret_cast<const unsigned char*>(p));
    V r;
    memcpy(&r, &v, sizeof r);
    return r;
  }
}

// One row to every expert row in rows[0..K) that is >= 0: each chunk of the source is loaded once.
template <class V>
__device__ __forceinline__ void copy_fanout(const char* src, char* out, int64_t bytes, const int32_t* rows, int K,
                                            int lane, bool cg) {
  const V* s = reinterpret_cast<const V*>(src);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t v0 = lane; v0 < n; v0 += 32 * kFanoutUnroll) {
    V val[kFanoutUnroll];
#pragma unroll
    for (int u = 0; u < kFanoutUnroll; ++u)
      if (v0 + u * 32 < n) val[u] = load_v(s + v0 + u * 32, cg);
    for (int k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r < 0) continue;
      V* d = reinterpret_cast<V*>(out + r * bytes);
#pragma unroll
      for (int u = 0; u < kFanoutUnroll; ++u)
        if (v0 + u * 32 < n) d[v0 + u * 32] = val[u];
    }
  }
}

struct OverlapArgs {
  SendArgs send;
  ExpandArgs expand;
  int send_blocks;
};

// Senders: the phased send kernel's loop over tokens, remote destinations only, plus the arrival.
template <class V>
__device__ void send_role(const OverlapArgs& oa, int warp, int lane) {
  __shared__ int32_t slot_s[kWarps][kMaxR];
  const SendArgs& a = oa.send;
  const DeviceGroup& g = a.g;
  const int64_t nw = static_cast<int64_t>(oa.send_blocks) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < a.T; t += nw) {
    bool any = false;
    for (int d = 0; d < g.R; ++d) {
      const int32_t sl = d == g.rank ? -1 : a.token_slot[t * g.R + d];
      if (lane == 0) slot_s[warp][d] = sl;
      any = any || sl >= 0;
    }
    __syncwarp();
    if (!any) continue;
    const V* src = reinterpret_cast<const V*>(a.rows + t * a.row_bytes);
    const int64_t n = a.row_bytes / static_cast<int64_t>(sizeof(V));
    for (int64_t v0 = lane; v0 < n; v0 += 32 * kSendUnroll) {
      V val[kSendUnroll];
#pragma unroll
      for (int u = 0; u < kSendUnroll; ++u)
        if (v0 + u * 32 < n) val[u] = src[v0 + u * 32];
      for (int d = 0; d < g.R; ++d) {
        const int32_t sl = slot_s[warp][d];
        if (sl < 0) continue;
        V* dst = reinterpret_cast<V*>(out_row(g, d, sl, a.stride));
#pragma unroll
        for (int u = 0; u < kSendUnroll; ++u)
          if (v0 + u * 32 < n) dst[v0 + u * 32] = val[u];
      }
    }
    for (int d = 0; d < g.R; ++d) {
      const int32_t sl = slot_s[warp][d];
      if (sl < 0) continue;
      char* row = out_row(g, d, sl, a.stride);
      if (a.scale_bytes)
        for (int64_t b = lane; b < a.scale_bytes; b += 32) row[a.row_bytes + b] = a.scales[t * a.scale_bytes + b];
      if (lane < a.K) {
        const int32_t e = a.routed[t * a.K + lane];
        const bool here = e >= 0 && e / g.Le == d;
        RowMeta m;
        m.local_expert = here ? e % g.Le : -1;
        m.position = here ? a.pair_pos[t * a.K + lane] : 0;
        m.weight = here && a.weights ? static_cast<double>(a.weights[t * a.K + lane]) : 0.0;
        out_meta(g, d, sl)[lane] = m;
      }
    }
    // Every lane's stores of this token are ordered before lane 0's release (warp barrier).
    __syncwarp();
    if (lane == 0) {
      for (int d = 0; d < g.R; ++d) {
        const int32_t sl = slot_s[warp][d];
        if (sl >= 0) red_release_sys_add(arrival(g, d, g.rank, sl / kArrivalChunk), 1u);
      }
    }
    __syncwarp();
  }
}

// Waits (thread 0 of the block) until chunk c of source s holds `n` arrivals, then takes them.
// false: the wait gave up (recorded in the group status like a barrier timeout) or the group was
// already broken; the chunk's rows must not be read.
__device__ bool take_chunk(const DeviceGroup& g, int s, int c, uint32_t n) {
  __shared__ int ok_s;
  if (threadIdx.x == 0) {
    uint32_t* cnt = arrival(g, g.rank, s, c);
    int ok = g.status[7] == 0;
    if (ok) {
      const uint64_t start = global_ns();
      while (load_acquire_sys(cnt) < n) {
        if (global_ns() - start > g.timeout_ns) {
          atomicOr(reinterpret_cast<uint32_t*>(&g.status[s < 32 ? 5 : 6]), 1u << (s & 31));
          atomicCAS(reinterpret_cast<uint32_t*>(&g.status[7]), 0u, static_cast<uint32_t>(kOpDispatch));
          g.status[8] = static_cast<int32_t>(*g.epoch);
          ok = 0;
          break;
        }
        __nanosleep(32);
      }
    }
    if (ok) atomicSub(cnt, n);
    ok_s = ok;
  }
  __syncthreads();
  return ok_s != 0;
}

template <class V>
__device__ void expand_role(const OverlapArgs& oa, int xb, int xn, int warp, int lane) {
  __shared__ int32_t rows_s[kWarps][kMaxK];
  const ExpandArgs& a = oa.expand;
  const SendArgs& sa = oa.send;
  const DeviceGroup& g = a.g;
  const int R = g.R, K = a.K;
  const int32_t total_rows = a.offsets[g.Le];
  const bool write = static_cast<int64_t>(total_rows) <= g.recv_capacity;  // overflow: consume, write nothing

  // Padding rows of the local experts (zeros), spread over the expand warps.
  if (write) {
    for (int j = xb * kWarps + warp; j < g.Le; j += xn * kWarps) {
      for (int64_t r = a.offsets[j] + a.expert_rows[j]; r < a.offsets[j + 1]; ++r) {
        V* d = reinterpret_cast<V*>(a.out + r * a.row_bytes);
        for (int64_t v = lane; v < a.row_bytes / static_cast<int64_t>(sizeof(V)); v += 32) d[v] = V{};
        if (a.scale_bytes)
          for (int64_t b = lane; b < a.scale_bytes; b += 32) a.out_scales[r * a.scale_bytes + b] = 0;
        if (lane == 0 && a.out_weights) a.out_weights[r] = 0.0f;
      }
    }
  }

  int maxc = arrival_chunks(sa.T);
  for (int s = 0; s < R; ++s)
    if (s != g.rank) maxc = max(maxc, arrival_chunks(a.recv_tokens[s]));
  // Items (chunk c, source s): chunk-major, remote sources first, so blocks meet the chunks in the
  // order the senders produce them.
  for (int64_t it = xb; it < static_cast<int64_t>(maxc) * R; it += xn) {
    const int c = static_cast<int>(it / R);
    const int s = (g.rank + 1 + static_cast<int>(it % R)) % R;
    const bool local = s == g.rank;
    const int count = local ? sa.T : a.recv_tokens[s];
    const int first = c * kArrivalChunk;
    if (first >= count) continue;  // block-uniform
    const int n = min(kArrivalChunk, count - first);
    if (!local && !take_chunk(g, s, c, static_cast<uint32_t>(n))) continue;
    if (!write) continue;
    for (int i = warp; i < n; i += kWarps) {
      const int idx = first + i;  // local: a token; remote: a received slot
      int slot;
      const char* src;
      int32_t row = -1;
      if (local) {
        slot = sa.token_slot[static_cast<int64_t>(idx) * R + g.rank];
        if (slot < 0) continue;  // warp-uniform
        if (lane < K) {
          const int32_t e = sa.routed[static_cast<int64_t>(idx) * K + lane];
          if (e >= 0 && e / g.Le == g.rank) {
            row = a.segment_starts[(e % g.Le) * R + s] + sa.pair_pos[static_cast<int64_t>(idx) * K + lane];
            if (a.out_weights) a.out_weights[row] = sa.weights ? sa.weights[static_cast<int64_t>(idx) * K + lane] : 0.0f;
          }
        }
        src = sa.rows + static_cast<int64_t>(idx) * sa.row_bytes;
      } else {
        slot = idx;
        if (lane < K) {
          const int4 raw = __ldcg(reinterpret_cast<const int4*>(in_meta(g, s, slot) + lane));
          RowMeta m;
          static_assert(sizeof(RowMeta) == sizeof(int4), "RowMeta is read as one 16-byte vector");
          memcpy(&m, &raw, sizeof m);
          if (m.local_expert >= 0 && m.local_expert < g.Le) {
            row = a.segment_starts[m.local_expert * R + s] + m.position;
            if (row < 0 || row >= total_rows) row = -1;  // a corrupt slot never writes out of bounds
            else if (a.out_weights) a.out_weights[row] = static_cast<float>(m.weight);
          }
        }
        src = in_row(g, s, slot, a.stride);
      }
      if (lane < K) a.recv_row[(static_cast<int64_t>(s) * g.max_tokens + slot) * K + lane] = row;
      rows_s[warp][lane] = lane < K ? row : -1;
      __syncwarp();
      copy_fanout<V>(src, a.out, a.row_bytes, rows_s[warp], K, lane, !local);
      if (a.scale_bytes) {
        const char* ss = local ? sa.scales + static_cast<int64_t>(idx) * sa.scale_bytes : src + a.row_bytes;
        for (int k = 0; k < K; ++k) {
          const int32_t r = rows_s[warp][k];
          if (r < 0) continue;
          for (int64_t b = lane; b < a.scale_bytes; b += 32)
            a.out_scales[r * a.scale_bytes + b] = static_cast<char>(load_v(reinterpret_cast<const uint8_t*>(ss) + b, !local));
        }
      }
      __syncwarp();
    }
  }
}

template <class V>
__global__ void __launch_bounds__(kThreads) dispatch_overlap_kernel(const __grid_constant__ OverlapArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (static_cast<int>(blockIdx.x) < a.send_blocks) send_role<V>(a, warp, lane);
  else expand_role<V>(a, blockIdx.x - a.send_blocks, gridDim.x - a.send_blocks, warp, lane);
}

template <class V>
int resident_blocks() {
  static const int n = [] {
    int per_sm = 0;
    EPX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dispatch_overlap_kernel<V>, kThreads, 0));
    return per_sm * cuda::sm_count();
  }();
  return n;
}

}  // namespace

bool overlapped_dispatch_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("EPX_DISPATCH_KERNEL");
    return v == nullptr || std::strcmp(v, "phased") != 0;
  }();
  return on;
}

bool launch_overlapped_dispatch(const SendArgs& sa, const ExpandArgs& ea, bool vec, cudaStream_t stream) {
  const DeviceGroup& g = sa.g;
  if (g.R > kMaxR || sa.K > kMaxK || ea.K != sa.K) return false;
  const int cap = vec ? resident_blocks<uint4>() : resident_blocks<uint8_t>();
  const int send = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((sa.T + kWarps - 1) / kWarps, g.send_blocks)));
  // Enough expand blocks for every chunk of the largest batch, at most two per SM.
  const int64_t items = static_cast<int64_t>(g.R) * arrival_chunks(g.max_tokens);
  const int expand = static_cast<int>(std::min<int64_t>({items, 2LL * cuda::sm_count(), cap - send}));
  if (expand < 1) return false;  // the grid could not be resident: the phased path
  OverlapArgs a{sa, ea, send};
  if (vec) dispatch_overlap_kernel<uint4><<<send + expand, kThreads, 0, stream>>>(a);
  else dispatch_overlap_kernel<uint8_t><<<send + expand, kThreads, 0, stream>>>(a);
  EPX_CHECK_LAUNCH("dispatch_overlap_kernel");
  return true;
}

}  // namespace epx::comm::ep_device
