// The dense and grouped GEMM references: gemm against a naive triple loop in double (every
// transpose combination, accumulate, every data dtype) and against the documented fp32 chain bit
// for bit; the grouped ops against per-group dense gemm on random padded layouts (empty and
// single-row groups, align 1/4/16, slack rows past offsets[G] that must keep their sentinel);
// bf16 within 1e-2 relative of double; bad offsets / rows and bad arguments as clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/error_text.h"
#include "epx/error.h"
#include "epx/grouped_gemm.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx {
namespace {

using testing::what_of;

constexpr double kSentinel = -1000.0;  // exactly representable in every data dtype

Tensor random_tensor(Shape shape, DType dt, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dt);
  std::normal_distribution<double> n(0, 1);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, n(rng));
  return t;
}

std::vector<double> values(const TensorRef& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = load_as_double(t.data(), t.dtype(), i);
  return v;
}

// A [rows, cols] view of a sub-matrix starting at element `offset` of t.
TensorRef sub(const TensorRef& t, int64_t offset, Shape shape) {
  return TensorRef(static_cast<char*>(t.data()) + offset * dtype_size(t.dtype()), t.dtype(), shape, t.device());
}

bool same_bits(const TensorRef& a, const TensorRef& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

// ---- gemm --------------------------------------------------------------------------------------

// c[m, n] = sum_k op(a)[m, k] op(b)[k, n] in double, with op(a) read from a's storage directly.
std::vector<double> naive_gemm(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t N,
                               int64_t K, bool ta, bool tb) {
  std::vector<double> c(static_cast<size_t>(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += (ta ? a[k * M + m] : a[m * K + k]) * (tb ? b[n * K + k] : b[k * N + n]);
      c[m * N + n] = s;
    }
  return c;
}

TEST(Gemm, MatchesNaiveTripleLoopForEveryTransposeAndAccumulate) {
  std::mt19937 rng(7);
  const int64_t M = 13, N = 11, K = 37;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64})
    for (DType ct : {DType::kF32, dt})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int acc = 0; acc < 2; ++acc) {
            if (acc && ct != DType::kF32 && ct != DType::kF64) continue;
            Tensor a = random_tensor(ta ? Shape{K, M} : Shape{M, K}, dt, rng);
            Tensor b = random_tensor(tb ? Shape{N, K} : Shape{K, N}, dt, rng);
            Tensor c = random_tensor({M, N}, ct, rng);
            const std::vector<double> old = values(c);
            gemm(a, b, c, ta, tb, acc);
            std::vector<double> want = naive_gemm(values(a), values(b), M, N, K, ta, tb);
            const bool f64 = dt == DType::kF64 && ct == DType::kF64;
            // fp32 accumulation of K = 37 unit normals: ~1e-6 relative; a narrow c adds its rounding.
            const double rtol = f64 ? 1e-13 : (ct == DType::kF32 ? 1e-5 : 1e-2);
            for (int64_t i = 0; i < M * N; ++i) {
              if (acc) want[i] += old[i];
              ASSERT_NEAR(c.item(i), want[i], rtol * (std::fabs(want[i]) + 1.0))
                  << "a " << dtype_name(dt) << " c " << dtype_name(ct) << " ta=" << ta << " tb=" << tb
                  << " acc=" << acc << " at " << i;
            }
          }
}

TEST(Gemm, IsOneAscendingFp32ChainRoundedOnce) {
  std::mt19937 rng(3);
  const int64_t M = 5, N = 6, K = 40;
  Tensor a = random_tensor({M, K}, DType::kBF16, rng), b = random_tensor({K, N}, DType::kBF16, rng);
  Tensor c = Tensor::empty({M, N}, DType::kBF16), c32 = random_tensor({M, N}, DType::kF32, rng);
  Tensor c32_old = c32.clone();
  gemm(a, b, c);
  gemm(a, b, c32, false, false, /*accumulate=*/true);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += static_cast<float>(a.item(m * K + k)) * static_cast<float>(b.item(k * N + n));
      EXPECT_EQ(c.item(m * N + n), round_to_dtype(s, DType::kBF16)) << m << ", " << n;
      // accumulate: old + finished sum, one fp32 addition
      EXPECT_EQ(c32.item(m * N + n), static_cast<double>(static_cast<float>(c32_old.item(m * N + n)) + s));
    }
}

TEST(Gemm, EmptyDimensions) {
  Tensor a = Tensor::empty({3, 0}, DType::kF32), b = Tensor::empty({0, 4}, DType::kF32);
  Tensor c = Tensor::full({3, 4}, DType::kF32, 5.0);
  gemm(a, b, c, false, false, true);  // K = 0, accumulate: unchanged
  for (int i = 0; i < 12; ++i) EXPECT_EQ(c.item(i), 5.0);
  gemm(a, b, c);  // K = 0: zeros
  for (int i = 0; i < 12; ++i) EXPECT_EQ(c.item(i), 0.0);
  Tensor a0 = Tensor::empty({0, 5}, DType::kF32), b0 = Tensor::full({5, 2}, DType::kF32, 1.0);
  Tensor c0 = Tensor::empty({0, 2}, DType::kF32);
  EXPECT_NO_THROW(gemm(a0, b0, c0));
}

TEST(Gemm, ValidatesArguments) {
  Tensor a = Tensor::zeros({4, 6}, DType::kBF16), b = Tensor::zeros({6, 5}, DType::kBF16);
  Tensor c = Tensor::zeros({4, 5}, DType::kF32), cb = Tensor::zeros({4, 5}, DType::kBF16);
  EXPECT_NO_THROW(gemm(a, b, c));
  EXPECT_NO_THROW(gemm(a, b, cb));
  EXPECT_EQ(what_of([&] { gemm(a, b, c, false, true); }), "epx::gemm: b has shape [6, 5], expected [*, 6]");
  EXPECT_EQ(what_of([&] { gemm(a, b, c, true, false); }), "epx::gemm: b has shape [6, 5], expected [4, *]");
  Tensor c_bad = Tensor::zeros({5, 4}, DType::kF32);
  EXPECT_EQ(what_of([&] { gemm(a, b, c_bad); }), "epx::gemm: c has shape [5, 4], expected [4, 5]");
  Tensor b32 = Tensor::zeros({6, 5}, DType::kF32);
  EXPECT_EQ(what_of([&] { gemm(a, b32, c); }), "epx::gemm: b has dtype fp32, expected bf16");
  Tensor ch = Tensor::zeros({4, 5}, DType::kF16);
  EXPECT_EQ(what_of([&] { gemm(a, b, ch); }), "epx::gemm: c has dtype fp16, expected fp32 or bf16");
  EXPECT_NE(what_of([&] { gemm(a, b, cb, false, false, true); }).find("accumulate needs an fp32 c"), std::string::npos);
  Tensor a8 = Tensor::zeros({4, 6}, DType::kF8E4M3);
  EXPECT_NE(what_of([&] { gemm(a8, b, c); }).find("a has dtype fp8_e4m3"), std::string::npos);
  EXPECT_NE(what_of([&] { gemm(TensorRef(), b, c); }).find("a is missing"), std::string::npos);
  // Device consistency is checked before anything runs (no data is touched).
  TensorRef cuda_c(c.data(), DType::kF32, {4, 5}, Device::cuda(0));
  EXPECT_EQ(what_of([&] { gemm(a, b, cuda_c); }), "epx::gemm: c is on cuda:0, expected cpu");
}

// ---- grouped GEMM ------------------------------------------------------------------------------

struct Layout {
  std::vector<int32_t> rows, offsets;
  int64_t total = 0;  // offsets[G] + slack
  Tensor rows_t, offsets_t;
};

Layout make_layout(const std::vector<int>& sizes, int align, int slack) {
  Layout L;
  L.offsets.push_back(0);
  for (int n : sizes) {
    L.rows.push_back(n);
    L.offsets.push_back(L.offsets.back() + (n + align - 1) / align * align);
  }
  L.total = L.offsets.back() + slack;
  const int64_t G = static_cast<int64_t>(sizes.size());
  L.rows_t = Tensor::empty({G}, DType::kI32);
  L.offsets_t = Tensor::empty({G + 1}, DType::kI32);
  std::memcpy(L.rows_t.data(), L.rows.data(), L.rows.size() * 4);
  std::memcpy(L.offsets_t.data(), L.offsets.data(), L.offsets.size() * 4);
  return L;
}

// Padding rows of x-like inputs get NaN: the ops must never read them.
void poison_padding(const Tensor& t, const Layout& L) {
  const int64_t W = t.numel() / (t.size(0) ? t.size(0) : 1);
  for (size_t j = 0; j < L.rows.size(); ++j)
    for (int64_t r = L.offsets[j] + L.rows[j]; r < L.offsets[j + 1]; ++r)
      for (int64_t i = 0; i < W; ++i) store_from_double(t.data(), t.dtype(), r * W + i, NAN);
}

// Rows of an output: real rows equal `want` (per group), padding rows zero, slack rows sentinel.
void expect_padding_and_tail(const Tensor& out, const Layout& L, const std::string& what) {
  const int64_t W = out.size(1);
  for (size_t j = 0; j < L.rows.size(); ++j)
    for (int64_t r = L.offsets[j] + L.rows[j]; r < L.offsets[j + 1]; ++r)
      for (int64_t i = 0; i < W; ++i) ASSERT_EQ(out.item(r * W + i), 0.0) << what << ": padding row " << r;
  for (int64_t r = L.offsets.back(); r < L.total; ++r)
    for (int64_t i = 0; i < W; ++i)
      ASSERT_EQ(out.item(r * W + i), kSentinel) << what << ": row " << r << " past offsets[G] was written";
}

struct GroupedCase {
  std::vector<int> sizes;
  int align = 1;
  int slack = 0;
  DType dt = DType::kF32;
};

std::string describe(const GroupedCase& c) {
  std::string s = "sizes {";
  for (int n : c.sizes) s += std::to_string(n) + " ";
  return s + "} align " + std::to_string(c.align) + " slack " + std::to_string(c.slack) + " " + dtype_name(c.dt);
}

// forward, dgrad and wgrad (plain and accumulating) against per-group dense gemm, bit for bit.
void check_grouped_against_gemm(const GroupedCase& gc, uint32_t seed) {
  SCOPED_TRACE(describe(gc));
  std::mt19937 rng(seed);
  const int64_t K = 24, N = 17, G = static_cast<int64_t>(gc.sizes.size());
  const DType dt = gc.dt;
  const DType wdt = dt == DType::kF64 ? DType::kF64 : DType::kF32;
  Layout L = make_layout(gc.sizes, gc.align, gc.slack);
  const int64_t R = L.total;
  Tensor x = random_tensor({R, K}, dt, rng), dy = random_tensor({R, N}, dt, rng);
  Tensor w = random_tensor({G, K, N}, dt, rng);
  poison_padding(x, L);
  poison_padding(dy, L);
  Tensor y = Tensor::full({R, N}, dt, kSentinel), dx = Tensor::full({R, K}, dt, kSentinel);
  Tensor dw = Tensor::full({G, K, N}, wdt, kSentinel), dw_acc = random_tensor({G, K, N}, wdt, rng);
  for (int64_t j = 0; j < G; ++j) store_from_double(dw_acc.data(), wdt, j * K * N, -0.0);  // must stay -0 when empty
  Tensor dw_old = dw_acc.clone();
  grouped_gemm_forward(x, w, L.offsets_t, L.rows_t, y);
  grouped_gemm_dgrad(dy, w, L.offsets_t, L.rows_t, dx);
  grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dw);
  grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dw_acc, /*accumulate=*/true);

  for (int64_t j = 0; j < G; ++j) {
    const int64_t b = L.offsets[j], n = L.rows[j];
    const TensorRef wj = sub(w, j * K * N, {K, N});
    Tensor y_ref = Tensor::empty({n, N}, dt), dx_ref = Tensor::empty({n, K}, dt);
    Tensor dw_ref = Tensor::empty({K, N}, wdt), dw_acc_ref = Tensor::empty({K, N}, wdt);
    copy(sub(dw_old, j * K * N, {K, N}), dw_acc_ref);
    gemm(x.ref().slice_rows(b, b + n), wj, y_ref);
    gemm(dy.ref().slice_rows(b, b + n), wj, dx_ref, false, true);
    gemm(x.ref().slice_rows(b, b + n), dy.ref().slice_rows(b, b + n), dw_ref, true, false);
    gemm(x.ref().slice_rows(b, b + n), dy.ref().slice_rows(b, b + n), dw_acc_ref, true, false, true);
    EXPECT_TRUE(same_bits(y.ref().slice_rows(b, b + n), y_ref)) << "forward, group " << j;
    EXPECT_TRUE(same_bits(dx.ref().slice_rows(b, b + n), dx_ref)) << "dgrad, group " << j;
    EXPECT_TRUE(same_bits(sub(dw, j * K * N, {K, N}), dw_ref)) << "wgrad, group " << j;
    if (n == 0) {  // an empty group: zeros, or exactly unchanged when accumulating
      for (int64_t i = 0; i < K * N; ++i) ASSERT_EQ(dw.item(j * K * N + i), 0.0) << "empty group " << j;
      EXPECT_TRUE(same_bits(sub(dw_acc, j * K * N, {K, N}), sub(dw_old, j * K * N, {K, N}))) << "group " << j;
    } else {
      EXPECT_TRUE(same_bits(sub(dw_acc, j * K * N, {K, N}), dw_acc_ref)) << "wgrad accumulate, group " << j;
    }
  }
  expect_padding_and_tail(y, L, "forward");
  expect_padding_and_tail(dx, L, "dgrad");
}

std::vector<int> random_sizes(std::mt19937& rng, int G) {
  std::uniform_int_distribution<int> u(0, 9);
  std::vector<int> s(G);
  for (int& n : s) n = u(rng);
  s[rng() % G] = 0;  // always an empty group and a single-row group
  s[(rng() % G + 1) % G] = 1;
  return s;
}

TEST(GroupedGemm, MatchesPerGroupGemmOnRandomPaddedLayouts) {
  std::mt19937 rng(11);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64})
    for (int align : {1, 4, 16})
      for (int rep = 0; rep < 3; ++rep) {
        GroupedCase gc{random_sizes(rng, 5), align, static_cast<int>(rng() % 4), dt};
        check_grouped_against_gemm(gc, rng());
        if (HasFatalFailure()) return;
      }
}

TEST(GroupedGemm, EdgeLayouts) {
  const std::vector<GroupedCase> cases = {
      {{7}, 1, 0, DType::kF32},           // G = 1
      {{1}, 16, 3, DType::kBF16},         // a single row, padded
      {{0}, 1, 2, DType::kF32},           // G = 1, empty
      {{0, 0, 0}, 4, 0, DType::kF32},     // rows_total = 0
      {{0, 0, 0}, 4, 5, DType::kBF16},    // no real rows, only slack
      {{0, 12, 0, 0}, 1, 0, DType::kF32}, // all rows in one group
      {{0, 12, 0, 0}, 32, 1, DType::kF16},
  };
  uint32_t seed = 5;
  for (const GroupedCase& gc : cases) {
    check_grouped_against_gemm(gc, seed++);
    if (HasFatalFailure()) return;
  }
}

TEST(GroupedGemm, Bf16WithinOnePercentOfDouble) {
  std::mt19937 rng(21);
  const int64_t K = 96, N = 40;
  Layout L = make_layout({5, 0, 1, 23, 9}, 8, 2);
  const int64_t G = 5, R = L.total;
  Tensor x = random_tensor({R, K}, DType::kBF16, rng), dy = random_tensor({R, N}, DType::kBF16, rng);
  Tensor w = random_tensor({G, K, N}, DType::kBF16, rng);
  Tensor y = Tensor::empty({R, N}, DType::kBF16), dx = Tensor::empty({R, K}, DType::kBF16);
  Tensor dw = Tensor::empty({G, K, N}, DType::kBF16), dw32 = Tensor::empty({G, K, N}, DType::kF32);
  grouped_gemm_forward(x, w, L.offsets_t, L.rows_t, y);
  grouped_gemm_dgrad(dy, w, L.offsets_t, L.rows_t, dx);
  grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dw);
  grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dw32);
  const std::vector<double> xv = values(x), dyv = values(dy), wv = values(w);
  auto close = [](double got, double want, double rtol) { return std::fabs(got - want) <= rtol * std::fabs(want) + 1e-5; };
  for (int64_t j = 0; j < G; ++j) {
    const int64_t b = L.offsets[j], n = L.rows[j];
    const std::vector<double> wj(wv.begin() + j * K * N, wv.begin() + (j + 1) * K * N);
    const std::vector<double> xj(xv.begin() + b * K, xv.begin() + (b + n) * K);
    const std::vector<double> dyj(dyv.begin() + b * N, dyv.begin() + (b + n) * N);
    const std::vector<double> y_want = naive_gemm(xj, wj, n, N, K, false, false);
    const std::vector<double> dx_want = naive_gemm(dyj, wj, n, K, N, false, true);
    const std::vector<double> dw_want = naive_gemm(xj, dyj, K, N, n, true, false);
    for (int64_t i = 0; i < n * N; ++i) ASSERT_TRUE(close(y.item(b * N + i), y_want[i], 1e-2)) << j << ":" << i;
    for (int64_t i = 0; i < n * K; ++i) ASSERT_TRUE(close(dx.item(b * K + i), dx_want[i], 1e-2)) << j << ":" << i;
    for (int64_t i = 0; i < K * N; ++i) {
      ASSERT_TRUE(close(dw.item(j * K * N + i), dw_want[i], 1e-2)) << j << ":" << i;
      ASSERT_TRUE(close(dw32.item(j * K * N + i), dw_want[i], 1e-5)) << j << ":" << i;  // fp32 out: no bf16 rounding
    }
  }
}

TEST(GroupedGemm, BadOffsetsAndRowsAreErrorsRaisedBeforeAnyWrite) {
  const int64_t K = 4, N = 3, G = 3, R = 16;
  std::mt19937 rng(2);
  Tensor x = random_tensor({R, K}, DType::kF32, rng), w = random_tensor({G, K, N}, DType::kF32, rng);
  Tensor dy = random_tensor({R, N}, DType::kF32, rng);
  struct Bad {
    std::vector<int32_t> offsets, rows;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {{1, 4, 8, 12}, {2, 2, 2}, "offsets[0] is 1, expected 0"},
      {{0, 8, 4, 12}, {2, 0, 2}, "offsets decrease at group 1: offsets[2] = 4 < offsets[1] = 8"},
      {{0, 4, 8, 12}, {2, -2, 2}, "rows[1] is -2, expected >= 0"},
      {{0, 4, 8, 12}, {2, 5, 2}, "group 1 overflows into the next one: offsets[1] + rows[1] = 4 + 5 = 9 > offsets[2] = 8"},
      {{0, 4, 8, 20}, {2, 2, 2}, "offsets[3] is 20, more than the 16 rows of the tensors"},
      {{0, 4, 8, 2147483647}, {2, 2, 2147483647}, "group 2 overflows into the next one"},
  };
  for (const Bad& b : bad) {
    Tensor off = Tensor::empty({G + 1}, DType::kI32), rows = Tensor::empty({G}, DType::kI32);
    std::memcpy(off.data(), b.offsets.data(), 16);
    std::memcpy(rows.data(), b.rows.data(), 12);
    Tensor y = Tensor::full({R, N}, DType::kF32, kSentinel), dx = Tensor::full({R, K}, DType::kF32, kSentinel);
    Tensor dw = Tensor::full({G, K, N}, DType::kF32, kSentinel);
    const std::string f = what_of([&] { grouped_gemm_forward(x, w, off, rows, y); });
    const std::string d = what_of([&] { grouped_gemm_dgrad(dy, w, off, rows, dx); });
    const std::string g = what_of([&] { grouped_gemm_wgrad(x, dy, off, rows, dw); });
    EXPECT_EQ(f.rfind("epx::grouped_gemm_forward: " + b.message, 0), 0u) << f;
    EXPECT_EQ(d.rfind("epx::grouped_gemm_dgrad: " + b.message, 0), 0u) << d;
    EXPECT_EQ(g.rfind("epx::grouped_gemm_wgrad: " + b.message, 0), 0u) << g;
    for (int64_t i = 0; i < y.numel(); ++i) ASSERT_EQ(y.item(i), kSentinel) << b.message;
    for (int64_t i = 0; i < dx.numel(); ++i) ASSERT_EQ(dx.item(i), kSentinel) << b.message;
    for (int64_t i = 0; i < dw.numel(); ++i) ASSERT_EQ(dw.item(i), kSentinel) << b.message;
  }
}

TEST(GroupedGemm, ValidatesShapesDtypesAndDevices) {
  const int64_t G = 8, K = 512, N = 128, R = 32;
  Layout L = make_layout({4, 4, 4, 4, 4, 4, 4, 4}, 1, 0);
  Tensor x = Tensor::zeros({R, K}, DType::kBF16), w = Tensor::zeros({G, K, N}, DType::kBF16);
  Tensor y = Tensor::zeros({R, N}, DType::kBF16), dy = Tensor::zeros({R, N}, DType::kBF16);
  Tensor dx = Tensor::zeros({R, K}, DType::kBF16), dw = Tensor::zeros({G, K, N}, DType::kF32);
  EXPECT_NO_THROW(grouped_gemm_forward(x, w, L.offsets_t, L.rows_t, y));
  EXPECT_NO_THROW(grouped_gemm_dgrad(dy, w, L.offsets_t, L.rows_t, dx));
  EXPECT_NO_THROW(grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dw, true));

  Tensor w_wide = Tensor::zeros({G, K, 256}, DType::kBF16);
  EXPECT_EQ(what_of([&] { grouped_gemm_forward(x, w_wide, L.offsets_t, L.rows_t, y); }),
            "epx::grouped_gemm_forward: w has shape [8, 512, 256], expected [8, 512, 128]");
  Tensor w_t = Tensor::zeros({G, N, K}, DType::kBF16);
  EXPECT_EQ(what_of([&] { grouped_gemm_dgrad(dy, w_t, L.offsets_t, L.rows_t, dx); }),
            "epx::grouped_gemm_dgrad: w has shape [8, 128, 512], expected [8, 512, 128]");
  Tensor w32 = Tensor::zeros({G, K, N}, DType::kF32);
  EXPECT_EQ(what_of([&] { grouped_gemm_forward(x, w32, L.offsets_t, L.rows_t, y); }),
            "epx::grouped_gemm_forward: w has dtype fp32, expected bf16");
  Tensor y_short = Tensor::zeros({R - 1, N}, DType::kBF16);
  EXPECT_EQ(what_of([&] { grouped_gemm_forward(x, w, L.offsets_t, L.rows_t, y_short); }),
            "epx::grouped_gemm_forward: y has shape [31, 128], expected [32, *]");
  Tensor off7 = Tensor::zeros({8}, DType::kI32), off64 = Tensor::zeros({9}, DType::kI64);
  EXPECT_EQ(what_of([&] { grouped_gemm_forward(x, w, off7, L.rows_t, y); }),
            "epx::grouped_gemm_forward: offsets has shape [8], expected [9]");
  EXPECT_EQ(what_of([&] { grouped_gemm_forward(x, w, off64, L.rows_t, y); }),
            "epx::grouped_gemm_forward: offsets has dtype int64, expected int32");
  Tensor dw16 = Tensor::zeros({G, K, N}, DType::kF16), dwb = Tensor::zeros({G, K, N}, DType::kBF16);
  EXPECT_EQ(what_of([&] { grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dw16); }),
            "epx::grouped_gemm_wgrad: dw has dtype fp16, expected fp32 or bf16");
  EXPECT_NO_THROW(grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dwb));
  EXPECT_EQ(what_of([&] { grouped_gemm_wgrad(x, dy, L.offsets_t, L.rows_t, dwb, true); }),
            "epx::grouped_gemm_wgrad: accumulate needs an fp32 dw (fp64 for fp64 inputs), dw has dtype bf16");
  Tensor dy_rows = Tensor::zeros({R + 1, N}, DType::kBF16);
  EXPECT_EQ(what_of([&] { grouped_gemm_wgrad(x, dy_rows, L.offsets_t, L.rows_t, dw); }),
            "epx::grouped_gemm_wgrad: dy has shape [33, 128], expected [32, *]");

  TensorRef rows_gpu(L.rows_t.data(), DType::kI32, {G}, Device::cuda(0));
  EXPECT_EQ(what_of([&] { grouped_gemm_forward(x, w, L.offsets_t, rows_gpu, y); }),
            "epx::grouped_gemm_forward: rows is on cuda:0, expected cpu");
}

// ---- FP8 (DeepSeek-V3 block scales) ------------------------------------------------------------

// The FP8 reference is the dequantized operands' product (only the block-wise summation differs),
// and within FP8's error of the unquantized bf16 GEMM; the weights come back transposed with the
// 128x128 recipe's scales; padding rows are zeros, rows past the layout untouched.
TEST(GroupedGemmFp8, ReferenceIsTheDequantizedProductWithinFp8OfBf16) {
  std::mt19937 rng(41);
  const int64_t K = 256, N = 128;
  Layout L = make_layout({5, 0, 1, 23}, 8, 2);
  const int64_t G = 4, R = L.total;
  Tensor x = random_tensor({R, K}, DType::kBF16, rng), w = random_tensor({G, K, N}, DType::kBF16, rng);
  Tensor x_q = Tensor::empty({R, K}, DType::kF8E4M3), x_s = Tensor::empty({R, K / 128}, DType::kF32);
  quantize(QuantRecipe::kFp8Block1x128, x, x_q, x_s);
  Tensor w_q = Tensor::empty({G, N, K}, DType::kF8E4M3), w_s = Tensor::empty({G, K / 128, N / 128}, DType::kF32);
  quantize_grouped_weights_fp8(w, w_q, w_s);
  for (int64_t g = 0; g < G; ++g) {  // w_q[g] is quantize(w[g])^T with the same scales
    Tensor q = Tensor::empty({K, N}, DType::kF8E4M3), sc = Tensor::empty({K / 128, N / 128}, DType::kF32);
    quantize(QuantRecipe::kFp8Block128x128, sub(w, g * K * N, {K, N}), q, sc);
    ASSERT_TRUE(same_bits(sc, sub(w_s, g * (K / 128) * (N / 128), {K / 128, N / 128}))) << "scales of group " << g;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        ASSERT_EQ(static_cast<const uint8_t*>(q.data())[k * N + n],
                  static_cast<const uint8_t*>(w_q.data())[(g * N + n) * K + k]) << "code " << g << "," << k << "," << n;
  }
  Tensor y = Tensor::full({R, N}, DType::kF32, kSentinel);
  grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets_t, L.rows_t, y);
  // the dequantized operands through the fp32 grouped GEMM: w_q^T back to [K, N] per group
  Tensor xd = Tensor::empty({R, K}, DType::kF32), wd = Tensor::empty({G, K, N}, DType::kF32);
  dequantize(QuantRecipe::kFp8Block1x128, x_q, x_s, xd);
  for (int64_t g = 0; g < G; ++g) {
    Tensor q = Tensor::empty({K, N}, DType::kF8E4M3);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        static_cast<uint8_t*>(q.data())[k * N + n] = static_cast<const uint8_t*>(w_q.data())[(g * N + n) * K + k];
    dequantize(QuantRecipe::kFp8Block128x128, q, sub(w_s, g * (K / 128) * (N / 128), {K / 128, N / 128}),
               sub(wd, g * K * N, {K, N}));
  }
  Tensor yd = Tensor::full({R, N}, DType::kF32, kSentinel), yb = Tensor::full({R, N}, DType::kF32, kSentinel);
  grouped_gemm_forward(xd, wd, L.offsets_t, L.rows_t, yd);
  Tensor x32 = Tensor::empty({R, K}, DType::kF32), w32 = Tensor::empty({G, K, N}, DType::kF32);
  for (int64_t i = 0; i < x.numel(); ++i) store_from_double(x32.data(), DType::kF32, i, load_as_double(x.data(), x.dtype(), i));
  for (int64_t i = 0; i < w.numel(); ++i) store_from_double(w32.data(), DType::kF32, i, load_as_double(w.data(), w.dtype(), i));
  grouped_gemm_forward(x32, w32, L.offsets_t, L.rows_t, yb);
  const std::vector<double> a = values(y), b = values(yd), c = values(yb);
  double d_deq = 0, d_bf = 0, n_b = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d_deq += (a[i] - b[i]) * (a[i] - b[i]);
    d_bf += (a[i] - c[i]) * (a[i] - c[i]);
    n_b += c[i] * c[i];
  }
  EXPECT_LT(std::sqrt(d_deq / n_b), 1e-6) << "FP8 reference vs the dequantized product";
  EXPECT_LT(std::sqrt(d_bf / n_b), 6e-2) << "FP8 vs unquantized (e4m3 keeps 3 mantissa bits)";
  EXPECT_GT(std::sqrt(d_bf / n_b), 1e-4) << "the FP8 path must actually quantize";
  for (int64_t i = (L.offsets[1] - 3) * N; i < L.offsets[1] * N; ++i) ASSERT_EQ(a[i], 0.0) << "padding row";
  for (int64_t i = L.offsets.back() * N; i < R * N; ++i) ASSERT_EQ(a[i], kSentinel) << "row past the layout";
}

TEST(GroupedGemmFp8, ValidatesShapesAndDtypes) {
  Layout L = make_layout({3}, 4, 0);
  Tensor x_q = Tensor::zeros({4, 256}, DType::kF8E4M3), x_s = Tensor::zeros({4, 2}, DType::kF32);
  Tensor w_q = Tensor::zeros({1, 128, 256}, DType::kF8E4M3), w_s = Tensor::zeros({1, 2, 1}, DType::kF32);
  Tensor y = Tensor::zeros({4, 128}, DType::kBF16);
  EXPECT_NO_THROW(grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets_t, L.rows_t, y));
  Tensor w_q_untransposed = Tensor::zeros({1, 256, 128}, DType::kF8E4M3);
  EXPECT_EQ(what_of([&] { grouped_gemm_forward_fp8(x_q, x_s, w_q_untransposed, w_s, L.offsets_t, L.rows_t, y); }),
            "epx::grouped_gemm_forward_fp8: w_q has shape [1, 256, 128], expected [1, 128, 256]");
  Tensor x_bf = Tensor::zeros({4, 256}, DType::kBF16);
  EXPECT_EQ(what_of([&] { grouped_gemm_forward_fp8(x_bf, x_s, w_q, w_s, L.offsets_t, L.rows_t, y); }),
            "epx::grouped_gemm_forward_fp8: x_q has dtype bf16, expected fp8_e4m3");
  Tensor y_odd = Tensor::zeros({4, 100}, DType::kBF16);
  EXPECT_EQ(what_of([&] { grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets_t, L.rows_t, y_odd); }),
            "epx::grouped_gemm_forward_fp8: x_q has K = 256 and y has N = 100 columns: both must be multiples of 128 "
            "(whole scale blocks)");
  Tensor w = Tensor::zeros({2, 64, 128}, DType::kBF16), q = Tensor::zeros({2, 128, 64}, DType::kF8E4M3);
  Tensor sc = Tensor::zeros({2, 1, 1}, DType::kF32);
  EXPECT_EQ(what_of([&] { quantize_grouped_weights_fp8(w, q, sc); }),
            "epx::quantize_grouped_weights_fp8: w is [2, 64, 128]: K and N must be multiples of 128 (whole 128x128 "
            "blocks)");
  // An FFN's weights: w_in [G, H, P, F] is quantized as [G, H, P*F], with F a multiple of 128.
  std::mt19937 rng(43);
  Tensor w_in = random_tensor({2, 128, 2, 128}, DType::kBF16, rng), w_out = random_tensor({2, 128, 128}, DType::kBF16, rng);
  const Fp8ExpertWeightShapes s = fp8_expert_weight_shapes(2, 128, 2, 128);
  Tensor wi_q = Tensor::empty(s.w_in_q, DType::kF8E4M3), wi_s = Tensor::empty(s.w_in_q_scales, DType::kF32);
  Tensor wo_q = Tensor::empty(s.w_out_q, DType::kF8E4M3), wo_s = Tensor::empty(s.w_out_q_scales, DType::kF32);
  quantize_expert_weights_fp8(w_in, w_out, wi_q, wi_s, wo_q, wo_s);
  Tensor in_q = Tensor::empty(s.w_in_q, DType::kF8E4M3), in_s = Tensor::empty(s.w_in_q_scales, DType::kF32);
  Tensor out_q = Tensor::empty(s.w_out_q, DType::kF8E4M3), out_s = Tensor::empty(s.w_out_q_scales, DType::kF32);
  quantize_grouped_weights_fp8(sub(w_in, 0, {2, 128, 256}), in_q, in_s);
  quantize_grouped_weights_fp8(w_out, out_q, out_s);
  EXPECT_TRUE(same_bits(wi_q, in_q) && same_bits(wi_s, in_s)) << "w_in as [G, H, P*F]";
  EXPECT_TRUE(same_bits(wo_q, out_q) && same_bits(wo_s, out_s)) << "w_out";
  Tensor narrow = Tensor::zeros({1, 128, 2, 64}, DType::kBF16), narrow_out = Tensor::zeros({1, 64, 128}, DType::kBF16);
  EXPECT_EQ(what_of([&] { quantize_expert_weights_fp8(narrow, narrow_out, wi_q, wi_s, wo_q, wo_s); }),
            "epx::quantize_expert_weights_fp8: w_in has ffn 64: a multiple of 128 is needed (a 128x128 block may not "
            "straddle two projections)");
}

// The CPU path checks the layout alignment a caller promises (the GPU FP8 path relies on it).
TEST(GroupedGemmFp8, RowAlignIsChecked) {
  const Layout L = make_layout({4, 3}, 16, 0);
  Tensor x_q = Tensor::zeros({32, 128}, DType::kF8E4M3), y = Tensor::zeros({32, 128}, DType::kF32);
  Tensor x_s = Tensor::zeros({32, 1}, DType::kF32), w_q = Tensor::zeros({2, 128, 128}, DType::kF8E4M3);
  Tensor w_s = Tensor::zeros({2, 1, 1}, DType::kF32);
  EXPECT_NO_THROW(grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets_t, L.rows_t, y, {}, 16));
  EXPECT_EQ(what_of([&] { grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets_t, L.rows_t, y, {}, 128); }),
            "epx::grouped_gemm_forward_fp8: offsets[1] is 16, not a multiple of row_align = 128");
  EXPECT_EQ(what_of([&] { grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets_t, L.rows_t, y, {}, 0); }),
            "epx::grouped_gemm_forward_fp8: row_align is 0, expected >= 1");
}

}  // namespace
}  // namespace epx
