// The zero-copy dispatch in one launch, the expansion overlapping the transfer.
//
// The phased dispatch (ep_kernels.cu) is  barrier -> send every row -> barrier -> expand, so the
// receiver's expansion into the expert-major layout (K / R rows written per received row: the
// larger part of dispatch's HBM traffic) starts only when the last row has crossed the link. Here
// the first blocks of the grid send and the others expand, in the same launch:
//  - a send warp writes its token's row, scales and routing meta into each remote destination's
//    window, then bumps the destination's arrival counter of that slot's chunk (kArrivalChunk slots
//    of one source) by kArrivalUnit with a system-scope release;
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
#include "comm/ep_timeline.cuh"
#include "cuda/common/cuda_check.h"

namespace epx::comm::ep_device {
namespace {

EPX_TIMELINE_BUFFER()


struct OverlapArgs {
  SendArgs send;
  ExpandArgs expand;
  int send_blocks;
  int expand_pieces;    // > 1: a chunk's rows may be split over up to this many expand blocks (below)
  bool inline_barrier;  // the op's opening barrier is in this launch (inline_barrier_begin)
};

// Senders: the phased send kernel's loop over tokens, remote destinations only, plus the arrival.
template <class V, int W>
__device__ void send_role(const OverlapArgs& oa, int warp, int lane, uint32_t next) {
  __shared__ int32_t slot_s[W][kMaxR];
  const SendArgs& a = oa.send;
  const DeviceGroup& g = a.g;
  const int64_t nw = static_cast<int64_t>(oa.send_blocks) * W;
  uint64_t ready = 0;  // lane 0: the peers known to have reached this op (inline barrier)
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * W + warp; t < a.T; t += nw) {
    bool any = false;
    for (int d = 0; d < g.R; ++d) {
      const int32_t sl = d == g.rank ? -1 : a.token_slot[t * g.R + d];
      if (lane == 0) slot_s[warp][d] = sl;
      any = any || sl >= 0;
    }
    __syncwarp();
    if (!any) continue;
    if (oa.inline_barrier) {
      if (lane == 0)
        for (int d = 0; d < g.R; ++d)
          if (slot_s[warp][d] >= 0) wait_peer_ready(g, d, next, ready, kOpDispatch);
      __syncwarp();  // lane 0's acquire before every lane's stores
    }
    if (t == static_cast<int64_t>(blockIdx.x) * W) EPX_STAMP(kTlFirst);
    send_token<V>(a, t, lane, slot_s[warp]);
    // Every lane's stores of this token are ordered before lane 0's release (send_token ends with a
    // warp barrier).
    if (lane == 0) {
      for (int d = 0; d < g.R; ++d) {
        const int32_t sl = slot_s[warp][d];
        if (sl >= 0) red_release_sys_add(arrival(g, d, g.rank, sl / kArrivalChunk), kArrivalUnit);
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
    const bool ok = wait_arrivals(g, s, c, n, kOpDispatch);
    if (ok) atomicSub(arrival(g, g.rank, s, c), n * kArrivalUnit);
    ok_s = ok;
  }
  __syncthreads();
  return ok_s != 0;
}

// The same wait without taking the arrivals, for chunks several blocks expand (each a piece of the
// rows): the counters are zeroed by the last block of the grid instead.
__device__ bool wait_chunk(const DeviceGroup& g, int s, int c, uint32_t n) {
  __shared__ int ok_s;
  if (threadIdx.x == 0) ok_s = wait_arrivals(g, s, c, n, kOpDispatch);
  __syncthreads();
  return ok_s != 0;
}

// Token t of this rank, routed here (its slot to itself), expanded straight from x: the same meta
// and expert rows as a received slot, without the trip through the window. Vectors r of the row; the
// piece that starts it (lead) also writes recv_row, the weights and the scales.
template <class V>
__device__ __forceinline__ void expand_own_token(const OverlapArgs& oa, int64_t t, int lane, int32_t* rows_s,
                                                 VecRange r, bool lead) {
  const ExpandArgs& a = oa.expand;
  const SendArgs& sa = oa.send;
  const DeviceGroup& g = a.g;
  const int K = a.K, me = g.rank;
  const int32_t slot = sa.token_slot[t * g.R + me];
  if (slot < 0) return;  // warp-uniform
  int32_t row = -1;
  if (lane < K) {
    const int32_t e = sa.routed[t * K + lane];
    if (e >= 0 && e / g.Le == me) {
      row = a.segment_starts[(e % g.Le) * g.R + me] + sa.pair_pos[t * K + lane];
      if (a.out_weights && lead) a.out_weights[row] = sa.weights ? sa.weights[t * K + lane] : 0.0f;
    }
    if (lead) a.recv_row[(static_cast<int64_t>(me) * g.max_tokens + slot) * K + lane] = row;
  }
  rows_s[lane] = lane < K ? row : -1;
  __syncwarp();
  copy_fanout<V>(sa.rows + t * sa.row_bytes, a.out, a.row_bytes, rows_s, K, lane, false, r);
  if (a.scale_bytes && lead)
    copy_fanout<uint8_t>(sa.scales + t * sa.scale_bytes, a.out_scales, a.scale_bytes, rows_s, K, lane, false);
  __syncwarp();
}

// kShared: chunks may be split over several blocks (OverlapArgs::expand_pieces > 1), a kernel of its
// own so that the default one keeps its registers.
template <class V, int W, bool kShared>
__device__ void expand_role(const OverlapArgs& oa, int xb, int xn, int warp, int lane) {
  __shared__ int32_t rows_s[W][kMaxK];
  const ExpandArgs& a = oa.expand;
  const SendArgs& sa = oa.send;
  const DeviceGroup& g = a.g;
  const int R = g.R;
  const int32_t total_rows = a.offsets[g.Le];
  const bool write = static_cast<int64_t>(total_rows) <= g.recv_capacity;  // overflow: consume, write nothing

  // Padding rows of the local experts (zeros), spread over the expand warps.
  if (write)
    for (int j = xb * W + warp; j < g.Le; j += xn * W) zero_padding_rows<V>(a, j, lane);

  int maxc = arrival_chunks(sa.T);
  int64_t slots = sa.T;
  for (int s = 0; s < R; ++s)
    if (s != g.rank) {
      maxc = max(maxc, arrival_chunks(a.recv_tokens[s]));
      slots += a.recv_tokens[s];
    }
  // With EPX_DISPATCH_EXPAND_PIECES > 1 and few rows (decode), the rows of a chunk are split over up
  // to that many blocks by ranges of their vectors, as the combine splits its rows: one warp per
  // row leaves most expand blocks idle and each row one long chain of loads and stores.
  const int64_t nvec = a.row_bytes / static_cast<int64_t>(sizeof(V));
  const int P = kShared ? pieces_for(slots, static_cast<int64_t>(xn) * W, nvec, oa.expand_pieces) : 1;
  // Items (chunk c, source s, piece): chunk-major, remote sources first, so blocks meet the chunks
  // in the order the senders produce them.
  for (int64_t it = xb; it < static_cast<int64_t>(maxc) * R * P; it += xn) {
    const int piece = static_cast<int>(it % P);
    const int64_t item = it / P;
    const int c = static_cast<int>(item / R);
    const int s = (g.rank + 1 + static_cast<int>(item % R)) % R;
    const bool local = s == g.rank;
    const int count = local ? sa.T : a.recv_tokens[s];
    const int first = c * kArrivalChunk;
    if (first >= count) continue;  // block-uniform
    const int n = min(kArrivalChunk, count - first);
    if (!local && !(kShared ? wait_chunk(g, s, c, static_cast<uint32_t>(n))
                            : take_chunk(g, s, c, static_cast<uint32_t>(n))))
      continue;
    if (it == xb) EPX_STAMP(kTlFirst);
    if (!write) continue;
    const VecRange r = piece_range(nvec, P, piece);
    for (int i = warp; i < n; i += W) {
      if (local) expand_own_token<V>(oa, first + i, lane, rows_s[warp], r, piece == 0);
      else expand_received_slot<V>(a, s, first + i, lane, rows_s[warp], true, r, piece == 0);
    }
  }
}

// W warps per block (kWarps, or kBudgetDispatchWarps under an SM budget). kWarps blocks are held
// to three per SM's registers (85; the kernel needs 80), so the launcher's resident cap keeps room
// for 64 senders and two expand blocks per SM; the kShared variant (decode) to two, for the
// registers its row pieces need.
template <class V, int W, bool kShared>
__global__ void __launch_bounds__(W * 32, W == kWarps ? (kShared ? 2 : 3) : 1)
    dispatch_overlap_kernel(const __grid_constant__ OverlapArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DeviceGroup& g = a.send.g;
  EPX_STAMP(kTlEntry);
  EPX_STAMP_GRID(a.send_blocks);
  const uint32_t next = a.inline_barrier ? inline_barrier_begin(g) : 0;
  EPX_STAMP(kTlBarrier);
  if (static_cast<int>(blockIdx.x) < a.send_blocks) send_role<V, W>(a, warp, lane, next);
  else expand_role<V, W, kShared>(a, blockIdx.x - a.send_blocks, gridDim.x - a.send_blocks, warp, lane);
  EPX_STAMP(kTlRoleDone);
#ifdef EPX_EP_TIMELINE
  __syncthreads();
  EPX_STAMP(kTlExit);
#endif
  if (!a.inline_barrier && !kShared) return;
  // The last block to finish counts the op into the epoch (every block has read it by then) and,
  // where chunks were shared by several blocks, zeroes this rank's arrival counters (every block
  // has finished waiting, so every arrival they count has landed; the next op's opening barrier
  // orders the reset before any new arrival).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done_ticket(g), 1u) == gridDim.x - 1) {
      if (kShared) {
        uint32_t* counters = arrival(g, g.rank, 0, 0);
        for (int i = 0; i < g.R * arrival_chunks(g.max_tokens); ++i) counters[i] = 0u;
      }
      *done_ticket(g) = 0u;
      if (a.inline_barrier) *g.epoch = next;
    }
  }
}

template <class V, int W, bool kShared>
bool launch_dispatch_kernel(const SendArgs& sa, const ExpandArgs& ea, bool inline_barrier, int expand_pieces,
                            cudaStream_t stream) {
  const DeviceGroup& g = sa.g;
  const int cap = resident_blocks<dispatch_overlap_kernel<V, W, kShared>>(W * 32);
  // Under an SM budget (GroupConfig::num_sms) the senders get a share of it (EPX_DISPATCH_SEND_SHARE
  // percent, default 25: measured at 32 SMs, T=4096, H=7168 on 2 x H200 with 8-warp blocks, 25 /
  // 50 / 75 gave 483 / 700 / 1347 us) and the expanders the rest, one block per SM.
  // Without a budget, 64 sender blocks (EPX_DISPATCH_SEND_BLOCKS; measured at T=4096, H=7168 on
  // 2 x H200: 32 / 48 / 64 / 96 gave 257 / 229 / 228 / 235 us, the same 27 us at T=128). Splitting a
  // token's row over several sender warps at T=128, as the combine splits its rows, did not help
  // (2 / 4 / 8 warps per row: 27.5 / 27.9 / 28.5 us against 27.4).
  static const int send_share = overlap_knob("EPX_DISPATCH_SEND_SHARE", 25);
  static const int send_blocks = overlap_knob("EPX_DISPATCH_SEND_BLOCKS", 64);
  const int link_blocks =
      g.sm_budget > 0 ? std::max(1, std::min(g.sm_budget - 1, g.sm_budget * send_share / 100)) : send_blocks;
  const int send = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((sa.T + W - 1) / W, link_blocks)));
  // Enough expand blocks for every chunk of the largest batch, at most two per SM
  // (EPX_DISPATCH_EXPAND_PER_SM; measured at T=4096, H=7168 on 2 x H200: with 32 senders 1, 2, 3 per
  // SM gave 255, 266, 275 us; with 64 senders 1 and 2 gave 228 and 220-222 us).
  static const int per_sm = overlap_knob("EPX_DISPATCH_EXPAND_PER_SM", 2);
  const int64_t items = static_cast<int64_t>(g.R) * arrival_chunks(g.max_tokens) * expand_pieces;
  const int expand = static_cast<int>(std::min<int64_t>(
      {items, budget_blocks(g, per_sm * cuda::sm_count()) - (g.sm_budget > 0 ? send : 0), cap - send}));
  if (expand < 1) return false;  // the grid could not be resident: the phased path
  OverlapArgs a{sa, ea, send, expand_pieces, inline_barrier};
  dispatch_overlap_kernel<V, W, kShared><<<send + expand, W * 32, 0, stream>>>(a);
  EPX_CHECK_LAUNCH("dispatch_overlap_kernel");
  return true;
}

template <int W>
bool launch_dispatch(const SendArgs& sa, const ExpandArgs& ea, bool vec, bool inline_barrier, cudaStream_t stream) {
  // EPX_DISPATCH_EXPAND_PIECES (default 1: off; at most kMaxPieces): expand blocks a chunk's rows
  // may be split over at decode sizes (expand_role). Not yet measured on a GPU.
  static const int pieces = std::min(kMaxPieces, overlap_knob("EPX_DISPATCH_EXPAND_PIECES", 1));
  if (vec)
    return pieces > 1 ? launch_dispatch_kernel<uint4, W, true>(sa, ea, inline_barrier, pieces, stream)
                      : launch_dispatch_kernel<uint4, W, false>(sa, ea, inline_barrier, 1, stream);
  return pieces > 1 ? launch_dispatch_kernel<uint8_t, W, true>(sa, ea, inline_barrier, pieces, stream)
                    : launch_dispatch_kernel<uint8_t, W, false>(sa, ea, inline_barrier, 1, stream);
}

}  // namespace

int overlap_knob(const char* name, int dflt) {
  const char* v = std::getenv(name);
  const int n = v ? std::atoi(v) : 0;
  return n > 0 ? n : dflt;
}

bool env_asks_phased(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "phased") == 0;
}

bool overlapped_dispatch_enabled() {
  static const bool on = !env_asks_phased("EPX_DISPATCH_KERNEL");
  return on;
}

bool launch_overlapped_dispatch(const SendArgs& sa, const ExpandArgs& ea, bool vec, bool inline_barrier,
                                cudaStream_t stream) {
  if (sa.g.R > kMaxR || sa.K > kMaxK || ea.K != sa.K) return false;
  return sa.g.sm_budget > 0 ? launch_dispatch<kBudgetDispatchWarps>(sa, ea, vec, inline_barrier, stream)
                            : launch_dispatch<kWarps>(sa, ea, vec, inline_barrier, stream);
}

}  // namespace epx::comm::ep_device

namespace epx::comm {

bool ep_timeline_enabled() {
#ifdef EPX_EP_TIMELINE
  return true;
#else
  return false;
#endif
}

void ep_timeline_clear_dispatch() {
#ifdef EPX_EP_TIMELINE
  clear_timeline(ep_device::tl_stamps, ep_device::tl_blocks);
#endif
}

bool ep_timeline_read_dispatch(EpTimeline& out) {
#ifdef EPX_EP_TIMELINE
  return read_timeline(ep_device::tl_stamps, ep_device::tl_blocks, ep_device::tl_writer_blocks, out);
#else
  (void)out;
  return false;
#endif
}

}  // namespace epx::comm

namespace epx::comm::ep_device {

bool inline_barrier_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("EPX_EP_BARRIER");
    return v == nullptr || std::strcmp(v, "launch") != 0;
  }();
  return on;
}

}  // namespace epx::comm::ep_device
