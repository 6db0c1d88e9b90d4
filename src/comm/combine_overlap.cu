// The zero-copy combine (and dispatch_backward) in one launch, the source-side sums overlapping the
// transfer of the partials.
//
// The phased combine (ep_kernels.cu) is  barrier -> every expert-side partial -> barrier -> sums.
// Here the first blocks of the grid compute partials and the others sum, in the same launch:
//  - a reduce warp computes the partial of one received (source, slot) (the same per-element code
//    as the phased kernel: reduce_partial), writes it into the source's window, then bumps the
//    source's arrival counter of that slot's chunk with a system-scope release. Slots go chunk
//    index first, remote sources before this rank, so partials cross the link from the start;
//    outside decode sizes each warp claims its next partial from a counter as it starts one;
//  - a sum warp takes one of this rank's tokens, waits (acquire, with the group's timeout) until the
//    chunk holding each of its slots is complete on every rank it went to, then sums the partials
//    in rank order (sum_partials, past L1);
//  - a chunk is read by several sum warps (a chunk holds slots of scattered tokens), so nobody can
//    take its count: the last block of the grid to finish (a ticket) zeroes this rank's counters,
//    which every peer has finished bumping by then (each was waited for). The next op's
//    before-write barrier orders the reset before any new arrival.
//  - with fewer rows than warps (decode), each partial and each sum is split over up to kMaxPieces
//    warps by ranges of its vectors (piece_range), and without an SM budget each partial over at
//    least two; each piece of a partial adds its share of the slot's kArrivalUnit, so the receiving
//    side does not know the split;
// Ranks wait on each other's reduce warps, so the whole grid must be resident (capped by the
// occupancy). Results are bit-identical to the phased path: same partials, same order of sums.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "comm/ep_device.cuh"
#include "comm/ep_timeline.cuh"
#include "core/env_choice.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/dependent_launch.cuh"

namespace epx::comm::ep_device {
namespace {

EPX_TIMELINE_BUFFER()

// W warps per block: kWarps, three blocks per SM (register cap 85); kBudgetCombineWarps under an SM
// budget, one block per SM with the same register cap. A partial's loads in flight per lane: kRows
// rows x kUnroll vectors (weighted_row_sum).
template <class T, int N, int W, int kRows, int kUnroll>
__global__ void __launch_bounds__(W * 32, W == kWarps ? 3 : 1)
    combine_overlap_kernel(const __grid_constant__ ReduceArgs a, int reduce_blocks) {
  __shared__ int32_t rows_s[W][kMaxK];
  __shared__ float w_s[W][kMaxK];
  __shared__ int32_t slot_s[W][kMaxR];
  __shared__ int last_s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DeviceGroup& g = a.g;
  const int R = g.R;
  const int64_t nvec = a.H / N;
  cuda::wait_for_previous_grid();
  EPX_STAMP(kTlEntry);
  EPX_STAMP_GRID(reduce_blocks);
  const uint32_t next = a.inline_barrier ? inline_barrier_begin(g) : 0;
  EPX_STAMP(kTlBarrier);
  if (static_cast<int>(blockIdx.x) < reduce_blocks) {
    uint64_t ready = 0;  // lane 0: the peers known to have reached this op (inline barrier)
    int maxc = 0;
    int64_t slots = 0;
    for (int s = 0; s < R; ++s) {
      maxc = max(maxc, arrival_chunks(a.recv_tokens[s]));
      slots += a.recv_tokens[s];
    }
    // Work items fit in 32 bits: at most max_tokens x R x kMaxPieces.
    const int warps = reduce_blocks * W;
    const int pieces = max(min(a.min_pieces, max_pieces_of(nvec)), pieces_for(slots, warps, nvec, a.max_pieces));
    const int span = R * kArrivalChunk;  // slots of one chunk index
    // The queue: slots by chunk index, each in `pieces` pieces, those of the last tail_chunks chunk
    // indices in finer ones (the last items bound when the slowest warp is done).
    PieceQueue queue;
    queue.items = maxc * span;
    queue.head = max(0, maxc - a.tail_chunks) * span;
    queue.pieces = pieces;
    // Only where the queue holds more entries than warps: with fewer, every warp has one at most,
    // and finer pieces would give some a second.
    const bool tail = static_cast<int64_t>(queue.items) * pieces >= warps;
    queue.tail_pieces = tail ? max(pieces, min(a.tail_pieces, max_pieces_of(nvec))) : pieces;
    // A warp's first item is its index; each further one is its index plus the warps, or, with
    // claim_items (the default outside decode sizes), the next unclaimed item. Partials differ in
    // their rows (0 to K on a rank), so a fixed stride can leave some warps with far more rows than
    // others; claiming hands the next item to whichever warp is free. Lane 0 claims the next item as
    // it starts one, so the atomic's latency hides behind the work.
    const int entries = queue.length();
    int claimed = 0;
    for (int q = blockIdx.x * W + warp; q < entries;
         q = a.claim_items ? __shfl_sync(0xffffffffu, claimed, 0) : q + warps) {
      if (a.claim_items && lane == 0) claimed = warps + static_cast<int>(atomicAdd(work_counter(g), 1u));
      int item, piece, of;
      queue.at(q, item, piece, of);
      const int c = item / span, within = item % span;
      const int s = (g.rank + 1 + within / kArrivalChunk) % R;
      const int slot = c * kArrivalChunk + within % kArrivalChunk;
      if (slot >= a.recv_tokens[s]) continue;  // warp-uniform
      if (a.inline_barrier) {
        if (lane == 0) wait_peer_ready(g, s, next, ready, a.op_code);
        __syncwarp();  // lane 0's acquire before every lane's stores
      }
      if (q == static_cast<int>(blockIdx.x) * W) EPX_STAMP(kTlFirst);
      reduce_partial<T, N, kRows, kUnroll>(a, s, slot, lane, rows_s[warp], w_s[warp], piece_range(nvec, of, piece));
      if (lane == 0) red_release_sys_add(arrival(g, s, g.rank, c), kArrivalUnit / of);
    }
  } else {
    // The sums: token t's pieces wait for the chunks holding its slots on every rank it went to.
    const int warps = (gridDim.x - reduce_blocks) * W;
    const int pieces = max(min(a.sum_min_pieces, max_pieces_of(nvec)), pieces_for(a.T, warps, nvec, a.max_pieces));
    const int first = (blockIdx.x - reduce_blocks) * W + warp;
    for (int q = first; q < a.T * pieces; q += warps) {
      const int64_t t = q / pieces;
      const int piece = q % pieces;
      for (int d = lane; d < R; d += 32) slot_s[warp][d] = a.token_slot[t * R + d];
      __syncwarp();
      int ok = 1;
      if (lane == 0) {
        for (int d = 0; d < R && ok; ++d) {
          const int32_t sl = slot_s[warp][d];
          if (sl < 0) continue;
          const int c = sl / kArrivalChunk;
          ok = wait_arrivals(g, d, c, static_cast<uint32_t>(min(kArrivalChunk, a.send_tokens[d] - c * kArrivalChunk)),
                             a.op_code);
        }
      }
      __syncwarp();  // lane 0's acquire before every lane's reads
      ok = __shfl_sync(0xffffffffu, ok, 0);
      if (q == first) EPX_STAMP(kTlFirst);
      if (ok)
        sum_partials<T, N>(a, t, lane, slot_s[warp], true, piece_range(nvec, pieces, piece));
    }
  }
  EPX_STAMP(kTlRoleDone);
  cuda::allow_next_grid();
  // The last block to finish zeroes this rank's counters (every arrival they count has landed).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last_s = atomicAdd(done_ticket(g), 1u) == gridDim.x - 1;
  }
  __syncthreads();
  EPX_STAMP(kTlExit);
  if (!last_s) return;
  uint32_t* counters = arrival(g, g.rank, 0, 0);
  const int words = R * arrival_chunks(g.max_tokens);
  for (int i = threadIdx.x; i < words; i += blockDim.x) counters[i] = 0u;
  if (threadIdx.x == 0) {
    *done_ticket(g) = 0u;
    *work_counter(g) = 0u;  // every warp has made its last claim
    if (a.inline_barrier) *g.epoch = next;  // every block has read it
  }
}

// EPX_COMBINE_ITEMS=stride|claim (read once): how every combine's reduce warps take their items;
// unset, the caller's default.
bool combine_items_claimed(bool default_claim) {
  static const int env = ::epx::detail::env_choice("EPX_COMBINE_ITEMS", {"stride", "claim"});
  return env < 0 ? default_claim : env == 1;
}

template <class T, int N, int W, int kRows, int kUnroll>
bool launch_warps(const ReduceArgs& a, bool inline_barrier, cudaStream_t stream) {
  const int cap = resident_blocks<combine_overlap_kernel<T, N, W, kRows, kUnroll>>(W * 32);
  const int sms = cuda::sm_count();
  // The partials are most of the work (K / R rows read per partial): they get every resident slot
  // the sums leave, up to three blocks per SM (EPX_COMBINE_REDUCE_PER_SM), the sums three blocks per
  // four SMs (EPX_COMBINE_SUM_BLOCKS; they mostly wait, then stream R partials per token) where this
  // rank's tokens are at least a block's warps per SM, else one per SM (fewer tokens than sum warps:
  // each sum then splits over more warps). With partials claimed in halves (below), on 2 x H200 (2
  // ranks, K=8) 33 / 44 / 66 / 99 / 132 sum blocks took 314 / 266 / 226 / 220 / 226 us at T=4096,
  // H=7168 and 193 / 162 / 136 / 137 / 143 us at H=4096, E=64; 99 / 132 took 128 / 129 us at T=2048
  // and 404 / 418 us at T=8192, 81 / 80 us at T=1024; at T=512 the 99 took 49 us against 46 with 132
  // and stride. (By a fixed stride, one per SM had been best: 66 / 99 / 132 / 198 took 249 / 267 /
  // 242 / 305 us, where 99 left some SMs a third reduce block and others none.)
  static const int per_sm = overlap_knob("EPX_COMBINE_REDUCE_PER_SM", 3);
  // Decode batches, where this rank's tokens times the ranks (a guess at the partials to make) leave
  // at least 4 pieces a partial on one reduce block per SM, take EPX_COMBINE_DECODE_REDUCE_PER_SM
  // (default 1). 2 x H200, T=128, H=7168: 1 / 2 / 3 reduce blocks per SM gave 19.7 / 20.9 / 20.7 us
  // and 19.9 / 20.6 / 20.6 (graph-timed 18.0 / 18.6 / 18.5); fewer warps, each a larger piece.
  static const int decode_per_sm = overlap_knob("EPX_COMBINE_DECODE_REDUCE_PER_SM", 1);
  static const int sum_blocks = overlap_knob("EPX_COMBINE_SUM_BLOCKS", 0);  // 0: the defaults above
  // Under an SM budget (GroupConfig::num_sms): a quarter of it sums (EPX_COMBINE_BUDGET_SUM_PER_MILLE,
  // default 250), the rest reduces. Measured at 32 SMs, T=4096, H=7168, 2 ranks on 2 x H100: 250 /
  // 333 / 400 gave 599 / 664 / 682 us; 32-warp blocks instead of 24 (spilling) 664 us at 333 and
  // 763 at 250; on 4 x H200 16-warp blocks took 767 us against 615 with 24.
  const DeviceGroup& g = a.g;
  static const int sum_share = overlap_knob("EPX_COMBINE_BUDGET_SUM_PER_MILLE", 250);
  const bool decode = g.sm_budget == 0 && static_cast<int64_t>(a.T) * g.R * 4 <= static_cast<int64_t>(sms) * W;
  const bool many_tokens = static_cast<int64_t>(a.T) >= static_cast<int64_t>(sms) * W;
  const int unbudgeted_sum = sum_blocks > 0 ? sum_blocks : many_tokens ? std::max(1, sms * 3 / 4) : sms;
  const int sum = g.sm_budget > 0 ? std::max(1, std::min(cap - 1, g.sm_budget * sum_share / 1000))
                                  : std::min(unbudgeted_sum, cap - 1);
  const int reduce =
      std::min(budget_blocks(g, (decode ? decode_per_sm : per_sm) * sms) - (g.sm_budget > 0 ? sum : 0), cap - sum);
  static const bool debug = std::getenv("EPX_DEBUG") != nullptr;
  if (debug) std::fprintf(stderr, "epx: combine_overlap_kernel grid %d + %d (resident cap %d)\n", reduce, sum, cap);
  if (reduce < 1) return false;
  // Few rows: each partial and each sum over up to EPX_COMBINE_PIECES warps.
  static const int max_pieces = overlap_knob("EPX_COMBINE_PIECES", kMaxPieces);
  // Partial items claimed one by one, by a fixed stride at decode sizes (EPX_COMBINE_ITEMS=stride|claim
  // everywhere). Partials hold 0 to K rows, so a fixed share of them leaves some warps far more
  // rows than others; claiming hands the next one to whichever warp is free. 2 x H200, T=4096, H=7168:
  // at 32 SMs claiming took 486 against 524 us by stride (~11 items a warp); with every SM, one sum
  // block per SM, 236 against 242 us, and with partials in halves (below) 226 against 239-242.
  const bool claim = combine_items_claimed(g.sm_budget > 0 || !decode);
  // Without an SM budget each partial goes over at least two warps (EPX_COMBINE_MIN_PIECES, both
  // modes), also where rows are many: smaller items even out the warps' shares of rows, but each
  // piece ends with a system-scope release that waits for the warp's stores to land. 2 x H200,
  // T=4096, H=7168, claimed, one sum block per SM: 1 / 2 / 3 / 4 pieces 236 / 225-227 / 231 / 249 us;
  // H=4096, E=64: 142 / 142 / 151 / 166 us. Under a 32-SM budget (~11 partials a warp) two took 496
  // against 474 us.
  static const int min_pieces = overlap_knob("EPX_COMBINE_MIN_PIECES", 0);  // 0: the defaults above
  // The end of the op: without an SM budget each token's sum goes over at least two warps on two
  // ranks (EPX_COMBINE_SUM_MIN_PIECES), and the partials of the last chunk indices, about one slot per
  // reduce warp (EPX_COMBINE_TAIL_CHUNKS), over at least three (EPX_COMBINE_TAIL_PIECES): the op ends
  // when the slowest warp's last item does, and the last sums wait for the last partials, so smaller
  // items there shorten the tail without paying a piece's release on every partial. 2 x H200, T=4096,
  // H=7168, three rounds (us): neither 220.9 / 222.2 / 220.0; sums in two 218.0 / 217.8 / 216.7; with
  // the last 128 chunk indices in three pieces 214.0 / 215.2 / 214.2 (T=8192 404 -> 397, T=2048
  // 129 -> 125, H=4096, E=64 137.5 -> 136.2, T=128 level); sums in four, or three with the tail,
  // 217-220; the tail in four 214-215, in three over 256 chunk indices 215-217. With the tail
  // limited to queues of more entries than warps (at T=512 it had cost 46 -> 52 us): T=4096 220.9 ->
  // 214.5, T=2048 129.9 -> 124.2, T=1024 82.5 -> 76.9, T=512 and 256 level. At 4 ranks (4 x H200,
  // one process) two-piece sums cost 2-3 us at T=4096 and T=2048 (535 / 294 against 532 / 292 us) and
  // the tail alone was level there (533 / 295), T=1024 164.9 -> 158.9 with both: sums in two pieces
  // only on 2 ranks. Under a budget neither (not measured there).
  static const int tail_chunks_env = overlap_knob("EPX_COMBINE_TAIL_CHUNKS", 0);  // 0: the default above
  static const int tail_pieces_env = overlap_knob("EPX_COMBINE_TAIL_PIECES", 0);
  static const int sum_pieces_env = overlap_knob("EPX_COMBINE_SUM_MIN_PIECES", 0);
  const bool budget = g.sm_budget > 0;
  const int span = g.R * kArrivalChunk;  // slots of one chunk index
  const int tail_chunks = tail_chunks_env > 0 ? tail_chunks_env : budget ? 0 : reduce * W / span;
  const int tail_pieces = tail_pieces_env > 0 ? tail_pieces_env : budget ? 1 : 3;
  const int sum_min_pieces = sum_pieces_env > 0 ? sum_pieces_env : budget || g.R > 2 ? 1 : 2;
  ReduceArgs ra = a;
  ra.max_pieces = max_pieces;
  ra.min_pieces = min_pieces > 0 ? min_pieces : budget ? 1 : 2;
  ra.claim_items = claim;
  ra.tail_chunks = tail_chunks;
  ra.tail_pieces = tail_pieces;
  ra.sum_min_pieces = sum_min_pieces;
  ra.inline_barrier = inline_barrier;
  cuda::launch_after_previous("launch of combine_overlap_kernel", combine_overlap_kernel<T, N, W, kRows, kUnroll>,
                              reduce + sum, W * 32, 0, stream, ra, reduce);
  return true;
}

// The reduce warps of bf16 rows load kWideReduceRows rows x kReduceUnroll vectors per lane before adding
// (EPX_COMBINE_LOADS=4x2, the default; 2x2 as fp16 / fp32 rows, whose 4 x 2 instantiations would spill
// 152 / 44 bytes and were not measured). The 4 x 2 kernels spill 76 bytes at their register caps, outside
// their load groups. Few SMs move bytes at the rate of the loads each keeps in flight (bench_sm_rates: a
// 4 -> 1 row sum on 32 SMs of an H200, 16 warps each, 84 GB/s an SM with 2 vectors of each row per lane,
// 37 with 1; on 132 SMs 3.3 -> 4.1 TB/s between 33 and 65 KB of loads in flight per SM).
// 2 x H200, T=4096, 2 x 2 -> 4 x 2 (us): under a 32-SM budget H=7168 482 -> 426, H=4096, E=64 299 -> 267,
// T=128 level (16-warp blocks with 4 x 2, no spills and a third fewer warps, took 520 / 332); without a
// budget, three rounds, eager (graph) H=7168 213.7 -> 210.6 (211.3 -> 207.5), H=4096, E=64 136.9 -> 132.5
// (133.5 -> 130.5), T=1024 76.7 -> 73.3 (74.4 -> 71.1), T=128 19.8 -> 19.7 (18.0 -> 17.7).
bool wide_loads() {
  static const int env = ::epx::detail::env_choice("EPX_COMBINE_LOADS", {"4x2", "2x2"});
  return env != 1;
}

// kRows rows x kReduceUnroll vectors per lane, in the blocks of the group's SM budget (or of none).
template <class T, int N, int kRows>
bool launch_rows(const ReduceArgs& a, bool inline_barrier, cudaStream_t stream) {
  return a.g.sm_budget > 0 ? launch_warps<T, N, kBudgetCombineWarps, kRows, kReduceUnroll>(a, inline_barrier, stream)
                           : launch_warps<T, N, kWarps, kRows, kReduceUnroll>(a, inline_barrier, stream);
}

template <class T, int N>
bool launch(const ReduceArgs& a, bool inline_barrier, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N > 1) {  // measured for bf16 rows only
    if (wide_loads()) return launch_rows<T, N, kWideReduceRows>(a, inline_barrier, stream);
  }
  return launch_rows<T, N, kReduceRows>(a, inline_barrier, stream);
}

}  // namespace

}  // namespace epx::comm::ep_device

namespace epx::comm {

void ep_timeline_clear_combine() {
#ifdef EPX_EP_TIMELINE
  clear_timeline(ep_device::tl_stamps, ep_device::tl_blocks);
#endif
}

bool ep_timeline_read_combine(EpTimeline& out) {
#ifdef EPX_EP_TIMELINE
  return read_timeline(ep_device::tl_stamps, ep_device::tl_blocks, ep_device::tl_writer_blocks, out);
#else
  (void)out;
  return false;
#endif
}

}  // namespace epx::comm

namespace epx::comm::ep_device {

bool overlapped_combine_enabled() {
  static const bool on = !env_asks_phased("EPX_COMBINE_KERNEL");
  return on;
}

bool launch_overlapped_combine(const ReduceArgs& a, DType dtype, bool vec, bool inline_barrier, cudaStream_t stream) {
  if (a.g.R > kMaxR || a.K > kMaxK || a.send_tokens == nullptr) return false;
  const bool ib = inline_barrier;
  switch (dtype) {
    case DType::kF32: return vec ? launch<float, 4>(a, ib, stream) : launch<float, 1>(a, ib, stream);
    case DType::kBF16:
      return vec ? launch<__nv_bfloat16, 8>(a, ib, stream) : launch<__nv_bfloat16, 1>(a, ib, stream);
    case DType::kF16: return vec ? launch<__half, 8>(a, ib, stream) : launch<__half, 1>(a, ib, stream);
    default: return false;
  }
}

}  // namespace epx::comm::ep_device
