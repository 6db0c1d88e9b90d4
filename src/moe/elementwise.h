// Small elementwise helpers the layer needs between the big ops (device-dispatched like them).
#pragma once

#include "epx/tensor.h"

namespace epx::detail {

/// out = round(a + b) elementwise; a, b, out have one element count, any float dtypes; out may alias a.
void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream = {});
/// out = round((a + b) + c), summed as add does (one pass over the four tensors).
void add(const TensorRef& a, const TensorRef& b, const TensorRef& c, const TensorRef& out, Stream stream = {});
/// t[i] = round(stddev * counter_normal(seed, stream_id, first_index + i)) on t's device: the
/// same values on the CPU and the GPU (up to the last bit of the device's log/cos).
void fill_normal(const TensorRef& t, uint64_t seed, uint64_t stream_id, double stddev, int64_t first_index = 0,
                 Stream stream = {});
/// Sets every element to zero (stream-ordered on a GPU).
void fill_zero(const TensorRef& t, Stream stream = {});
/// The squared-error loss of a regression target and its gradient: d_out = round(scale * (out -
/// target)), loss [1] (fp32 or fp64) = 0.5 * scale * sum((out - target)^2) in a fixed order.
void squared_error(const TensorRef& out, const TensorRef& target, double scale, const TensorRef& d_out,
                   const TensorRef& loss, Stream stream = {});
/// y = round(y + alpha * x), e.g. an SGD step p -= lr * g with alpha = -lr.
void axpy(double alpha, const TensorRef& x, const TensorRef& y, Stream stream = {});

}  // namespace epx::detail

namespace epx::detail {
/// dst = round(src) elementwise into dst's dtype (equal element counts).
void cast(const TensorRef& src, const TensorRef& dst, Stream stream = {});
}  // namespace epx::detail
