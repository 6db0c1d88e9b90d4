// A Shape from any sequence of extents (a Python list, XLA's buffer dimensions): the one place the
// bindings turn a framework's dims into epx's fixed-rank Shape.
#pragma once

#include <cstdint>
#include <iterator>

#include "epx/error.h"
#include "epx/tensor.h"

namespace epx {

template <class Dims>
Shape shape_of(const Dims& dims, const char* fn) {
  const auto n = static_cast<size_t>(std::size(dims));
  require(n <= static_cast<size_t>(kMaxDims), fn, "a tensor has ", n, " dimensions, at most ", kMaxDims,
          " are supported");
  int64_t d[kMaxDims] = {};
  size_t i = 0;
  for (const auto v : dims) d[i++] = static_cast<int64_t>(v);
  switch (n) {
    case 0: return Shape{};
    case 1: return Shape{d[0]};
    case 2: return Shape{d[0], d[1]};
    case 3: return Shape{d[0], d[1], d[2]};
    default: return Shape{d[0], d[1], d[2], d[3]};
  }
}

}  // namespace epx
