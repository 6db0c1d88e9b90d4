#include "moe/elementwise.h"

#include <vector>

#include "core/device_memory.h"
#include "epx/error.h"

namespace epx::detail {

void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream) {
  require(a.numel() == b.numel() && a.numel() == out.numel(), "epx::add", "a is ", a.str(), ", b is ", b.str(),
          ", out is ", out.str(), ", expected equal element counts");
  require(a.device().is_cpu() && b.device().is_cpu() && out.device().is_cpu(), "epx::add",
          "CUDA tensors are not supported by this op yet");
  const int64_t n = a.numel();
  std::vector<double> va(n), vb(n);
  load_row(a.data(), a.dtype(), 0, n, va.data());
  load_row(b.data(), b.dtype(), 0, n, vb.data());
  if (out.dtype() == DType::kF64) {
    for (int64_t i = 0; i < n; ++i) va[i] += vb[i];
    store_row(out.data(), out.dtype(), 0, n, va.data());
  } else {
    std::vector<float> s(n);
    for (int64_t i = 0; i < n; ++i) s[i] = static_cast<float>(va[i]) + static_cast<float>(vb[i]);
    store_row(out.data(), out.dtype(), 0, n, s.data());
  }
}

void fill_zero(const TensorRef& t, Stream) { memset_bytes(t.data(), t.device(), 0, t.nbytes()); }

}  // namespace epx::detail

namespace epx::detail {

void cast(const TensorRef& src, const TensorRef& dst, Stream) {
  require(src.numel() == dst.numel(), "epx::cast", "src is ", src.str(), ", dst is ", dst.str(),
          ", expected equal element counts");
  require(src.device().is_cpu() && dst.device().is_cpu(), "epx::cast", "CUDA tensors are not supported by this op yet");
  const int64_t n = src.numel();
  if (dst.dtype() == DType::kF64 || src.dtype() == DType::kF64) {
    std::vector<double> v(n);
    load_row(src.data(), src.dtype(), 0, n, v.data());
    store_row(dst.data(), dst.dtype(), 0, n, v.data());
  } else {
    std::vector<float> v(n);
    load_row(src.data(), src.dtype(), 0, n, v.data());
    store_row(dst.data(), dst.dtype(), 0, n, v.data());
  }
}

}  // namespace epx::detail
