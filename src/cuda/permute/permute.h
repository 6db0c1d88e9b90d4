// Moving rows between token order [T, H] and the expert-major padded layout on one GPU: the
// dispatch and combine of a one-rank group, and the local halves the multi-rank transports reuse.
#pragma once

#include "core/ep_state.h"
#include "epx/tensor.h"

namespace epx::cuda {

/// Largest top-k the permute kernels take (one warp lane per slot).
constexpr int kPermuteMaxTopk = 32;

/// dispatch of a one-rank group: recv_x[row(t,k)] = x[t] (and the scale row for a quantized x),
/// recv_weights[row] = topk_weights[t,k], padding rows zero; h.recv_row records row(t,k). Nothing
/// is written when the padded total exceeds recv_capacity_rows (h.status[0] says by how much).
void permute_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                     const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                     int64_t recv_capacity_rows, Stream stream);

/// combine of a one-rank group: out[t] = round(fma chain over k ascending of w_row * y[row]).
void unpermute_forward(const HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream stream);

/// combine_backward of a one-rank group: d_y[row] = round(w_row * d_out[t]) (or a copy),
/// d_row_weights[row] = <d_out[t], y[row]> (fp32, fixed reduction tree), zero padding rows.
void permute_backward(const HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                      const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream);

/// dispatch_backward of a one-rank group: d_x[t] = round(sum over k ascending of d_recv_x[row]),
/// d_topk_weights[t, k] = d_recv_weights[row] (0 for masked or dropped slots).
void unpermute_backward(const HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                        const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream);

}  // namespace epx::cuda
