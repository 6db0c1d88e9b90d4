// Device-side pieces shared by the EP kernels (ep_kernels.cu) and the overlapped zero-copy dispatch
// (dispatch_overlap.cu): launch geometry, where each rank's mailboxes and receive area are, and the
// arguments of the row-sending and row-expanding phases. Included by CUDA sources only.
#pragma once

#include <cstdint>

#include "comm/ep_kernels.h"
#include "comm/signal.cuh"

namespace epx::comm::ep_device {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;
constexpr int kReduceUnroll = 2;
constexpr int kSendUnroll = 8;
constexpr int kMaxK = 32;
constexpr int kMaxR = 64;

// The signal area after the window's layout: the barrier inboxes (R words, padded to 256 bytes),
// then the arrival counters of the overlapped dispatch, [source][chunk of kArrivalChunk slots].
constexpr int kArrivalChunk = 8;
__host__ __device__ inline size_t inbox_bytes(int R) { return (static_cast<size_t>(R) * 4 + 255) / 256 * 256; }
__host__ __device__ inline int arrival_chunks(int max_tokens) { return (max_tokens + kArrivalChunk - 1) / kArrivalChunk; }
__host__ __device__ inline size_t arrival_bytes(int R, int max_tokens) {
  return static_cast<size_t>(R) * arrival_chunks(max_tokens) * sizeof(uint32_t);
}

__host__ __device__ inline SignalArgs signal_of(const DeviceGroup& g) {
  return SignalArgs{g.peer_inbox, g.my_inbox, g.epoch, g.status, g.rank, g.R, g.timeout_ns};
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
  bool with_meta;             // dispatch writes the routing meta; combine_backward does not
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

/// The overlapped zero-copy dispatch (dispatch_overlap.cu): EPX_DISPATCH_KERNEL=phased turns it off.
bool overlapped_dispatch_enabled();
/// Launches it after the before-write barrier; false (nothing launched) where the grid could not be
/// resident at once or the shape is outside its limits, then the caller runs the phased path.
bool launch_overlapped_dispatch(const SendArgs& sa, const ExpandArgs& ea, bool vec, cudaStream_t stream);

}  // namespace epx::comm::ep_device
