// Device-side prepare: from topk_idx to the routing state of a Handle, with no host
// synchronisation (every count stays on the device, so prepare can be captured in a CUDA graph).
//
// The handle's tensors live in one device block of fixed size (from the group's maxima), carved by
// bind_handle, so handles can be pooled and a captured graph keeps its addresses.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/ep_state.h"
#include "epx/comm.h"
#include "epx/layout.h"
#include "epx/tensor.h"

namespace epx::cuda {

/// Which implementation prepare_send_side runs: one fused launch (default) or the earlier three
/// launches (EPX_LAYOUT_KERNEL=legacy, read once). Both give the same bits; the switch exists so
/// that a GPU run (and the tests) can compare them.
enum class LayoutKernel : int { kFused = 0, kLegacy = 1 };
void set_layout_kernel(LayoutKernel k);
LayoutKernel layout_kernel_in_use();

/// Bytes of device memory one handle of this group needs (routing state + prepare scratch).
size_t handle_block_bytes(const GroupConfig& config, int num_ranks);

/// Points the handle's tensors into `block` (handle_block_bytes bytes on `device`) for T tokens.
void bind_handle(HandleState& h, void* block, const GroupConfig& config, int num_ranks, int rank, Device device);

/// [E_local, R] scratch of a bound handle: where source s's run starts inside local expert j's
/// segment (filled by the multi-rank count exchange).
int32_t* handle_segment_starts(const HandleState& h);

/// Send side of prepare: validates ids (bad slots are masked and recorded in h.status), applies
/// the capacity, and fills routed_experts, pair_pos, routed_counts, token_slot and send_tokens.
/// With `local` (a group of one rank) the receive side is filled too: recv_pairs, recv_tokens,
/// expert_rows, expert_offsets (padded to align) and the overflow word of h.status against
/// recv_capacity_rows.
/// group_status ([5] int32 on the device, or null) accumulates the first error of any handle.
void prepare_send_side(HandleState& h, const TensorRef& topk_idx, const TensorRef& topk_weights,
                       const PrepareOptions& options, bool local, int align, int64_t recv_capacity_rows,
                       int32_t* group_status, Stream stream);

}  // namespace epx::cuda
