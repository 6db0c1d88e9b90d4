// The small elementwise helpers the layer and the training demo use, on the host.
#include <gtest/gtest.h>

#include <cmath>

#include "core/random.h"
#include "epx/error.h"
#include "epx/tensor.h"
#include "moe/elementwise.h"

namespace epx {
namespace {

TEST(Elementwise, SquaredErrorLossAndGradient) {
  Tensor out = Tensor::empty({2, 3}, DType::kF32), target = Tensor::empty({2, 3}, DType::kF32);
  const float o[6] = {1, 2, 3, -1, 0.5f, 4}, t[6] = {0, 2, 1, 1, 0, 4};
  for (int i = 0; i < 6; ++i) {
    out.ptr<float>()[i] = o[i];
    target.ptr<float>()[i] = t[i];
  }
  Tensor d = Tensor::empty({2, 3}, DType::kBF16), loss = Tensor::empty({1}, DType::kF64);
  detail::squared_error(out, target, 0.5, d, loss);
  double want = 0;
  for (int i = 0; i < 6; ++i) {
    want += (o[i] - t[i]) * (o[i] - t[i]);
    EXPECT_EQ(d.item(i), round_to_dtype(0.5 * (o[i] - t[i]), DType::kBF16)) << "d_out element " << i;
  }
  EXPECT_DOUBLE_EQ(loss.item(0), 0.25 * want);
  Tensor bad = Tensor::empty({2}, DType::kF32);
  EXPECT_THROW(detail::squared_error(out, target, 1.0, d, bad), Error);
  EXPECT_THROW(detail::squared_error(out, bad, 1.0, d, loss), Error);
}

TEST(Elementwise, AxpyRoundsOnceIntoTheDestination) {
  Tensor x = Tensor::full({4}, DType::kF32, 0.3), y = Tensor::full({4}, DType::kBF16, 1.0);
  detail::axpy(-0.5, x, y);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(y.item(i), round_to_dtype(1.0 - 0.15, DType::kBF16));
  Tensor z = Tensor::full({3}, DType::kF32, 0.0);
  EXPECT_THROW(detail::axpy(1.0, x, z), Error);
}

// add(a, b, c) is add(add(a, b), c) through an fp32 partial sum: left to right, one rounding into
// each fp32 step and one into out. Values chosen so that another order or an early bf16 rounding
// gives other bits.
TEST(Elementwise, ThreeOperandAddSumsLeftToRightInFp32) {
  Tensor a = Tensor::full({3}, DType::kF32, 1.0), b = Tensor::full({3}, DType::kBF16, 0x1p-24),
         c = Tensor::full({3}, DType::kBF16, 0x1p-24);
  Tensor out = Tensor::empty({3}, DType::kF32), partial = Tensor::empty({3}, DType::kF32),
         twice = Tensor::empty({3}, DType::kF32);
  detail::add(a, b, c, out);
  detail::add(a, b, partial);
  detail::add(partial, c, twice);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out.item(i), 1.0) << "(1 + 2^-24) + 2^-24 rounds to 1 at each step in fp32";
    EXPECT_EQ(out.item(i), twice.item(i));
  }
  Tensor wide = Tensor::empty({3}, DType::kF64);
  detail::add(a, b, c, wide);
  EXPECT_EQ(wide.item(0), 1.0 + 0x1p-23) << "fp64 out sums in fp64";
  Tensor bf = Tensor::empty({3}, DType::kBF16), x = Tensor::full({3}, DType::kF32, 1.0 + 0x1p-8),
         y = Tensor::full({3}, DType::kF32, 0x1p-9);
  detail::add(x, y, y, bf);
  EXPECT_EQ(bf.item(0), round_to_dtype(1.0 + 0x1p-8 + 0x1p-8, DType::kBF16)) << "one rounding into bf16 at the end";
  Tensor short_c = Tensor::empty({2}, DType::kF32);
  EXPECT_THROW(detail::add(a, b, short_c, out), Error);
}

TEST(Elementwise, FillNormalIsTheCounterGenerator) {
  Tensor t = Tensor::empty({5, 7}, DType::kF32);
  detail::fill_normal(t, 42, 3, 0.5, 100);
  for (int64_t i = 0; i < t.numel(); ++i)
    EXPECT_EQ(t.item(i), static_cast<float>(0.5 * detail::counter_normal(42, 3, 100 + i))) << i;
  Tensor u = Tensor::empty({35}, DType::kF32);
  detail::fill_normal(u.ref().slice_rows(10, 35), 42, 3, 0.5, 110);
  for (int64_t i = 10; i < 35; ++i) EXPECT_EQ(u.item(i), t.item(i)) << "the index, not the call, decides the value";
}

}  // namespace
}  // namespace epx
