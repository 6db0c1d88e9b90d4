// Helpers for the GPU tests: skip cleanly without a GPU, move tensors, and compare with the CPU
// oracle printing the first mismatches with their indices.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "core/device_memory.h"
#include "epx/tensor.h"

#define EPX_REQUIRE_GPU()                                                                     \
  do {                                                                                        \
    if (::epx::detail::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: GPU test skipped"; \
  } while (0)

namespace epx::testing {

inline Tensor to_gpu(const TensorRef& host, int device = 0) {
  Tensor t = Tensor::empty(host.shape(), host.dtype(), Device::cuda(device));
  copy(host, t);
  return t;
}

inline Tensor to_host(const TensorRef& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  copy(t, h);
  return h;
}

/// |got - want| <= atol + rtol * |want| elementwise (NaN matches NaN only); reports the first few.
inline ::testing::AssertionResult all_close(const TensorRef& got_any, const TensorRef& want_any, double atol, double rtol,
                                            int max_report = 8) {
  Tensor got = to_host(got_any), want = to_host(want_any);
  if (got.numel() != want.numel())
    return ::testing::AssertionFailure() << "sizes differ: got " << got.ref().str() << ", want " << want.ref().str();
  std::ostringstream os;
  int64_t bad = 0;
  double worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item(i), w = want.item(i);
    const bool ok = (std::isnan(g) && std::isnan(w)) || (g == w) || std::fabs(g - w) <= atol + rtol * std::fabs(w);
    if (!ok) {
      if (bad < max_report) os << "\n  [" << i << "] got " << g << ", want " << w << " (diff " << g - w << ")";
      worst = std::max(worst, std::fabs(g - w));
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements differ (atol " << atol << ", rtol "
                                       << rtol << ", worst " << worst << "):" << os.str();
}

/// Byte-for-byte equality, reporting the first differing elements.
inline ::testing::AssertionResult bit_equal(const TensorRef& got_any, const TensorRef& want_any, int max_report = 8) {
  Tensor got = to_host(got_any), want = to_host(want_any);
  if (got.nbytes() != want.nbytes() || got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << "got " << got.ref().str() << ", want " << want.ref().str();
  const size_t es = dtype_size(got.dtype());
  std::ostringstream os;
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(got.data()) + i * es, static_cast<const char*>(want.data()) + i * es, es)) {
      if (bad < max_report) os << "\n  [" << i << "] got " << got.item(i) << ", want " << want.item(i);
      ++bad;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements differ bitwise:" << os.str();
}

}  // namespace epx::testing
