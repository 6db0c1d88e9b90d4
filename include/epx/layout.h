// Routing layout: prepare() turns topk_idx [T, K] into a Handle, the routing state of ONE layer x
// ONE in-flight microbatch.
//
// Ids: int32 or int64; -1 = masked slot ("no expert"); any other id outside [0, E) or an id
// repeated within a row is an error. Capacity: dropless by default; with capacity_factor > 0 each
// expert keeps at most ceil(cf * T * K / E) of this rank's pairs (T = this rank's tokens), chosen
// by position (token order, then slot) or by probability (largest weight first, ties by position);
// dropped pairs move no data and contribute zero. The kept routing is visible as routed_experts().
//
// A Handle is bound to the group that made it and is consumed in a fixed order: dispatch_forward
// once, then combine_forward / combine_backward / dispatch_backward any number of times. A second
// dispatch_forward on the same handle is an error, which makes sharing one handle between two
// layers (whose backward would then read the other layer's routing) impossible.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "epx/comm.h"
#include "epx/tensor.h"

namespace epx {

enum class DropPolicy : uint8_t { kByPosition, kByProbability };

struct PrepareOptions {
  float capacity_factor = 0.0f;  // 0 = dropless
  DropPolicy drop_policy = DropPolicy::kByPosition;
  /// Rows of this handle's expert-major buffers (recv_x, y, ...): 0 = the group's recv capacity;
  /// otherwise at most it, e.g. the worst case of a chunk of the tokens. A dispatch that would need
  /// more rows writes nothing and is reported (kCapacityExceeded) as a group overflow is.
  int64_t recv_capacity_rows = 0;
};

struct HandleState;

class Handle {
 public:
  Handle();
  ~Handle();
  Handle(Handle&&) noexcept;
  Handle& operator=(Handle&&) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  bool defined() const { return state_ != nullptr; }
  int num_tokens() const;
  int topk() const;
  /// Per-expert capacity in pairs (0 when dropless).
  int capacity() const;
  /// Rows of the expert-major buffers this handle's ops take (PrepareOptions::recv_capacity_rows,
  /// or the group's).
  int64_t recv_capacity_rows() const;
  bool dispatched() const;

  // Device-resident views (the group's device), valid while the handle lives.
  /// [E_local + 1] int32 padded row offsets of the local experts; [E_local] is the total row count.
  const TensorRef& expert_offsets() const;
  /// [E_local] int32 unpadded rows per local expert.
  const TensorRef& expert_rows() const;
  /// [E] int32 pairs this rank routes to each expert after dropping (n_e before the group sum).
  const TensorRef& routed_counts() const;
  /// [T, K] int32: kept expert per slot, -1 for masked or dropped.
  const TensorRef& routed_experts() const;

  /// Host copies (synchronising: for tools and tests, not hot paths).
  std::vector<int32_t> expert_offsets_host() const;
  int64_t num_recv_rows_host() const;

  HandleState& state() const;

 private:
  friend Handle prepare(Group&, const TensorRef&, const TensorRef&, const PrepareOptions&, Stream);
  explicit Handle(std::unique_ptr<HandleState> s);
  std::unique_ptr<HandleState> state_;
};

/// Collective. topk_weights [T, K] fp32 is needed only for DropPolicy::kByProbability.
Handle prepare(Group& group, const TensorRef& topk_idx, const TensorRef& topk_weights,
               const PrepareOptions& options = {}, Stream stream = {});

/// Rounds n up to a multiple of align (align > 0).
inline int64_t round_up(int64_t n, int64_t align) { return (n + align - 1) / align * align; }

}  // namespace epx
