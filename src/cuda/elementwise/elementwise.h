// Elementwise helpers on the GPU (the layer's sums and casts between the big ops).
#pragma once

#include "epx/tensor.h"

namespace epx::cuda {

/// out = round(a + b) computed in fp32 (fp64 if any side is fp64); equal element counts.
void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream);
/// out = round((a + b) + c), the same arithmetic.
void add(const TensorRef& a, const TensorRef& b, const TensorRef& c, const TensorRef& out, Stream stream);
/// dst = round(src).
void cast(const TensorRef& src, const TensorRef& dst, Stream stream);
/// t[i] = round(stddev * counter_normal(seed, stream_id, first_index + i)) (core/random.h).
void fill_normal(const TensorRef& t, uint64_t seed, uint64_t stream_id, double stddev, int64_t first_index,
                 Stream stream);
/// Stream-ordered zeroing (capturable in a CUDA graph).
void fill_zero(const TensorRef& t, Stream stream);
/// d_out = round(scale * (out - target)); loss[0] = 0.5 * scale * sum((out - target)^2), summed in
/// a fixed order (bit-identical run to run).
void squared_error(const TensorRef& out, const TensorRef& target, double scale, const TensorRef& d_out,
                   const TensorRef& loss, Stream stream);
/// y = round(y + alpha * x).
void axpy(double alpha, const TensorRef& x, const TensorRef& y, Stream stream);

}  // namespace epx::cuda
