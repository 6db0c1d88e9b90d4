// Elementwise helpers on the GPU (the layer's sums and casts between the big ops).
#pragma once

#include "epx/tensor.h"

namespace epx::cuda {

/// out = round(a + b) computed in fp32 (fp64 if any side is fp64); equal element counts.
void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream);
/// dst = round(src).
void cast(const TensorRef& src, const TensorRef& dst, Stream stream);

}  // namespace epx::cuda
