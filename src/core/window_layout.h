// Layout of one rank's communication window, the same for the host reference and the GPU
// backends. Sources write into region [source rank] of the destination's window, so no two ranks
// ever write the same bytes; the only atomics that cross the link are the increments of the
// arrival counters in the signal area after the layout (GPU zero-copy dispatch and combine).
//
//   header [R][kHeaderInts] int32   per source: pairs for each local expert, token rows, top-k
//   meta   [R][max_tokens][max_topk] RowMeta  per received token and slot: local expert, position, weight
//   rows   [R][max_tokens][row_bytes]  token rows (dispatch, combine_backward) or partial sums
//                                       travelling back (combine, dispatch_backward)
//   reduce [R][kReduceBytes]            all_reduce_sum of small buffers (larger ones use rows)
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/host_device.h"
#include "epx/comm.h"

namespace epx {

struct RowMeta {
  int32_t local_expert;  // -1: this slot's expert lives on another rank (or the slot is masked)
  int32_t position;      // index among the source's pairs to that expert (its order in the segment)
  double weight;         // topk weight (dispatch) or its gradient (dispatch_backward); fp32 values
                         // travel exactly, fp64 ones (reference gradient checks) too
};

// The signal area after a zero-copy window's layout: the barrier inboxes (R words, padded to 256
// bytes), then the overlapped kernels' arrival counters, [source][chunk of kArrivalChunk slots],
// then the last-block ticket, the combine's item counter and the count of prepares (whose parity
// picks the header copy, WindowLayout::header_offset).
constexpr int kArrivalChunk = 8;
EPX_HOST_DEVICE inline size_t inbox_bytes(int R) { return (static_cast<size_t>(R) * 4 + 255) / 256 * 256; }
EPX_HOST_DEVICE inline int arrival_chunks(int max_tokens) { return (max_tokens + kArrivalChunk - 1) / kArrivalChunk; }
EPX_HOST_DEVICE inline size_t arrival_bytes(int R, int max_tokens) {
  return static_cast<size_t>(R) * arrival_chunks(max_tokens) * sizeof(uint32_t);
}
EPX_HOST_DEVICE inline size_t signal_area_bytes(int R, int max_tokens) {
  return inbox_bytes(R) + arrival_bytes(R, max_tokens) + 3 * sizeof(uint32_t);
}
/// The signal area as allocated after the layout: rounded up to 256 bytes.
EPX_HOST_DEVICE inline size_t signal_bytes(int R, int max_tokens) {
  return (signal_area_bytes(R, max_tokens) + 255) / 256 * 256;
}

struct WindowLayout {
  static constexpr size_t kReduceBytes = 64 * 1024;
  int num_ranks = 0;
  int local_experts = 0;
  int max_tokens = 0;
  int max_topk = 0;
  size_t header_ints = 0;  // per source: local_experts + 2
  size_t row_bytes = 0;    // hidden * max dtype size, rounded up to 16 bytes
  size_t header = 0, meta = 0, rows = 0, reduce = 0, total = 0;

  static WindowLayout make(const GroupConfig& c, int num_ranks) {
    auto up = [](size_t n, size_t a) { return (n + a - 1) / a * a; };
    WindowLayout w;
    w.num_ranks = num_ranks;
    w.local_experts = c.num_experts / num_ranks;
    w.max_tokens = c.max_tokens_per_rank;
    w.max_topk = c.max_topk;
    w.header_ints = static_cast<size_t>(w.local_experts) + 2;
    w.row_bytes = up(static_cast<size_t>(c.hidden) * dtype_size(c.max_dtype), 16);
    w.header = 0;
    w.meta = up(w.header + num_ranks * w.header_ints * sizeof(int32_t), 256);
    w.rows = up(w.meta + static_cast<size_t>(num_ranks) * w.max_tokens * w.max_topk * sizeof(RowMeta), 256);
    w.reduce = up(w.rows + static_cast<size_t>(num_ranks) * w.max_tokens * w.row_bytes, 256);
    w.total = w.reduce + static_cast<size_t>(num_ranks) * kReduceBytes;
    return w;
  }
  /// Bytes of one rank's zero-copy window: the layout, the signal area, then the second copy of the
  /// header region (odd prepares).
  size_t window_bytes() const { return odd_header() + header_region_bytes(); }
  /// Bytes of each of the staged transport's two buffers (send, receive): the header, meta and rows
  /// regions (all-reduce chunks travel in the rows regions).
  size_t staging_bytes() const { return reduce; }
  /// Region [src] of the header. Zero-copy prepares alternate between two copies (parity 0: the one
  /// at the start of the layout, which the staged transport and the reference use; 1: after the
  /// signal area), so that a rank writing prepare i + 1's counts never overwrites those a peer may
  /// still be reading from prepare i, and prepare needs no barrier before it writes.
  EPX_HOST_DEVICE size_t header_offset(int src, int parity = 0) const {
    return (parity ? odd_header() : header) + src * header_ints * sizeof(int32_t);
  }
  EPX_HOST_DEVICE size_t header_region_bytes() const { return num_ranks * header_ints * sizeof(int32_t); }
  EPX_HOST_DEVICE size_t odd_header() const { return total + signal_bytes(num_ranks, max_tokens); }
  EPX_HOST_DEVICE size_t meta_offset(int src, int slot) const {
    return meta + (static_cast<size_t>(src) * max_tokens + slot) * max_topk * sizeof(RowMeta);
  }
  EPX_HOST_DEVICE size_t row_offset(int src, int slot) const { return rows + (static_cast<size_t>(src) * max_tokens + slot) * row_bytes; }
  EPX_HOST_DEVICE size_t reduce_offset(int src) const { return reduce + static_cast<size_t>(src) * kReduceBytes; }
};

}  // namespace epx
