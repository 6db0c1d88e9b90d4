#include "moe/elementwise.h"

#include <string>
#include <vector>

#include "core/device_memory.h"
#include "core/random.h"
#include "epx/error.h"
#ifdef EPX_HAVE_CUDA
#include "cuda/elementwise/elementwise.h"
#endif

namespace epx::detail {

namespace {

// out = round(in[0] + in[1] [+ in[2]]), left to right in fp32 (fp64 when out is fp64); in[2] may be null.
void add_any(const TensorRef* const in[3], const TensorRef& out, Stream stream) {
  const TensorRef &a = *in[0], &b = *in[1];
  const TensorRef* c = in[2];
  const char* fn = "epx::add";
  require(a.numel() == out.numel() && b.numel() == out.numel() && (!c || c->numel() == out.numel()), fn, "a is ",
          a.str(), ", b is ", b.str(), c ? ", c is " + c->str() : std::string(), ", out is ", out.str(),
          ", expected equal element counts");
  require(a.device() == out.device() && b.device() == out.device() && (!c || c->device() == out.device()), fn,
          "a is on ", a.device().str(), ", b on ", b.device().str(), c ? ", c on " + c->device().str() : std::string(),
          ", out on ", out.device().str(), ", expected one device");
#ifdef EPX_HAVE_CUDA
  if (out.device().is_cuda()) return c ? cuda::add(a, b, *c, out, stream) : cuda::add(a, b, out, stream);
#endif
  (void)stream;
  const int64_t n = out.numel();
  std::vector<double> va(n), vb(n), vc(c ? n : 0);
  load_row(a.data(), a.dtype(), 0, n, va.data());
  load_row(b.data(), b.dtype(), 0, n, vb.data());
  if (c) load_row(c->data(), c->dtype(), 0, n, vc.data());
  if (out.dtype() == DType::kF64) {
    for (int64_t i = 0; i < n; ++i) {
      va[i] += vb[i];
      if (c) va[i] += vc[i];
    }
    store_row(out.data(), out.dtype(), 0, n, va.data());
  } else {
    std::vector<float> s(n);
    for (int64_t i = 0; i < n; ++i) {
      s[i] = static_cast<float>(va[i]) + static_cast<float>(vb[i]);
      if (c) s[i] += static_cast<float>(vc[i]);
    }
    store_row(out.data(), out.dtype(), 0, n, s.data());
  }
}

}  // namespace

void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream) {
  const TensorRef* in[3] = {&a, &b, nullptr};
  add_any(in, out, stream);
}

void add(const TensorRef& a, const TensorRef& b, const TensorRef& c, const TensorRef& out, Stream stream) {
  const TensorRef* in[3] = {&a, &b, &c};
  add_any(in, out, stream);
}

void fill_normal(const TensorRef& t, uint64_t seed, uint64_t stream_id, double stddev, int64_t first_index,
                 Stream stream) {
#ifdef EPX_HAVE_CUDA
  if (t.device().is_cuda()) return cuda::fill_normal(t, seed, stream_id, stddev, first_index, stream);
#endif
  for (int64_t i = 0; i < t.numel(); ++i)
    store_from_double(t.data(), t.dtype(), i,
                      stddev * counter_normal(seed, stream_id, static_cast<uint64_t>(first_index + i)));
}

void fill_zero(const TensorRef& t, Stream stream) {
#ifdef EPX_HAVE_CUDA
  if (t.device().is_cuda()) return cuda::fill_zero(t, stream);
#endif
  memset_bytes(t.data(), t.device(), 0, t.nbytes());
}

void squared_error(const TensorRef& out, const TensorRef& target, double scale, const TensorRef& d_out,
                   const TensorRef& loss, Stream stream) {
  const char* fn = "epx::squared_error";
  require(target.numel() == out.numel() && d_out.numel() == out.numel(), fn, "out is ", out.str(), ", target is ",
          target.str(), ", d_out is ", d_out.str(), ", expected equal element counts");
  require(loss.numel() == 1 && (loss.dtype() == DType::kF32 || loss.dtype() == DType::kF64), fn, "loss is ",
          loss.str(), ", expected one fp32 or fp64 element");
  require(target.device() == out.device() && d_out.device() == out.device() && loss.device() == out.device(), fn,
          "out, target, d_out and loss must be on one device");
#ifdef EPX_HAVE_CUDA
  if (out.device().is_cuda()) return cuda::squared_error(out, target, scale, d_out, loss, stream);
#endif
  const int64_t n = out.numel();
  std::vector<double> o(n), t(n);
  load_row(out.data(), out.dtype(), 0, n, o.data());
  load_row(target.data(), target.dtype(), 0, n, t.data());
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    o[i] -= t[i];
    acc += o[i] * o[i];
    o[i] *= scale;
  }
  store_row(d_out.data(), d_out.dtype(), 0, n, o.data());
  const double l = 0.5 * scale * acc;
  store_row(loss.data(), loss.dtype(), 0, 1, &l);
}

void axpy(double alpha, const TensorRef& x, const TensorRef& y, Stream stream) {
  require(x.numel() == y.numel(), "epx::axpy", "x is ", x.str(), ", y is ", y.str(), ", expected equal element counts");
  require(x.device() == y.device(), "epx::axpy", "x is on ", x.device().str(), ", y on ", y.device().str(),
          ", expected one device");
#ifdef EPX_HAVE_CUDA
  if (y.device().is_cuda()) return cuda::axpy(alpha, x, y, stream);
#endif
  const int64_t n = y.numel();
  std::vector<double> vx(n), vy(n);
  load_row(x.data(), x.dtype(), 0, n, vx.data());
  load_row(y.data(), y.dtype(), 0, n, vy.data());
  for (int64_t i = 0; i < n; ++i) vy[i] += alpha * vx[i];
  store_row(y.data(), y.dtype(), 0, n, vy.data());
}

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
