// Device-side pieces shared by the EP kernels (ep_kernels.cu) and the overlapped zero-copy dispatch
// (dispatch_overlap.cu): launch geometry, where each rank's mailboxes and receive area are, and the
// arguments of the row-sending and row-expanding phases. Included by CUDA sources only.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_cuda.cuh"
#include "cuda/common/row_reduce.cuh"

#include "comm/ep_kernels.h"
#include "comm/row_pieces.h"
#include "comm/signal.cuh"

namespace epx::comm::ep_device {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A partial's loads in flight per lane: kReduceRows rows x kReduceUnroll vectors. Measured (combine,
// T=4096, H=7168, 2 x H200, 3 blocks per SM at <= 80 registers): 1x2 (rows one at a time) 297 us,
// 1x3 274, 1x4 258, 2x2 258, 2x3 299, 3x2 282, 4x1 434, 4x2 383; with 2 blocks per SM (no spills)
// 2x2 303, 4x2 363, 1x4 283. T=128: 2x2 43.6 against 50.8 us for 1x2.
constexpr int kReduceUnroll = 2;
constexpr int kReduceRows = 2;
// The combine's reduce warps load 4 rows x kReduceUnroll vectors per lane for bf16 rows, with and without
// an SM budget (EPX_COMBINE_LOADS; combine_overlap.cu has the measurements): few SMs move bytes at the rate
// of the loads each keeps in flight, and all of them move more with more in flight.
constexpr int kWideReduceRows = 4;
constexpr int kSendUnroll = 8;
constexpr int kSumUnroll = 4;
constexpr int kFanoutUnroll = 8;
constexpr int kMaxK = 32;
constexpr int kMaxR = 64;

// The signal area (inboxes, arrival counters, ticket, item counter): core/window_layout.h.

__host__ __device__ inline SignalArgs signal_of(const DeviceGroup& g) {
  return SignalArgs{g.peer_inbox, g.my_inbox, g.epoch, g.status, g.rank, g.R, g.timeout_ns, g.signal_mode};
}

__device__ __forceinline__ void red_release_sys_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Arrival counter of chunk c of the slots source `src` writes into rank `dst`'s window.
__device__ __forceinline__ uint32_t* arrival(const DeviceGroup& g, int dst, int src, int c) {
  char* base = dst == g.rank ? reinterpret_cast<char*>(g.my_inbox) : reinterpret_cast<char*>(g.peer_inbox[dst]);
  return reinterpret_cast<uint32_t*>(base + inbox_bytes(g.R)) + static_cast<int64_t>(src) * arrival_chunks(g.max_tokens) + c;
}

// Waits until this rank's arrival counter of chunk c of source s says its first n slots are complete
// (n x kArrivalUnit; the group's timeout; a wait that gives up names s in the status words as
// at a barrier). false: it gave up, or the group was already broken; the chunk must not be read.
__device__ __forceinline__ bool wait_arrivals(const DeviceGroup& g, int s, int c, uint32_t n, int op_code) {
  if (g.status[7] != 0) return false;
  const uint32_t want = n * kArrivalUnit;
  if (wait_for_word(arrival(g, g.rank, s, c), g.timeout_ns, 32, [want](uint32_t v) { return v >= want; })) return true;
  record_missing_peer(g.status, s, op_code, *g.epoch);
  return false;
}

__device__ __forceinline__ uint32_t* done_ticket(const DeviceGroup& g) {
  return reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(g.my_inbox) + inbox_bytes(g.R) +
                                     arrival_bytes(g.R, g.max_tokens));
}

// The items of this rank's overlapped combine handed out so far past each warp's first (zero between
// launches: the last block resets it).
__device__ __forceinline__ uint32_t* work_counter(const DeviceGroup& g) { return done_ticket(g) + 1; }

// The prepares of this group so far (zero-copy; its parity picks the header copy).
__device__ __forceinline__ uint32_t* prepare_count(const DeviceGroup& g) { return done_ticket(g) + 2; }

// ---- the op's opening barrier inside the overlapped launch (default; not EPX_EP_BARRIER=launch)

// Instead of a barrier launch before the op, one launch less: block 0 signals every peer that this
// rank is at op `next` (its previous op has ended, so it no longer reads what peers wrote for it),
// and each writer waits, before its first store into peer p's window, until p has signalled `next`
// too (a rank waits only for the peers it writes to; each of those waits for it in turn before
// writing back). The last block of the launch to finish counts the op into the epoch. Every block
// reads the epoch at its start, before that.
// The signal is a relaxed store: it carries no data, and what a peer's writes after it must not
// overtake is this rank's previous op, whose grid has completed before this one began (stream order,
// or the wait of a dependent launch): its reads have returned and its writes to this rank's memory
// (the counters' reset) are at this GPU's L2, where the peer's stores and atomics land. A fence and
// a release store (EPX_EP_SIGNAL=fence, as before) cost block 0 ~2 us at the start of every op; at
// T=128 on 2 x H200 the dispatch took 16.5-16.9 us with the relaxed store against 18.4-19.1.
__device__ __forceinline__ uint32_t inline_barrier_begin(const DeviceGroup& g) {
  __shared__ uint32_t next_s;
  if (threadIdx.x == 0) {
    next_s = *g.epoch + 1;
    if (blockIdx.x == 0) {
      if (g.signal_mode == kSignalFence) __threadfence_system();
      for (int p = 0; p < g.R; ++p) {
        if (p == g.rank) continue;
        uint32_t* inbox = g.peer_inbox[p] + g.rank;
        if (g.signal_mode == kSignalRelaxed) store_relaxed_sys(inbox, next_s);
        else store_release_sys(inbox, next_s);
      }
    }
  }
  __syncthreads();
  return next_s;
}

// Lane 0 of a writer warp, before its first store into peer p's window: waits (the group's timeout)
// until p has signalled op `next`; `ready` holds the peers already seen. A wait that gives up names
// p in the status words, as at a barrier; a broken group does not wait.
__device__ __forceinline__ void wait_peer_ready(const DeviceGroup& g, int p, uint32_t next, uint64_t& ready,
                                                int op_code) {
  if (p == g.rank || (ready >> p & 1u)) return;
  ready |= uint64_t{1} << p;
  if (g.status[7] == 0) wait_for_peer(signal_of(g), p, next, op_code);
}

// ---- mailboxes and the receive area ----------------------------------------------------------

// Slot `slot` of the rows this rank writes for peer p.
__device__ __forceinline__ char* out_row(const DeviceGroup& g, int p, int64_t slot, int64_t stride) {
  return g.out[p] + slot * stride;
}
// The max_topk metadata entries of slot `slot` this rank writes for peer p.
__device__ __forceinline__ RowMeta* out_meta(const DeviceGroup& g, int p, int64_t slot) {
  return reinterpret_cast<RowMeta*>(g.out[g.R + p]) + slot * g.max_topk;
}
__device__ __forceinline__ int32_t* out_header(const DeviceGroup& g, int p) {
  return reinterpret_cast<int32_t*>(g.out[2 * g.R + p]);
}
// Slot `slot` of the rows source s sent to this rank.
__device__ __forceinline__ const char* in_row(const DeviceGroup& g, int s, int64_t slot, int64_t stride) {
  return g.my_window + g.layout.row_offset(s, 0) + slot * stride;
}
__device__ __forceinline__ const RowMeta* in_meta(const DeviceGroup& g, int s, int64_t slot) {
  return reinterpret_cast<const RowMeta*>(g.my_window + g.layout.meta_offset(s, 0)) + slot * g.max_topk;
}

struct SendArgs {
  DeviceGroup g;
  int T, K;
  const int32_t* routed;      // [T, K]
  const int32_t* pair_pos;    // [T, K]
  const int32_t* token_slot;  // [T, R]
  const char* rows;           // [T, row_bytes]
  int64_t row_bytes;
  const char* scales;         // [T, scale_bytes] or null
  int64_t scale_bytes;
  const float* weights;       // [T, K] or null
  bool with_meta;             // dispatch writes the routing meta; combine_backward's spread does not
  int op_code;                // what a timeout names: kOpDispatch, or kOpCombineBwd on the dispatch's path
  int64_t stride;             // bytes per mailbox slot (>= row_bytes + scale_bytes, multiple of 16)
};

struct ExpandArgs {
  DeviceGroup g;
  int K;
  const int32_t* recv_tokens;     // [R]
  const int32_t* segment_starts;  // [Le, R]
  const int32_t* offsets;         // [Le + 1]
  const int32_t* expert_rows;     // [Le]
  int32_t* recv_row;              // [R, max_tokens, K]
  char* out;                      // [rows, row_bytes]
  int64_t row_bytes;
  char* out_scales;               // [rows, scale_bytes] or null
  int64_t scale_bytes;
  float* out_weights;             // [rows] or null
  int64_t stride;                 // bytes per received slot
};


using cuda::Pack;
using cuda::pack_float;

struct ReduceArgs {
  DeviceGroup g;
  int T, K;
  int64_t H;
  const int32_t* recv_tokens;    // [R]
  const int32_t* recv_row;       // [R, max_tokens, K]
  const void* rows_in;           // [rows, H]
  const float* row_weights;      // or null
  const float* row_scalars;      // dispatch_backward: d_recv_weights, or null
  const int32_t* token_slot;     // [T, R]
  const int32_t* routed;         // [T, K]
  void* out;                     // [T, H]
  float* d_topk_weights;         // [T, K] or null
  int64_t stride;                // bytes per mailbox slot
  const int32_t* send_tokens;    // [R] (the overlapped combine: partials each rank sends back)
  int op_code;                   // kOpCombine or kOpDispatchBwd: what a timeout names
  int max_pieces = 1;            // the overlapped combine: warps a row may be split over
  int min_pieces = 1;            // the overlapped combine: warps each partial is split over at least
  bool claim_items = false;      // the overlapped combine: partial items claimed from work_counter
  int tail_chunks = 0;           // the overlapped combine: the partials of the last this many chunk
  int tail_pieces = 1;           //   indices split over at least tail_pieces warps
  int sum_min_pieces = 1;        // the overlapped combine: warps each token's sum is split over at least
  bool inline_barrier = false;   // the overlapped combine: the op's opening barrier is in its launch
};

// cg: a load past L1, for window areas peers write during the same launch (a line this SM cached
// earlier, shared with a row that had not arrived then, must not be reused).
template <class P>
__device__ __forceinline__ P load_pack(const P* p, bool cg) {
  if (!cg) return *p;
  P r;
  if constexpr (sizeof(P) == 16) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    memcpy(&r, &v, sizeof r);
  } else if constexpr (sizeof(P) == 8) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p));
    memcpy(&r, &v, sizeof r);
  } else if constexpr (sizeof(P) == 4) {
    const unsigned v = __ldcg(reinterpret_cast<const unsigned*>(p));
    memcpy(&r, &v, sizeof r);
  } else if constexpr (sizeof(P) == 2) {
    const unsigned short v = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&r, &v, sizeof r);
  } else {
    static_assert(sizeof(P) == 1, "loads of 1, 2, 4, 8 or 16 bytes");
    const unsigned char v = __ldcg(reinterpret_cast<const unsigned char*>(p));
    memcpy(&r, &v, sizeof r);
  }
  return r;
}

// ---- dispatch: rows out, rows expanded ----------------------------------------------------------

// Vectors r of one row to every expert row in rows[0..K) that is >= 0: each piece of the source is
// loaded once (kUnroll vectors per lane in flight), then stored to all of them.
template <class V, int kUnroll = kFanoutUnroll>
__device__ __forceinline__ void copy_fanout(const char* src, char* out, int64_t bytes, const int32_t* rows, int K,
                                            int lane, bool cg, VecRange r) {
  const V* s = reinterpret_cast<const V*>(src);
  const int64_t n = r.end;
  for (int64_t v0 = r.begin + lane; v0 < n; v0 += 32 * kUnroll) {
    V val[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < n) val[u] = load_pack(s + v0 + u * 32, cg);
    for (int k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r < 0) continue;
      V* d = reinterpret_cast<V*>(out + r * bytes);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * 32 < n) d[v0 + u * 32] = val[u];
    }
  }
}

// The whole row.
template <class V, int kUnroll = kFanoutUnroll>
__device__ __forceinline__ void copy_fanout(const char* src, char* out, int64_t bytes, const int32_t* rows, int K,
                                            int lane, bool cg) {
  copy_fanout<V, kUnroll>(src, out, bytes, rows, K, lane, cg, VecRange{0, bytes / static_cast<int64_t>(sizeof(V))});
}

// Whether both addresses and the length are multiples of `n` bytes.
__device__ __forceinline__ bool all_aligned(const void* a, const void* b, int64_t bytes, unsigned n) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | static_cast<uint64_t>(bytes);
  return (bits & (n - 1u)) == 0;
}

// A short row (the block scales beside an fp8 row: 224 bytes at H = 7168) to every expert row:
// byte copies made it 7 loads and 7 x K stores per lane, about as many instructions as the row
// itself; with 16-byte vectors it is one load and K stores on 14 lanes. One vector per lane at a
// time: the row fits in one pass, and deeper unrolling would only cost registers.
__device__ __forceinline__ void copy_fanout_short(const char* src, char* out, int64_t bytes, const int32_t* rows,
                                                  int K, int lane, bool cg) {
  if (all_aligned(src, out, bytes, 16)) copy_fanout<uint4, 1>(src, out, bytes, rows, K, lane, cg);
  else copy_fanout<uint8_t, 1>(src, out, bytes, rows, K, lane, cg);
}

// `bytes` from src to dst by one warp, in 4-byte words where the addresses and length allow (the
// scales a sender puts beside its row in a peer's slot: 2 stores per lane instead of 7 at 224
// bytes; 16-byte vectors would need registers the sender does not have without spilling).
template <class V>
__device__ __forceinline__ void copy_short_vec(char* dst, const char* src, int64_t bytes, int lane) {
  for (int64_t v = lane; v < bytes / static_cast<int64_t>(sizeof(V)); v += 32)
    reinterpret_cast<V*>(dst)[v] = reinterpret_cast<const V*>(src)[v];
}
__device__ __forceinline__ void copy_short(char* dst, const char* src, int64_t bytes, int lane) {
  if (all_aligned(dst, src, bytes, 4)) copy_short_vec<uint32_t>(dst, src, bytes, lane);
  else copy_short_vec<uint8_t>(dst, src, bytes, lane);
}

// Token t's row, its scales and (with_meta) its routing meta into the mailbox slot of every
// destination with slots[d] >= 0 (one warp; the row is loaded once for all of them). Ends with a
// warp barrier, so every lane's stores are ordered before what lane 0 does next.
template <class V>
__device__ __forceinline__ void send_token(const SendArgs& a, int64_t t, int lane, const int32_t* slots) {
  const DeviceGroup& g = a.g;
  const V* src = reinterpret_cast<const V*>(a.rows + t * a.row_bytes);
  const int64_t n = a.row_bytes / static_cast<int64_t>(sizeof(V));
  // kSendUnroll loads per lane in flight before the stores go out (NVLink stores from few SMs need
  // many bytes outstanding).
  for (int64_t v0 = lane; v0 < n; v0 += 32 * kSendUnroll) {
    V val[kSendUnroll];
#pragma unroll
    for (int u = 0; u < kSendUnroll; ++u)
      if (v0 + u * 32 < n) val[u] = src[v0 + u * 32];
    for (int d = 0; d < g.R; ++d) {
      const int32_t sl = slots[d];
      if (sl < 0) continue;
      V* dst = reinterpret_cast<V*>(out_row(g, d, sl, a.stride));
#pragma unroll
      for (int u = 0; u < kSendUnroll; ++u)
        if (v0 + u * 32 < n) dst[v0 + u * 32] = val[u];
    }
  }
  for (int d = 0; d < g.R; ++d) {
    const int32_t sl = slots[d];
    if (sl < 0) continue;
    char* row = out_row(g, d, sl, a.stride);
    if (a.scale_bytes) copy_short(row + a.row_bytes, a.scales + t * a.scale_bytes, a.scale_bytes, lane);
    if (a.with_meta && lane < a.K) {
      const int32_t e = a.routed[t * a.K + lane];
      const bool here = e >= 0 && e / g.Le == d;
      RowMeta m;
      m.local_expert = here ? e % g.Le : -1;
      m.position = here ? a.pair_pos[t * a.K + lane] : 0;
      m.weight = here && a.weights ? static_cast<double>(a.weights[t * a.K + lane]) : 0.0;
      out_meta(g, d, sl)[lane] = m;
    }
  }
  __syncwarp();
}

// Received slot `slot` of source s into every expert row it feeds (one warp), vectors r of the row:
// its meta gives the rows (recv_row, for combine) and weights; a meta naming no valid row writes
// nothing. The piece that starts the row (lead) also writes recv_row, the weights and the scales.
// rows_s: the warp's shared scratch. cg: the slot arrived during this launch.
template <class V>
__device__ __forceinline__ void expand_received_slot(const ExpandArgs& a, int s, int slot, int lane, int32_t* rows_s,
                                                     bool cg, VecRange r, bool lead) {
  const DeviceGroup& g = a.g;
  const int K = a.K;
  int32_t row = -1;
  if (lane < K) {
    const RowMeta m = load_pack(in_meta(g, s, slot) + lane, cg);
    if (m.local_expert >= 0 && m.local_expert < g.Le) {
      row = a.segment_starts[m.local_expert * g.R + s] + m.position;
      if (row < 0 || row >= a.offsets[g.Le]) row = -1;  // a corrupt slot never writes out of bounds
      else if (a.out_weights && lead) a.out_weights[row] = static_cast<float>(m.weight);
    }
    if (lead) a.recv_row[(static_cast<int64_t>(s) * g.max_tokens + slot) * K + lane] = row;
  }
  rows_s[lane] = lane < K ? row : -1;
  __syncwarp();
  const char* src = in_row(g, s, slot, a.stride);
  copy_fanout<V>(src, a.out, a.row_bytes, rows_s, K, lane, cg, r);
  if (a.scale_bytes && lead) copy_fanout_short(src + a.row_bytes, a.out_scales, a.scale_bytes, rows_s, K, lane, cg);
  __syncwarp();
}

// The whole slot (one warp).
template <class V>
__device__ __forceinline__ void expand_received_slot(const ExpandArgs& a, int s, int slot, int lane, int32_t* rows_s,
                                                     bool cg) {
  expand_received_slot<V>(a, s, slot, lane, rows_s, cg, VecRange{0, a.row_bytes / static_cast<int64_t>(sizeof(V))},
                          true);
}

// The padding rows of local expert j (zeros, weight 0), one warp.
template <class V>
__device__ __forceinline__ void zero_padding_rows(const ExpandArgs& a, int j, int lane) {
  for (int64_t r = a.offsets[j] + a.expert_rows[j]; r < a.offsets[j + 1]; ++r) {
    V* d = reinterpret_cast<V*>(a.out + r * a.row_bytes);
    for (int64_t v = lane; v < a.row_bytes / static_cast<int64_t>(sizeof(V)); v += 32) d[v] = V{};
    if (a.scale_bytes)
      for (int64_t b = lane; b < a.scale_bytes; b += 32) a.out_scales[r * a.scale_bytes + b] = 0;
    if (lane == 0 && a.out_weights) a.out_weights[r] = 0.0f;
  }
}

// ---- combine: partials out, partials summed -----------------------------------------------------

// The expert-side partial of received slot `slot` of source s (one warp), vectors r of it: sum over
// its K rows in slot order of weight x row, into the source's mailbox; the piece that starts the row
// puts dispatch_backward's row-weight gradients into the slot's meta. rows_s / w_s: the warp's
// shared scratch.
template <class T, int N, int kRows = kReduceRows, int kUnroll = kReduceUnroll>
__device__ __forceinline__ void reduce_partial(const ReduceArgs& a, int s, int slot, int lane, int32_t* rows_s,
                                               float* w_s, VecRange r) {
  using P = Pack<T, N>;
  const DeviceGroup& g = a.g;
  const int64_t nvec = a.H / N;
  int32_t row = -1;
  float w = 1.0f;
  if (lane < a.K) {
    row = a.recv_row[(static_cast<int64_t>(s) * g.max_tokens + slot) * a.K + lane];
    if (row >= 0 && a.row_weights) w = a.row_weights[row];
    if (row >= 0 && a.row_scalars && r.begin == 0)
      out_meta(g, s, slot)[lane].weight = static_cast<double>(a.row_scalars[row]);
  }
  // The slots' rows that live here, compacted in slot order (the others add nothing).
  const int n = cuda::compact_rows(row, w, a.K, lane, rows_s, w_s);
  // kUnroll vectors per lane of kRows rows at a time (kReduceUnroll x kReduceRows unless the caller
  // asks otherwise): all their loads are issued before the first add (the loop is load-latency bound
  // otherwise).
  cuda::weighted_row_sum<kRows, kUnroll>(static_cast<const P*>(a.rows_in), nvec, rows_s, w_s, n,
                                         a.row_weights != nullptr, reinterpret_cast<P*>(out_row(g, s, slot, a.stride)),
                                         r.begin, r.end, lane);
  __syncwarp();
}

// The source-side sum of token t (one warp), vectors r of it: out[t] = 0 + the partials of ranks 0,
// 1, ... that hold its experts (slots[d] >= 0); the piece that starts the row also writes the
// token's top-k weight gradients from the partials' meta.
template <class T, int N>
__device__ __forceinline__ void sum_partials(const ReduceArgs& a, int64_t t, int lane, const int32_t* slots, bool cg,
                                             VecRange r) {
  using P = Pack<T, N>;
  const DeviceGroup& g = a.g;
  const int64_t nvec = a.H / N;
  if (a.d_topk_weights && lane < a.K && r.begin == 0) {
    const int32_t e = a.routed[t * a.K + lane];
    float v = 0.0f;
    if (e >= 0) {
      const int d = e / g.Le;
      const double* wp = &in_meta(g, d, slots[d])[lane].weight;
      v = static_cast<float>(cg ? __ldcg(wp) : *wp);
    }
    a.d_topk_weights[t * a.K + lane] = v;
  }
  P* out = static_cast<P*>(a.out) + t * nvec;
  // kSumUnroll vectors per lane at a time, R x kSumUnroll loads in flight; per element the ranks
  // still add in order.
  for (int64_t v0 = r.begin + lane; v0 < r.end; v0 += 32 * kSumUnroll) {
    float acc[kSumUnroll][N];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
      for (int i = 0; i < N; ++i) acc[u][i] = 0.0f;
    for (int d = 0; d < g.R; ++d) {
      const int32_t sl = slots[d];
      if (sl < 0) continue;
      const P* src = reinterpret_cast<const P*>(in_row(g, d, sl, a.stride));
      P p[kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        if (v0 + u * 32 < r.end) p[u] = load_pack(src + v0 + u * 32, cg);
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
        for (int i = 0; i < N; ++i) acc[u][i] += pack_float(p[u], i);
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      if (v0 + u * 32 >= r.end) continue;
      P o;
#pragma unroll
      for (int i = 0; i < N; ++i) o.v[i] = cuda::from_float<T>(acc[u][i]);
      out[v0 + u * 32] = o;
    }
  }
  __syncwarp();
}

/// A launch-shape knob of the overlapped kernels from the environment (a positive integer), else `dflt`.
int overlap_knob(const char* name, int dflt);
/// Whether the environment variable `name` asks for the phased kernels ("phased").
bool env_asks_phased(const char* name);

/// Blocks of `Kernel` (`threads` threads, no dynamic shared memory) the GPU holds at once: the most
/// an overlapped launch may use, since its blocks wait on other ranks' blocks. Computed once.
template <auto Kernel>
int resident_blocks(int threads) {
  static const int n = [threads] {
    int per_sm = 0;
    EPX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, 0));
    return per_sm * cuda::sm_count();
  }();
  return n;
}

/// Warps per block of the overlapped kernels: kWarps without an SM budget (several blocks per SM);
/// under one (GroupConfig::num_sms, one block per SM) as many warps as the default holds per SM, so
/// a budgeted SM keeps as many loads in flight: dispatch 16 (its default runs one 8-warp block per
/// SM, 16 is within its registers), combine 24 (three 8-warp blocks per SM by default).
constexpr int kBudgetDispatchWarps = 16;
constexpr int kBudgetCombineWarps = 24;
/// The phased kernels (ep_kernels.cu) under a budget: 16 warps a block, within every one's registers
/// without spills (up to 112 at 8 warps); combine_backward's spread (at most 64 registers) takes 32,
/// about the 4-5 blocks of 8 warps it keeps resident per SM without a budget.
constexpr int kBudgetPhasedWarps = 16;
constexpr int kBudgetSpreadWarps = 32;

/// The overlapped zero-copy combine and dispatch_backward (combine_overlap.cu), EPX_COMBINE_KERNEL=phased
/// turns it off; launched after the before-write barrier, or holding it (inline_barrier, as the
/// dispatch below), false (nothing launched) as above.
bool overlapped_combine_enabled();
bool launch_overlapped_combine(const ReduceArgs& a, DType dtype, bool vec, bool inline_barrier, cudaStream_t stream);

/// The overlapped zero-copy dispatch (dispatch_overlap.cu): EPX_DISPATCH_KERNEL=phased turns it off.
bool overlapped_dispatch_enabled();
/// Launches it after the before-write barrier; false (nothing launched) where the grid could not be
/// resident at once or the shape is outside its limits, then the caller runs the phased path.
/// inline_barrier: the launch holds the op's opening barrier (inline_barrier_begin), so the caller
/// must not have run one.
bool launch_overlapped_dispatch(const SendArgs& sa, const ExpandArgs& ea, bool vec, bool inline_barrier,
                                cudaStream_t stream);
/// Whether the overlapped launches hold their op's opening barrier (the default; EPX_EP_BARRIER=launch
/// puts it in a launch of its own before them).
bool inline_barrier_enabled();

}  // namespace epx::comm::ep_device
