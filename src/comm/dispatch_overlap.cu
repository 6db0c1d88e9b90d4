// The zero-copy dispatch in one launch, the expansion overlapping the transfer.
//
// The phased dispatch (ep_kernels.cu) is  barrier -> send every row -> barrier -> expand, so the
// receiver's expansion into the expert-major layout (K / R rows written per received row: the
// larger part of dispatch's HBM traffic) starts only when the last row has crossed the link. Here
// the first blocks of the grid send and the others expand, in the same launch:
//  - a send warp writes its token's row, scales and routing meta into each remote destination's
//    window, then bumps the destination's arrival counter of that slot's chunk (kArrivalChunk slots
//    of one source) by kArrivalUnit with a system-scope release;
//  - an expand crew (kArrivalChunk warps of an expand block) takes chunk items (source, chunk) in an
//    order that follows the senders (chunk index first), waits (acquire, with the group's timeout)
//    until its remote chunk is complete, subtracts what it consumed (the counters are back at zero
//    when the op ends, ready for the next one; the before-write barrier of that op orders the reset
//    before any new arrival), and expands each row into every expert row it feeds, loading the row
//    once for all of them;
//  - rows a rank sends itself never go through its window: the expand crews read them from x.
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
#include "core/env_choice.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/dependent_launch.cuh"

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
          if (slot_s[warp][d] >= 0) wait_peer_ready(g, d, next, ready, a.op_code);
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

// An expand block is split into crews of kArrivalChunk warps (one warp per slot of a chunk), each
// taking chunk items of its own: a 16-warp block under an SM budget that took one chunk at a time
// left half its warps idle at every chunk.
constexpr int kCrewWarps = kArrivalChunk;
template <int W>
constexpr int crews_per_block() {
  return W > kCrewWarps ? W / kCrewWarps : 1;
}

// The barrier of the crew holding warp `warp`: the whole block where a block is one crew, else
// named barrier 1 + crew over the crew's threads.
template <int W>
__device__ __forceinline__ void crew_sync(int warp) {
  if constexpr (crews_per_block<W>() == 1) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / kCrewWarps), "r"(kCrewWarps * 32) : "memory");
  }
}

// Waits (the crew's first thread) until chunk c of source s holds `n` arrivals, then takes them
// (take) or leaves them for the last block of the grid to zero (chunks several blocks expand, each
// a piece of the rows). false: the wait gave up (recorded in the group status like a barrier
// timeout) or the group was already broken; the chunk's rows must not be read.
// The answer alternates between two words (`calls`: the crew's waits so far), so the first thread
// never overwrites one that a slow thread of its crew has yet to read: the word of wait i is
// written again at wait i + 2, behind the barrier of wait i + 1, which every thread reaches only
// after reading it.
template <int W>
__device__ bool await_chunk(const DeviceGroup& g, int op_code, int s, int c, uint32_t n, bool take, int warp, int lane,
                            unsigned& calls) {
  __shared__ int ok_s[crews_per_block<W>()][2];
  const int crew = crews_per_block<W>() == 1 ? 0 : warp / kCrewWarps;
  const int word = calls++ & 1u;
  if (warp % kCrewWarps == 0 && lane == 0) {
    const bool ok = wait_arrivals(g, s, c, n, op_code);
    if (ok && take) atomicSub(arrival(g, g.rank, s, c), n * kArrivalUnit);
    ok_s[crew][word] = ok;
  }
  crew_sync<W>(warp);
  return ok_s[crew][word] != 0;
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
    copy_fanout_short(sa.scales + t * sa.scale_bytes, a.out_scales, a.scale_bytes, rows_s, K, lane, false);
  __syncwarp();
}

// kShared: chunks may be split over several blocks (OverlapArgs::expand_pieces > 1), a kernel of its
// own so that the default one keeps its registers.
template <class V, int W, bool kShared>
__device__ void expand_role(const OverlapArgs& oa, int xb_block, int xn_blocks, int warp, int lane) {
  __shared__ int32_t rows_s[W][kMaxK];
  const ExpandArgs& a = oa.expand;
  const SendArgs& sa = oa.send;
  const DeviceGroup& g = a.g;
  const int R = g.R;
  const int32_t total_rows = a.offsets[g.Le];
  const bool write = static_cast<int64_t>(total_rows) <= g.recv_capacity;  // overflow: consume, write nothing

  // Padding rows of the local experts (zeros), spread over the expand warps.
  if (write)
    for (int j = xb_block * W + warp; j < g.Le; j += xn_blocks * W) zero_padding_rows<V>(a, j, lane);
  // From here on the crew is the unit: crew xb of xn, its warps cw = 0 .. kCrewWarps - 1.
  constexpr int kCrews = crews_per_block<W>();
  constexpr int kCW = W / kCrews;
  const int xb = xb_block * kCrews + warp / kCW, xn = xn_blocks * kCrews, cw = warp % kCW;

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
  const int P = kShared ? pieces_for(slots, static_cast<int64_t>(xn) * kCW, nvec, oa.expand_pieces) : 1;
  // Items (chunk c, source s, piece): chunk-major, remote sources first, so crews meet the chunks
  // in the order the senders produce them.
  unsigned waits = 0;
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
    if (!local && !await_chunk<W>(g, sa.op_code, s, c, static_cast<uint32_t>(n), !kShared, warp, lane, waits)) continue;
    if (it == xb) EPX_STAMP(kTlFirst);
    if (!write) continue;
    const VecRange r = piece_range(nvec, P, piece);
    for (int i = cw; i < n; i += kCW) {
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
  cuda::wait_for_previous_grid();
  EPX_STAMP(kTlEntry);
  EPX_STAMP_GRID(a.send_blocks);
  const uint32_t next = a.inline_barrier ? inline_barrier_begin(g) : 0;
  EPX_STAMP(kTlBarrier);
  if (static_cast<int>(blockIdx.x) < a.send_blocks) send_role<V, W>(a, warp, lane, next);
  else expand_role<V, W, kShared>(a, blockIdx.x - a.send_blocks, gridDim.x - a.send_blocks, warp, lane);
  EPX_STAMP(kTlRoleDone);
  cuda::allow_next_grid();
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

// Expand blocks per SM without a budget (EPX_DISPATCH_EXPAND_PER_SM, default 2; read once).
// Measured at T=4096, H=7168 on 2 x H200: with 32 senders 1, 2, 3 per SM gave 255, 266, 275 us; with
// 64 senders 1 and 2 gave 228 and 220-222 us.
int expand_per_sm() {
  static const int n = overlap_knob("EPX_DISPATCH_EXPAND_PER_SM", 2);
  return n;
}

template <class V, int W, bool kShared>
bool launch_dispatch_kernel(const SendArgs& sa, const ExpandArgs& ea, bool inline_barrier, int expand_pieces,
                            cudaStream_t stream) {
  const DeviceGroup& g = sa.g;
  const int cap = resident_blocks<dispatch_overlap_kernel<V, W, kShared>>(W * 32);
  // Under an SM budget (GroupConfig::num_sms) the senders get a share of it (EPX_DISPATCH_SEND_SHARE
  // percent, default 25: measured at 32 SMs, T=4096, H=7168 on 2 x H200 with 8-warp blocks, 25 /
  // 50 / 75 gave 483 / 700 / 1347 us) and the expanders the rest, one block per SM.
  // Without a budget, 96 sender blocks (EPX_DISPATCH_SEND_BLOCKS; measured at T=4096, H=7168 on
  // 2 x H200 before the expand crews: 32 / 48 / 64 / 96 gave 257 / 229 / 228 / 235 us, the same
  // 27 us at T=128; with them, on 2 x H100, 64 / 96 / 128 gave 284 / 278 / 285 us, FP8 rows 162 /
  // 151 / 152 us, and at H=4096, E=64 167 / 162 / 162 us, FP8 110 / 98 / 91 us). Splitting a
  // token's row over several sender warps at T=128, as the combine splits its rows, did not help
  // (2 / 4 / 8 warps per row: 27.5 / 27.9 / 28.5 us against 27.4).
  static const int send_share = overlap_knob("EPX_DISPATCH_SEND_SHARE", 25);
  static const int send_blocks = overlap_knob("EPX_DISPATCH_SEND_BLOCKS", 96);
  const int link_blocks =
      g.sm_budget > 0 ? std::max(1, std::min(g.sm_budget - 1, g.sm_budget * send_share / 100)) : send_blocks;
  const int send = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((sa.T + W - 1) / W, link_blocks)));
  // Enough expand blocks for every chunk of the largest batch, at most expand_per_sm() per SM.
  const int per_sm = expand_per_sm();
  const int64_t items = static_cast<int64_t>(g.R) * arrival_chunks(g.max_tokens) * expand_pieces;
  const int64_t crews = crews_per_block<W>();
  const int expand = static_cast<int>(std::min<int64_t>(
      {(items + crews - 1) / crews, budget_blocks(g, per_sm * cuda::sm_count()) - (g.sm_budget > 0 ? send : 0),
       cap - send}));
  if (expand < 1) return false;  // the grid could not be resident: the phased path
  OverlapArgs a{sa, ea, send, expand_pieces, inline_barrier};
  cuda::launch_after_previous("launch of dispatch_overlap_kernel", dispatch_overlap_kernel<V, W, kShared>,
                              send + expand, W * 32, 0, stream, a);
  return true;
}

template <int W>
bool launch_dispatch(const SendArgs& sa, const ExpandArgs& ea, bool vec, bool inline_barrier, cudaStream_t stream) {
  // Small batches (decode) take the kernel whose expand crews split a chunk's rows over up to
  // EPX_DISPATCH_EXPAND_PIECES crews (default kMaxPieces; 1 turns it off), where this rank's
  // tokens times the ranks, a guess at the slots to expand, are at most half the expand warps (the
  // device then splits each row over at least two). Measured at T=128, H=7168, K=8, no budget,
  // 4 x H200: 25.6 -> 19.5 us at 2 ranks, 38.9 -> 37.5 us at 4.
  static const int cap = std::min(kMaxPieces, overlap_knob("EPX_DISPATCH_EXPAND_PIECES", kMaxPieces));
  const DeviceGroup& g = sa.g;
  const int64_t expand_warps =
      static_cast<int64_t>(g.sm_budget > 0 ? g.sm_budget : expand_per_sm() * cuda::sm_count()) * W;
  const int pieces = static_cast<int64_t>(sa.T) * g.R * 2 <= expand_warps ? cap : 1;
  if (vec)
    return pieces > 1 ? launch_dispatch_kernel<uint4, W, true>(sa, ea, inline_barrier, pieces, stream)
                      : launch_dispatch_kernel<uint4, W, false>(sa, ea, inline_barrier, 1, stream);
  return pieces > 1 ? launch_dispatch_kernel<uint8_t, W, true>(sa, ea, inline_barrier, pieces, stream)
                    : launch_dispatch_kernel<uint8_t, W, false>(sa, ea, inline_barrier, 1, stream);
}

}  // namespace

int overlap_knob(const char* name, int dflt) { return ::epx::detail::env_positive_int(name, dflt); }

bool env_asks_phased(const char* name) { return ::epx::detail::env_choice(name, {"overlapped", "phased"}) == 1; }

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
  static const bool on = ::epx::detail::env_choice("EPX_EP_BARRIER", {"inline", "launch"}) != 1;
  return on;
}

}  // namespace epx::comm::ep_device
