// Small elementwise helpers the layer needs between the big ops (device-dispatched like them).
#pragma once

#include "epx/tensor.h"

namespace epx::detail {

/// out = round(a + b) elementwise; a, b, out have one element count, any float dtypes; out may alias a.
void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream = {});
/// Sets every element to zero.
void fill_zero(const TensorRef& t, Stream stream = {});

}  // namespace epx::detail

namespace epx::detail {
/// dst = round(src) elementwise into dst's dtype (equal element counts).
void cast(const TensorRef& src, const TensorRef& dst, Stream stream = {});
}  // namespace epx::detail
