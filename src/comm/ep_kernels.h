// Launchers of the multi-rank EP kernels, shared by both NCCL transports. Host-only declarations.
//
// Every op is  write phase -> delivery -> read phase.  The write phase puts rows (and their
// metadata) into per-peer "mailboxes"; the read phase works on this rank's receive area, which has
// the WindowLayout (region [source] holds what that source sent). The two transports differ only
// in where the mailboxes are and in what the delivery is (a Link):
//   zero-copy  the mailbox for peer p IS region [my rank] of p's symmetric window (LSA pointers),
//              the receive area is my window, and the delivery is a device barrier;
//   staged     the mailbox for peer p is region [p] of a local send buffer, the receive area is a
//              local receive buffer, and the delivery is ncclSend/ncclRecv of every region between
//              ncclGroupStart/End (rows for myself are written straight into my receive area).
// So the same per-element code runs on both: the results are bit-identical between transports.
// (Zero-copy dispatch and combine fuse the write and read phases into one launch, the readers
// waiting on per-chunk arrival counters in the window's signal area instead of a second barrier.)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/ep_state.h"
#include "core/window_layout.h"
#include "epx/tensor.h"

namespace epx::comm {

// Group status words (device memory, local to the rank), read by Group::check():
//   [0..4]  layout errors, as in the one-GPU group (overflow rows, bad pair, id, kind, K);
//           kind 3 = a peer prepared with another top-k ([1] its rank, [2] its K, [4] ours)
//   [5]     peers that never arrived, bits 0..31;  [6] bits 32..63
//   [7]     operation code of the barrier that timed out (0 = none)
//   [8]     barrier number that timed out
constexpr int kStatusWords = 9;

/// Everything a kernel needs to reach the group: mailboxes, receive area, signals, timeouts, status.
struct DeviceGroup {
  int rank = 0, R = 1, Le = 1, E = 1, max_tokens = 0, max_topk = 0;
  int align = 1;
  int64_t recv_capacity = 0;
  WindowLayout layout;
  /// [3R] device array, the mailboxes this rank writes for peer p: [p] start of its rows region
  /// (slot i at + i * row stride of the op), [R + p] start of its meta region (max_topk RowMeta per
  /// slot), [2R + p] its header (header_ints int32).
  char* const* out = nullptr;
  /// This rank's receive area (WindowLayout): zero-copy its window, staged its receive buffer.
  char* my_window = nullptr;
  // Zero-copy only (null on the staged transport): peers' windows and the barrier inboxes.
  char* const* peer_window = nullptr;  // [R] device array: base of each rank's window (mine included)
  uint32_t* const* peer_inbox = nullptr;  // [R] device array: inbox of each rank
  uint32_t* my_inbox = nullptr;
  uint32_t* epoch = nullptr;
  int32_t* status = nullptr;  // [kStatusWords]
  uint64_t timeout_ns = 0;
  int send_blocks = 0;  // SMs for the kernels that write across the link
  // GroupConfig::num_sms > 0: no EP launch has more blocks than this, so none occupies more SMs
  // (the rest stay free for work running beside it). 0: the link kernels get send_blocks and the
  // receive side (expansion, reduction, sums) every SM.
  int sm_budget = 0;
  // How this rank tells the peers that it has reached an op (block 0 of an overlapped launch,
  // inline_barrier_begin, and every before-write group_barrier; EPX_EP_SIGNAL): kSignalRelaxed
  // (default), kSignalRelease, kSignalFence.
  int signal_mode = 0;
};

enum SignalMode : int { kSignalRelaxed = 0, kSignalRelease = 1, kSignalFence = 2 };

/// The blocks of an EP launch that would get `auto_blocks` without a budget.
inline int budget_blocks(const DeviceGroup& g, int auto_blocks) {
  return g.sm_budget > 0 && g.sm_budget < auto_blocks ? g.sm_budget : auto_blocks;
}

enum OpCode : int { kOpPrepare = 1, kOpDispatch = 2, kOpCombine = 3, kOpCombineBwd = 4, kOpDispatchBwd = 5, kOpReduce = 6 };

/// What one delivery moves, for every peer p != me: region [p] of my mailboxes to region [me] of
/// p's receive area (and region [p] of p's mailboxes to my region [p]).
struct Delivery {
  int op_code = 0;
  int64_t row_stride = 0;  // bytes per slot of the rows regions; 0 = no rows travel
  bool meta = false;       // the meta regions travel (dispatch, dispatch_backward)
  bool header = false;     // the headers travel (prepare)
  // Staged with exact sizes: slots per peer this rank sends / receives (host arrays [R]); null:
  // whole regions (max_tokens slots).
  const int32_t* send_slots = nullptr;
  const int32_t* recv_slots = nullptr;
  // all_reduce_sum on the staged transport: these bytes of the caller's buffer go to the start of
  // region [me] of every peer's rows area (instead of the mailboxes).
  const void* chunk = nullptr;
  size_t chunk_bytes = 0;
};

/// The transport between the phases of an op.
class Link {
 public:
  virtual ~Link() = default;
  /// true (zero-copy): the phases meet at device barriers, and kernels may fuse them.
  virtual bool device_barriers() const = 0;
  /// Bytes per slot of the rows regions for rows of `bytes` bytes (payload + scales): zero-copy
  /// layout.row_bytes (the window's fixed grid), staged the bytes rounded up to 16 (only what the
  /// op needs travels; rows stay vector-aligned).
  virtual int64_t row_stride(const DeviceGroup& g, int64_t bytes) const = 0;
  /// all_reduce_sum moves the buffer in chunks of this many bytes (the same on every rank).
  virtual size_t reduce_chunk_bytes(const DeviceGroup& g) const = 0;
  /// Before the write phase (zero-copy: every peer has finished reading what it got last time).
  virtual void before_write(const DeviceGroup& g, int op_code, cudaStream_t stream) = 0;
  /// After the write phase: every mailbox reaches its reader.
  virtual void deliver(const DeviceGroup& g, const Delivery& d, cudaStream_t stream) = 0;
};

/// The zero-copy link: a device barrier (with timeout) over the windows' inboxes.
Link& barrier_link();

/// Zero-copy: fills g.out ([3R] device array `out`) from the LSA pointers in `peer_window`.
void build_zero_copy_mailboxes(const WindowLayout& layout, int rank, int num_ranks, char* const* peer_window,
                               char** out, cudaStream_t stream);

/// prepare, after the local layout passes: exchange the per-expert counts with every peer and
/// build the receive side (recv_pairs, recv_tokens, expert_rows/offsets, the source segment
/// starts) and the overflow word.
void exchange_counts(const DeviceGroup& g, Link& link, HandleState& h, int32_t* segment_starts, Stream stream);

/// dispatch_forward: every token row (and its scale row) once per destination rank, then the
/// receiver expands into the expert-major layout. Also combine_backward without row weights, which
/// is the same copy of d_out (op_code kOpCombineBwd: what a timeout then names).
void dispatch_rows(const DeviceGroup& g, Link& link, HandleState& h,
                   const int32_t* segment_starts, const TensorRef& x, const TensorRef& x_scales,
                   const TensorRef& topk_weights, const TensorRef& recv_x, const TensorRef& recv_scales,
                   const TensorRef& recv_weights, Stream stream, int op_code = kOpDispatch);

/// combine_forward (row_weights given: weighted) and dispatch_backward (d_row_scalars given: the
/// row-weight gradients travel back too): expert-side partial sums per (source, token) written
/// into the sources' mailboxes, then each source sums the partials of all ranks in rank order.
void reduce_rows(const DeviceGroup& g, Link& link, const HandleState& h, int op_code,
                 const TensorRef& rows_in, const TensorRef& row_weights, const TensorRef& d_row_scalars,
                 const TensorRef& out, const TensorRef& d_topk_weights, Stream stream);

/// The zero-copy protocol this process runs, which every rank of a group must share (checked when
/// the group is created): whether the overlapped launches hold their op's opening barrier
/// (EPX_EP_BARRIER, default inline) and whether prepare alternates between two count-header copies
/// (EPX_PREPARE_HEADERS, default two).
struct ZeroCopyProtocol {
  bool inline_barrier = true;
  bool two_header_copies = true;
};
ZeroCopyProtocol zero_copy_protocol();

/// combine_backward: d_out rows once per destination rank, then the expert side spreads them to
/// the rows (times the row weight) and computes the row-weight gradients.
void spread_rows(const DeviceGroup& g, Link& link, const HandleState& h, const TensorRef& d_out,
                 const TensorRef& y, const TensorRef& row_weights, const TensorRef& d_y,
                 const TensorRef& d_row_weights, Stream stream);

/// Sum of an fp32/fp64 buffer over the group in rank order (acc = 0, then + rank 0, 1, ...).
/// Zero-copy: a buffer that fits the windows' reduce regions in one launch; a larger one, and every
/// buffer on the staged transport, in chunks of a rows region, delivered to the rows regions of the
/// peers' windows (receive areas) and summed there (this rank's own values read from the buffer).
void all_reduce(const DeviceGroup& g, Link& link, const TensorRef& buffer, Stream stream);

}  // namespace epx::comm
