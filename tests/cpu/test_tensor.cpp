#include <gtest/gtest.h>

#include <thread>

#include "core/device_memory.h"
#include "core/gemm_sm_limit.h"
#include "epx/error.h"
#include "epx/tensor.h"

namespace epx {

TEST(Tensor, ShapeAndViews) {
  Tensor t = Tensor::zeros({4, 3}, DType::kF32);
  EXPECT_EQ(t.numel(), 12);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.shape().str(), "[4, 3]");
  TensorRef rows = t.ref().slice_rows(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.ptr<float>(), t.ptr<float>() + 3);
  EXPECT_EQ(t.ref().view({12}).shape(), Shape{12});
  EXPECT_THROW(t.ref().view({5}), Error);
  EXPECT_THROW(t.ref().slice_rows(2, 5), Error);
}

TEST(Tensor, FullCloneAndItem) {
  Tensor t = Tensor::full({5}, DType::kBF16, 1.5);
  Tensor c = t.clone();
  EXPECT_NE(c.data(), t.data());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(c.item(i), 1.5);
  EXPECT_THROW(t.item(5), Error);
}

TEST(Tensor, DeviceMemoryWithoutAGpuIsAClearError) {
  if (detail::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: device memory works here";
  try {
    Tensor::empty({4}, DType::kF32, Device::cuda(0));
    FAIL() << "expected an error";
  } catch (const Error& e) {
#ifdef EPX_HAVE_CUDA
    EXPECT_EQ(e.status(), Status::kCudaError);
    EXPECT_NE(std::string(e.what()).find("cannot allocate 16 bytes on cuda:0"), std::string::npos) << e.what();
#else
    EXPECT_EQ(e.status(), Status::kNotSupported);
    EXPECT_NE(std::string(e.what()).find("without the CUDA backend"), std::string::npos) << e.what();
#endif
  }
}

TEST(Tensor, CopyChecksDtypeAndSize) {
  Tensor a = Tensor::zeros({4}, DType::kF32), b = Tensor::zeros({4}, DType::kI32), c = Tensor::zeros({3}, DType::kF32);
  EXPECT_THROW(copy(a, b), Error);
  EXPECT_THROW(copy(a, c), Error);
  Tensor d = Tensor::full({4}, DType::kF32, 2.0);
  copy(d, a);
  EXPECT_EQ(a.item(3), 2.0);
}

// The GEMM SM limit is per thread and per scope: nested scopes restore the outer value, 0 lifts it,
// and another thread never sees it.
TEST(CoreScopes, GemmSmLimitNestsAndStaysOnItsThread) {
  EXPECT_EQ(detail::gemm_sm_limit(), 0);
  {
    const detail::GemmSmLimit outer(100);
    EXPECT_EQ(detail::gemm_sm_limit(), 100);
    {
      const detail::GemmSmLimit none(0);
      EXPECT_EQ(detail::gemm_sm_limit(), 0);
      const detail::GemmSmLimit negative(-3);
      EXPECT_EQ(detail::gemm_sm_limit(), 0);
    }
    EXPECT_EQ(detail::gemm_sm_limit(), 100);
    int seen = -1;
    std::thread([&] { seen = detail::gemm_sm_limit(); }).join();
    EXPECT_EQ(seen, 0);
  }
  EXPECT_EQ(detail::gemm_sm_limit(), 0);
}

}  // namespace epx
