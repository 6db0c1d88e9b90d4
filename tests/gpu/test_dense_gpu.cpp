// Dense GEMM (cuBLASLt) and the elementwise helpers against the CPU reference. The GEMM's
// accumulation order differs from the reference's ascending sum: tolerance scaled to the dtype.
// add and cast are one fp32 (fp64) operation and one rounding per element: bit-exact.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "epx/error.h"
#include "epx/grouped_gemm.h"
#include "gpu/gpu_test_util.h"
#include "moe/elementwise.h"

namespace epx {
namespace {

using testing::all_close;
using testing::bit_equal;
using testing::to_gpu;
using testing::to_host;

Tensor random(Shape s, DType dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  Tensor t = Tensor::empty(s, dt);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, n(rng));
  return t;
}

TEST(DenseGpu, GemmMatchesReferenceEveryTransposeAndDtype) {
  EPX_REQUIRE_GPU();
  const int64_t M = 70, K = 130, N = 50;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType ct : {DType::kF32, dt})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int acc = 0; acc < (ct == DType::kF32 ? 2 : 1); ++acc) {
            SCOPED_TRACE(detail::concat(dtype_name(dt), "->", dtype_name(ct), " ta=", ta, " tb=", tb, " acc=", acc));
            Tensor a = random(ta ? Shape{K, M} : Shape{M, K}, dt, 1), b = random(tb ? Shape{N, K} : Shape{K, N}, dt, 2);
            Tensor c0 = random({M, N}, ct, 3);
            Tensor want = c0.clone();
            gemm(a, b, want, ta, tb, acc);
            Tensor got = to_gpu(c0);
            gemm(to_gpu(a), to_gpu(b), got, ta, tb, acc);
            const double tol = dt == DType::kF32 && ct == DType::kF32 ? 1e-4 : 2e-2;
            EXPECT_TRUE(all_close(got, want, tol, tol));
          }
}

TEST(DenseGpu, AddAndCastAreBitExact) {
  EPX_REQUIRE_GPU();
  Tensor a = random({1000}, DType::kF32, 4), b = random({1000}, DType::kBF16, 5);
  Tensor want = Tensor::empty({1000}, DType::kBF16), got = to_gpu(Tensor::full({1000}, DType::kBF16, 9));
  detail::add(a, b, want);
  detail::add(to_gpu(a), to_gpu(b), got);
  EXPECT_TRUE(bit_equal(got, want));
  Tensor cw = Tensor::empty({1000}, DType::kF16), cg = to_gpu(Tensor::full({1000}, DType::kF16, 9));
  detail::cast(a, cw);
  detail::cast(to_gpu(a), cg);
  EXPECT_TRUE(bit_equal(cg, cw));
}

// Every fp32/bf16 mix of two and three operands and of casts, on the 8-wide path (1024 elements)
// and on the generic one (1001 elements; and rows starting off a 32-byte boundary), against the host;
// axpy likewise.
TEST(DenseGpu, AddAndCastFastPathsAreBitExact) {
  EPX_REQUIRE_GPU();
  const DType types[2] = {DType::kF32, DType::kBF16};
  for (int64_t n : {int64_t{1024}, int64_t{1001}}) {
    for (int64_t skip : {int64_t{0}, int64_t{1}}) {
      for (int mix = 0; mix < 16; ++mix) {
        const DType ta = types[mix & 1], tb = types[(mix >> 1) & 1], tc = types[(mix >> 2) & 1],
                    to = types[(mix >> 3) & 1];
        SCOPED_TRACE("n " + std::to_string(n) + ", offset " + std::to_string(skip) + ", dtypes " +
                     dtype_name(ta) + " " + dtype_name(tb) + " " + dtype_name(tc) + " -> " + dtype_name(to));
        Tensor a = random({n + skip}, ta, 10 + mix), b = random({n + skip}, tb, 30 + mix),
               c = random({n + skip}, tc, 50 + mix);
        Tensor ga = to_gpu(a), gb = to_gpu(b), gc = to_gpu(c);
        auto part = [&](const Tensor& t) { return t.ref().slice_rows(skip, n + skip); };
        for (int operands = 1; operands <= 3; ++operands) {
          Tensor want = Tensor::empty({n}, to), got = to_gpu(Tensor::full({n}, to, 9));
          if (operands == 1) {
            detail::cast(part(a), want);
            detail::cast(part(ga), got);
          } else if (operands == 2) {
            detail::add(part(a), part(b), want);
            detail::add(part(ga), part(gb), got);
          } else {
            detail::add(part(a), part(b), part(c), want);
            detail::add(part(ga), part(gb), part(gc), got);
          }
          EXPECT_TRUE(bit_equal(got, want)) << operands << " operand(s)";
        }
        Tensor y = random({n + skip}, to, 70 + mix), gy = to_gpu(y);
        detail::axpy(-0.37, part(a), part(y));
        detail::axpy(-0.37, part(ga), part(gy));
        EXPECT_TRUE(bit_equal(gy, y)) << "axpy";
      }
    }
  }
}

}  // namespace
}  // namespace epx
