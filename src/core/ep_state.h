// The state behind the public Group and Handle, shared by every backend.
//
// GroupState is the backend interface: the host reference (ranks as threads, windows as shared host
// buffers) and the NCCL backend (symmetric windows, LSA pointers) both implement it, with the same
// window layout and the same offset arithmetic, so the reference exercises in CI the logic the GPU
// kernels use. The public entry points validate arguments once, then call these methods.
//
// HandleState holds the routing of one layer x one microbatch, in the group's device memory:
//   send side  routed_experts [T,K]  kept expert per slot or -1
//              pair_pos       [T,K]  index of the pair among this rank's pairs to that expert
//              token_slot     [T,R]  row of token t in the compact list sent to rank r, or -1
//              send_tokens    [R]    tokens sent to each rank (dedup: once per rank)
//              routed_counts  [E]    kept pairs per expert
//   recv side  recv_pairs     [R,Le] pairs from source s to local expert j
//              recv_tokens    [R]    token rows received from source s
//              expert_rows    [Le]   unpadded rows per local expert
//              expert_offsets [Le+1] padded offsets; [Le] = rows in use
//              recv_row       [R, max_tokens, K] expert-major row of (source, slot, k) or -1,
//                                    written by dispatch_forward, read by the other three ops
//              status         [4]    {rows needed beyond the recv capacity (0 = fits),
//                                     first bad pair t*K+k (kNoBadPair = none), its id, 1 = out of
//                                     range / 2 = repeated in its row}; the GPU backends fill it on
//                                     the device and Group::check() turns it into an Error
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/comm.h"
#include "epx/error.h"
#include "epx/layout.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx {

constexpr int32_t kNoBadPair = 0x7f7f7f7f;  // what a byte-wise 0x7f memset leaves

struct HandleState {
  uint64_t group_id = 0;
  int num_tokens = 0;
  int topk = 0;
  int num_experts = 0;
  int num_ranks = 0;
  int local_experts = 0;
  int max_tokens = 0;
  int max_topk = 0;
  int capacity = 0;
  int64_t recv_capacity = 0;  // rows of its expert-major buffers: the group's or a smaller one
  bool dispatched = false;

  Tensor routed_experts, pair_pos, token_slot, send_tokens, routed_counts;
  Tensor recv_pairs, recv_tokens, expert_rows, expert_offsets, recv_row;
  Tensor status;
  /// Staged transport with exact sizes (GroupConfig::staged_exact_sizes): send_tokens and
  /// recv_tokens copied to the host by prepare; empty otherwise (every exchange moves whole regions).
  std::vector<int32_t> host_send_tokens, host_recv_tokens;
  /// Backend storage behind the tensors above (a pooled device block), released with the handle,
  /// and the backend's scratch inside it.
  std::shared_ptr<void> storage;
  void* scratch = nullptr;
};

struct GroupState {
  GroupConfig config;
  int rank = 0;
  int size = 1;
  int local_experts = 0;
  uint64_t id = 0;
  Device device;
  Transport transport = Transport::kHost;
  int64_t recv_capacity_rows = 0;
  /// A handle with fewer rows than recv_capacity_rows was prepared since the last check(): an
  /// overflow then names the handle's capacity, not the group's.
  bool smaller_handle_capacity = false;
  size_t registered_bytes = 0;

  virtual ~GroupState() = default;
  virtual void prepare(HandleState& h, const TensorRef& topk_idx, const TensorRef& topk_weights,
                       const PrepareOptions& options, Stream stream) = 0;
  /// x_scales / recv_scales are undefined for an unquantized dispatch.
  virtual void dispatch_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales,
                                const TensorRef& topk_weights, const TensorRef& recv_x, const TensorRef& recv_scales,
                                const TensorRef& recv_weights, Stream stream) = 0;
  /// Whether this backend quantizes while dispatching in one pass over x (the one-GPU group). Where
  /// it does not, the public dispatch_forward quantizes x into a temporary at the source and calls
  /// the quantized dispatch_forward above: the same bytes either way.
  virtual bool fuses_quantize_dispatch() const { return false; }
  /// x [T, H] fp32/bf16/fp16 quantized with `recipe` (fp8_block_1x128 or mxfp8_rowwise, H a multiple
  /// of the block; arguments validated by the caller) and dispatched: recv_x / recv_scales get
  /// exactly what quantize(recipe, x) followed by the quantized dispatch_forward would write.
  virtual void dispatch_forward_quantize(HandleState&, QuantRecipe, E8M0Rounding, const TensorRef&, const TensorRef&,
                                         const TensorRef&, const TensorRef&, const TensorRef&, Stream) {
    throw Error(Status::kNotSupported, "epx::dispatch_forward: this backend has no fused quantize-dispatch");
  }
  virtual void combine_forward(HandleState& h, const TensorRef& y, const TensorRef& row_weights,
                               const TensorRef& out, Stream stream) = 0;
  virtual void combine_backward(HandleState& h, const TensorRef& d_out, const TensorRef& y,
                                const TensorRef& row_weights, const TensorRef& d_y,
                                const TensorRef& d_row_weights, Stream stream) = 0;
  virtual void dispatch_backward(HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                                 const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream) = 0;
  virtual void all_reduce_sum(const TensorRef& buffer, Stream stream) = 0;
  virtual void check() = 0;
  /// Makes room for `handles` live handles without allocating in prepare() (where a cudaMalloc
  /// could wait for a peer's kernel that waits for this rank): called by layers that keep several.
  virtual void reserve_handles(size_t) {}
};

/// Worst-case expert-major rows one rank can receive: every token of every rank sends
/// min(K, E/R) pairs here, plus a partially filled `align` block per local expert.
int64_t worst_case_recv_rows(const GroupConfig& config, int num_ranks);

/// The message of a dispatch that would receive `needed` expert-major rows into buffers of
/// `capacity` rows (a handle's, at most the group's `group_capacity`); nothing was written.
std::string recv_overflow_message(int rank, int64_t needed, int64_t capacity, int64_t group_capacity);

/// The longest wait timeout a group takes, in seconds (a day; in nanoseconds it still fits the
/// device's 64-bit clock arithmetic with room to spare).
constexpr double kMaxTimeoutS = 86400.0;

/// The wait timeout in seconds: config.timeout_s, else EPX_TIMEOUT_S, else 10 s. A value of
/// EPX_TIMEOUT_S that is not a number in (0, kMaxTimeoutS] is an error naming the variable.
double resolved_timeout_s(const GroupConfig& config);
/// GroupConfig::staged_exact_sizes, or EPX_STAGED_SIZES (exact / fixed; other values are errors
/// naming the variable) when the config leaves it off.
bool resolved_staged_exact_sizes(const GroupConfig& config, const char* fn);

/// The transport an NCCL group is asked for: config.transport when it names one (kZeroCopy,
/// kStaged), else EPX_TRANSPORT when set (auto | zerocopy | staged), else kAuto. Read at group
/// creation. Throws an Error naming `fn` for a bad EPX_TRANSPORT value, or for kHost / kLocal
/// (backends of their own, not transports of an NCCL group).
Transport requested_transport(const GroupConfig& config, const char* fn);

/// One EPX_TRANSPORT value: "auto", "zerocopy" (or "zero-copy") or "staged"; anything else is an
/// Error naming the variable, the expected values and `value`.
Transport parse_transport(const char* value, const char* fn);

/// A process-unique id for a new group (handles remember the id of the group that made them).
uint64_t next_group_id();

}  // namespace epx
