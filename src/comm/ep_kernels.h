// Launchers of the multi-rank EP kernels (zero-copy intranode transport over NCCL symmetric
// windows reached by LSA pointers). Host-only declarations; device code in ep_kernels.cuh.
#pragma once

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

/// Everything a kernel needs to reach the group: peer windows, signals, timeouts, status.
struct DeviceGroup {
  int rank = 0, R = 1, Le = 1, E = 1, max_tokens = 0, max_topk = 0;
  int align = 1;
  int64_t recv_capacity = 0;
  WindowLayout layout;
  char* const* peer_window = nullptr;  // [R] device array: base of each rank's window (mine included)
  char* my_window = nullptr;
  uint32_t* const* peer_inbox = nullptr;  // [R] device array: inbox of each rank
  uint32_t* my_inbox = nullptr;
  uint32_t* epoch = nullptr;
  int32_t* status = nullptr;  // [kStatusWords]
  uint64_t timeout_ns = 0;
  int send_blocks = 0;  // SMs for the kernels that write across the link
};

enum OpCode : int { kOpPrepare = 1, kOpDispatch = 2, kOpCombine = 3, kOpCombineBwd = 4, kOpDispatchBwd = 5, kOpReduce = 6 };

/// Bytes of the signal area appended to the window (inboxes).
size_t signal_bytes(int num_ranks);

/// prepare, after the local layout passes: exchange the per-expert counts with every peer and
/// build the receive side (recv_pairs, recv_tokens, expert_rows/offsets, the source segment
/// starts) and the overflow word.
void exchange_counts(const DeviceGroup& g, HandleState& h, int32_t* segment_starts, Stream stream);

/// dispatch_forward: every token row (and its scale row) once per destination rank, then the
/// receiver expands into the expert-major layout.
void dispatch_rows(const DeviceGroup& g, HandleState& h, const int32_t* segment_starts, const TensorRef& x,
                   const TensorRef& x_scales, const TensorRef& topk_weights, const TensorRef& recv_x,
                   const TensorRef& recv_scales, const TensorRef& recv_weights, Stream stream);

/// combine_forward (row_weights given: weighted) and dispatch_backward (d_row_scalars given: the
/// row-weight gradients travel back too): expert-side partial sums per (source, token) written
/// into the sources' windows, then each source sums the partials of all ranks in rank order.
void reduce_rows(const DeviceGroup& g, const HandleState& h, int op_code, const TensorRef& rows_in,
                 const TensorRef& row_weights, const TensorRef& d_row_scalars, const TensorRef& out,
                 const TensorRef& d_topk_weights, Stream stream);

/// combine_backward: d_out rows once per destination rank, then the expert side spreads them to
/// the rows (times the row weight) and computes the row-weight gradients.
void spread_rows(const DeviceGroup& g, const HandleState& h, const TensorRef& d_out, const TensorRef& y,
                 const TensorRef& row_weights, const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream);

/// Sum of an fp32/fp64 buffer over the group in rank order, through the windows.
void all_reduce(const DeviceGroup& g, const TensorRef& buffer, Stream stream);

}  // namespace epx::comm
