#include "moe/elementwise.h"

#include <vector>

#include "core/device_memory.h"
#include "epx/error.h"
#ifdef EPX_HAVE_CUDA
#include "cuda/elementwise/elementwise.h"
#endif

namespace epx::detail {

void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream) {
  require(a.numel() == b.numel() && a.numel() == out.numel(), "epx::add", "a is ", a.str(), ", b is ", b.str(),
          ", out is ", out.str(), ", expected equal element counts");
  require(a.device() == out.device() && b.device() == out.device(), "epx::add", "a is on ", a.device().str(),
          ", b on ", b.device().str(), ", out on ", out.device().str(), ", expected one device");
#ifdef EPX_HAVE_CUDA
  if (out.device().is_cuda()) return cuda::add(a, b, out, stream);
#endif
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

void cast(const TensorRef& src, const TensorRef& dst, Stream stream) {
  require(src.numel() == dst.numel(), "epx::cast", "src is ", src.str(), ", dst is ", dst.str(),
          ", expected equal element counts");
  require(src.device() == dst.device(), "epx::cast", "src is on ", src.device().str(), ", dst on ",
          dst.device().str(), ", expected one device");
#ifdef EPX_HAVE_CUDA
  if (dst.device().is_cuda()) return cuda::cast(src, dst, stream);
#endif
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
