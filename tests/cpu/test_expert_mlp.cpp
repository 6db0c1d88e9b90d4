// The expert FFN reference: a hand-computed tiny case per activation (with and without biases and
// early row weights), the forward's rounding contract against a composition of grouped GEMMs, the
// backward against central finite differences in fp64 for every activation x bias x early
// combination (d_x, every weight and bias gradient, d_row_weights), bf16 against fp64, padding
// rows zero and rows past offsets[G] untouched, and every argument error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include "common/error_text.h"
#include "epx/error.h"
#include "epx/grouped_gemm.h"
#include "epx/tensor.h"

namespace epx {
namespace {

using testing::what_of;

constexpr double kSentinel = -1000.0;  // exactly representable in every data dtype
constexpr Activation kActivations[] = {Activation::kSwiGLU, Activation::kGeGLU, Activation::kGelu,
                                       Activation::kRelu2};

Tensor ints(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kI32);
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}

Tensor random_tensor(Shape shape, DType dt, std::mt19937& rng, double scale = 1.0) {
  Tensor t = Tensor::empty(shape, dt);
  std::normal_distribution<double> n(0, scale);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, n(rng));
  return t;
}

Tensor converted(const Tensor& t, DType dt) {
  Tensor o = Tensor::empty(t.shape(), dt);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(o.data(), dt, i, t.item(i));
  return o;
}

struct Layout {
  std::vector<int32_t> rows, offsets;
  int64_t total = 0;  // offsets[G] + slack
  bool real(int64_t r) const {
    for (size_t j = 0; j < rows.size(); ++j)
      if (r >= offsets[j] && r < offsets[j] + rows[j]) return true;
    return false;
  }
  bool padding(int64_t r) const { return r < offsets.back() && !real(r); }
};

Layout make_layout(const std::vector<int>& sizes, int align, int slack) {
  Layout L;
  L.offsets.push_back(0);
  for (int n : sizes) {
    L.rows.push_back(n);
    L.offsets.push_back(L.offsets.back() + (n + align - 1) / align * align);
  }
  L.total = L.offsets.back() + slack;
  return L;
}

// One FFN problem with all its tensors (owned), the padding rows of its inputs poisoned with NaN
// and its outputs filled with the sentinel.
struct Problem {
  MlpConfig config;
  Layout L;
  int64_t G = 0, P = 0, H = 0, F = 0;
  bool bias = false;
  Tensor offsets, rows, x, row_weights, w_in, b_in, w_out, b_out, a, h, y;
  Tensor d_y, d_x, d_row_weights, d_w_in, d_b_in, d_w_out, d_b_out;

  MlpTensors tensors() const {
    return {x, offsets, rows, row_weights, w_in, b_in, w_out, b_out, a, h, y};
  }
  MlpGrads grads() const { return {d_y, d_x, d_row_weights, d_w_in, d_b_in, d_w_out, d_b_out}; }
};

void poison_rows(const Tensor& t, const Layout& L, double v, bool padding_only) {
  if (!t.defined() || t.size(0) == 0) return;
  const int64_t W = t.numel() / t.size(0);
  for (int64_t r = 0; r < t.size(0); ++r)
    if (!L.real(r) && (!padding_only || L.padding(r)))
      for (int64_t i = 0; i < W; ++i) store_from_double(t.data(), t.dtype(), r * W + i, v);
}

Problem make_problem(MlpConfig config, bool bias, const Layout& L, int64_t H, int64_t F, DType dt, DType gdt,
                     uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.config = config;
  p.L = L;
  p.G = static_cast<int64_t>(L.rows.size());
  p.P = is_gated(config.activation) ? 2 : 1;
  p.H = H;
  p.F = F;
  p.bias = bias;
  const int64_t R = L.total, G = p.G, P = p.P;
  const DType fdt = dt == DType::kF64 ? DType::kF64 : DType::kF32;
  p.offsets = ints(L.offsets);
  p.rows = ints(L.rows);
  p.x = random_tensor({R, H}, dt, rng);
  p.w_in = random_tensor({G, H, P, F}, dt, rng, 0.6);
  p.w_out = random_tensor({G, F, H}, dt, rng, 0.6);
  if (bias) {
    p.b_in = random_tensor({G, P, F}, dt, rng, 0.3);
    p.b_out = random_tensor({G, H}, dt, rng, 0.3);
  }
  if (config.apply_weights_early) {
    p.row_weights = Tensor::empty({R}, fdt);
    std::uniform_real_distribution<double> u(0.25, 1.0);
    for (int64_t r = 0; r < R; ++r) store_from_double(p.row_weights.data(), fdt, r, u(rng));
    p.d_row_weights = Tensor::full({R}, fdt, kSentinel);
  }
  p.a = Tensor::full({R, P, F}, dt, kSentinel);
  p.h = Tensor::full({R, F}, dt, kSentinel);
  p.y = Tensor::full({R, H}, dt, kSentinel);
  p.d_y = random_tensor({R, H}, dt, rng);
  p.d_x = Tensor::full({R, H}, dt, kSentinel);
  p.d_w_in = Tensor::full({G, H, P, F}, gdt, kSentinel);
  p.d_w_out = Tensor::full({G, F, H}, gdt, kSentinel);
  if (bias) {
    p.d_b_in = Tensor::full({G, P, F}, gdt, kSentinel);
    p.d_b_out = Tensor::full({G, H}, gdt, kSentinel);
  }
  // The ops must never read padding rows: NaN there would show in any output.
  poison_rows(p.x, L, NAN, true);
  poison_rows(p.d_y, L, NAN, true);
  poison_rows(p.row_weights, L, NAN, true);
  return p;
}

// Outputs: padding rows zero, rows past offsets[G] still the sentinel.
void expect_padding_and_tail(const Tensor& t, const Layout& L, const char* name) {
  if (!t.defined()) return;
  const int64_t W = t.size(0) ? t.numel() / t.size(0) : 0;
  for (int64_t r = 0; r < t.size(0); ++r) {
    if (L.real(r)) continue;
    const double want = L.padding(r) ? 0.0 : kSentinel;
    for (int64_t i = 0; i < W; ++i) ASSERT_EQ(t.item(r * W + i), want) << name << " row " << r;
  }
}

// ---- hand-computed tiny case --------------------------------------------------------------------

double silu_d(double z) { return z / (1 + std::exp(-z)); }
double gelu_d(double z) { return 0.5 * z * (1 + std::tanh(std::sqrt(2 / 3.14159265358979323846) * (z + 0.044715 * z * z * z))); }

double act_d(Activation f, double a0, double a1) {
  switch (f) {
    case Activation::kSwiGLU: return silu_d(a0) * a1;
    case Activation::kGeGLU: return gelu_d(a0) * a1;
    case Activation::kGelu: return gelu_d(a0);
    case Activation::kRelu2: return a0 > 0 ? a0 * a0 : 0.0;
  }
  return NAN;
}

TEST(ExpertMlp, HandComputedTinyCaseForEveryActivation) {
  // G = 2 (expert 1 empty), H = 2, F = 1, two real rows padded to 4, one slack row.
  // x0 = [1, 2], x1 = [-2, 0.5]; w_in[0, :, 0] = [0.5, 0.25]^T, w_in[0, :, 1] = [1, -1]^T (stored
  // row by row: [0.5, 1, 0.25, -1]); w_out[0] = [2, -1].
  //   acc0 = [1, -0.875], acc1 = [-1, -2.5]; with biases b_in[0] = [0.5, 0.25], b_out[0] = [0.125, -0.5]:
  //   acc0 = [1.5, -0.375], acc1 = [-0.75, -2.25].
  const Layout L = make_layout({2, 0}, 4, 1);
  for (Activation act : kActivations)
    for (bool bias : {false, true})
      for (bool early : {false, true}) {
        SCOPED_TRACE(std::string(activation_name(act)) + (bias ? " bias" : "") + (early ? " early" : ""));
        Problem p = make_problem({act, early}, bias, L, 2, 1, DType::kF32, DType::kF32, 1);
        const bool gated = is_gated(act);
        const std::vector<double> w_in = gated ? std::vector<double>{0.5, 1, 0.25, -1} : std::vector<double>{0.5, 0.25};
        const std::vector<double> x = {1, 2, -2, 0.5}, w_out = {2, -1}, rw = {0.5, 0.75};
        for (int i = 0; i < 4; ++i) store_from_double(p.x.data(), DType::kF32, i, x[i]);
        for (size_t i = 0; i < w_in.size(); ++i) store_from_double(p.w_in.data(), DType::kF32, i, w_in[i]);
        for (int i = 0; i < 2; ++i) store_from_double(p.w_out.data(), DType::kF32, i, w_out[i]);
        if (bias) {
          const std::vector<double> b_in = gated ? std::vector<double>{0.5, 0.25} : std::vector<double>{0.5};
          for (size_t i = 0; i < b_in.size(); ++i) store_from_double(p.b_in.data(), DType::kF32, i, b_in[i]);
          store_from_double(p.b_out.data(), DType::kF32, 0, 0.125);
          store_from_double(p.b_out.data(), DType::kF32, 1, -0.5);
        }
        if (early)
          for (int r = 0; r < 2; ++r) store_from_double(p.row_weights.data(), DType::kF32, r, rw[r]);
        expert_mlp_forward(p.config, p.tensors());

        const double acc0[2] = {bias ? 1.5 : 1.0, bias ? -0.375 : -0.875};
        const double acc1[2] = {bias ? -0.75 : -1.0, bias ? -2.25 : -2.5};
        for (int r = 0; r < 2; ++r) {
          const double h = act_d(act, acc0[r], acc1[r]) * (early ? rw[r] : 1.0);
          EXPECT_EQ(p.a.item(r * p.P), acc0[r]) << r;
          if (gated) {
            EXPECT_EQ(p.a.item(r * p.P + 1), acc1[r]) << r;
          }
          EXPECT_NEAR(p.h.item(r), h, 1e-6 * (1 + std::fabs(h))) << r;
          for (int n = 0; n < 2; ++n) {
            const double y = h * w_out[n] + (bias ? (n ? -0.5 : 0.125) : 0.0);
            EXPECT_NEAR(p.y.item(r * 2 + n), y, 1e-6 * (1 + std::fabs(y))) << r << ", " << n;
          }
        }
        if (act == Activation::kRelu2) {
          EXPECT_EQ(p.h.item(1), 0.0);  // relu clips the negative row
        }
        expect_padding_and_tail(p.a, L, "a");
        expect_padding_and_tail(p.h, L, "h");
        expect_padding_and_tail(p.y, L, "y");
      }
}

// ---- the forward's rounding contract -------------------------------------------------------------

// acc from grouped GEMMs of the fp32-widened bf16 operands (the same fp32 chain), a = bf16(acc + b),
// y = bf16(fp32 chain over the STORED bf16 h + b_out): bit for bit. h = bf16(act(acc) * w) within
// one bf16 rounding of the double activation, and equal to bf16 of the double activation of the
// UNROUNDED acc almost always (fp32 vs double act flips a rounding with probability ~1e-5, while
// an activation of the rounded a would miss about half of them).
TEST(ExpertMlp, ForwardRoundsOnceAtTheDocumentedPoints) {
  const Layout L = make_layout({5, 0, 1, 9}, 4, 3);
  const int64_t H = 24, F = 16, G = 4, R = L.total;
  Tensor offsets = ints(L.offsets), rows = ints(L.rows);
  for (Activation act : {Activation::kSwiGLU, Activation::kRelu2})
    for (bool bias : {false, true})
      for (bool early : {false, true}) {
        SCOPED_TRACE(std::string(activation_name(act)) + (bias ? " bias" : "") + (early ? " early" : ""));
        Problem p = make_problem({act, early}, bias, L, H, F, DType::kBF16, DType::kF32, 17);
        expert_mlp_forward(p.config, p.tensors());
        const int64_t P = p.P;
        Tensor x32 = converted(p.x, DType::kF32);  // exact; its NaN padding rows are not read
        std::vector<Tensor> acc(P);
        for (int64_t q = 0; q < P; ++q) {
          Tensor wq = Tensor::empty({G, H, F}, DType::kF32);
          for (int64_t j = 0; j < G; ++j)
            for (int64_t i = 0; i < H * F; ++i)
              store_from_double(wq.data(), DType::kF32, j * H * F + i,
                                p.w_in.item(((j * H + i / F) * P + q) * F + i % F));
          acc[q] = Tensor::zeros({R, F}, DType::kF32);
          grouped_gemm_forward(x32, wq, offsets, rows, acc[q]);
        }
        Tensor h32 = converted(p.h, DType::kF32), w_out32 = converted(p.w_out, DType::kF32);
        Tensor y_acc = Tensor::zeros({R, H}, DType::kF32);
        grouped_gemm_forward(h32, w_out32, offsets, rows, y_acc);
        int64_t h_values = 0, h_exact = 0;
        for (int64_t j = 0; j < G; ++j)
          for (int64_t r = L.offsets[j]; r < L.offsets[j] + L.rows[j]; ++r) {
            const double w_r = early ? p.row_weights.item(r) : 1.0;
            for (int64_t f = 0; f < F; ++f) {
              float z[2] = {0, 0};
              for (int64_t q = 0; q < P; ++q) {
                z[q] = static_cast<float>(acc[q].item(r * F + f));
                if (bias) z[q] += static_cast<float>(p.b_in.item((j * P + q) * F + f));
                ASSERT_EQ(p.a.item((r * P + q) * F + f), round_to_dtype(z[q], DType::kBF16)) << r << "," << q << "," << f;
              }
              const double h = act_d(act, z[0], z[1]) * w_r;
              ASSERT_NEAR(p.h.item(r * F + f), h, std::ldexp(std::fabs(h), -8) + 1e-6) << r << "," << f;
              ++h_values;
              h_exact += p.h.item(r * F + f) == round_to_dtype(h, DType::kBF16);
            }
            for (int64_t n = 0; n < H; ++n) {
              float v = static_cast<float>(y_acc.item(r * H + n));
              if (bias) v += static_cast<float>(p.b_out.item(j * H + n));
              ASSERT_EQ(p.y.item(r * H + n), round_to_dtype(v, DType::kBF16)) << r << "," << n;
            }
          }
        EXPECT_GE(h_exact, h_values * 99 / 100) << "of " << h_values << " h values";
        expect_padding_and_tail(p.a, L, "a");
        expect_padding_and_tail(p.h, L, "h");
        expect_padding_and_tail(p.y, L, "y");
      }
}

// ---- backward against finite differences ---------------------------------------------------------

// L = sum over real rows of c * y, with c = d_y: its gradient is exactly what backward computes.
double loss(const Problem& p) {
  expert_mlp_forward(p.config, p.tensors());  // writes p's a, h, y (Tensors share storage)
  double s = 0;
  for (int64_t r = 0; r < p.L.total; ++r)
    if (p.L.real(r))
      for (int64_t n = 0; n < p.H; ++n) s += p.d_y.item(r * p.H + n) * p.y.item(r * p.H + n);
  return s;
}

// Every element of `param` (real rows only for per-row tensors) against its analytic gradient.
void check_fd(const Problem& p, const Tensor& param, const Tensor& grad, const char* name, bool per_row) {
  if (!param.defined()) return;
  const double eps = 1e-5;
  const int64_t W = per_row ? (param.size(0) ? param.numel() / param.size(0) : 0) : 1;
  double* v = param.ptr<double>();
  for (int64_t i = 0; i < param.numel(); ++i) {
    if (per_row && !p.L.real(i / W)) continue;
    const double keep = v[i];
    v[i] = keep + eps;
    const double up = loss(p);
    v[i] = keep - eps;
    const double down = loss(p);
    v[i] = keep;
    const double fd = (up - down) / (2 * eps), g = grad.item(i);
    ASSERT_NEAR(g, fd, 1e-6 * (1 + std::fabs(fd))) << name << "[" << i << "]";
  }
}

void check_backward_by_fd(MlpConfig config, bool bias, const Layout& L, uint32_t seed) {
  SCOPED_TRACE(std::string(activation_name(config.activation)) + (bias ? " bias" : "") +
               (config.apply_weights_early ? " early" : ""));
  Problem p = make_problem(config, bias, L, 3, 2, DType::kF64, DType::kF64, seed);
  expert_mlp_forward(p.config, p.tensors());
  expert_mlp_backward(p.config, p.tensors(), p.grads());
  expect_padding_and_tail(p.d_x, L, "d_x");
  expect_padding_and_tail(p.d_row_weights, L, "d_row_weights");
  check_fd(p, p.x, p.d_x, "d_x", true);
  check_fd(p, p.w_in, p.d_w_in, "d_w_in", false);
  check_fd(p, p.w_out, p.d_w_out, "d_w_out", false);
  check_fd(p, p.b_in, p.d_b_in, "d_b_in", false);
  check_fd(p, p.b_out, p.d_b_out, "d_b_out", false);
  check_fd(p, p.row_weights, p.d_row_weights, "d_row_weights", true);
}

TEST(ExpertMlp, BackwardMatchesFiniteDifferencesForEveryActivationBiasAndEarlyWeights) {
  const Layout L = make_layout({2, 0, 3, 1}, 2, 1);
  uint32_t seed = 100;
  for (Activation act : kActivations)
    for (bool bias : {false, true})
      for (bool early : {false, true}) {
        check_backward_by_fd({act, early}, bias, L, seed++);
        if (HasFatalFailure()) return;
      }
}

// combine_weight_grads (weights applied in combine, d_y unweighted, their gradient through FC2)
// against the route it replaces in fp64: d_y weighted by the row weight, a plain backward, and
// d_row_weights = <d_y, y> per row. Every gradient agrees to fp64 rounding, and padding rows of
// d_row_weights are zero; biases and early weights with it are errors.
TEST(ExpertMlp, CombineWeightGradsEqualWeightingDyInCombine) {
  const Layout L = make_layout({3, 0, 2, 4}, 4, 2);
  uint32_t seed = 700;
  for (Activation act : kActivations) {
    SCOPED_TRACE(activation_name(act));
    Problem p = make_problem({act, false}, false, L, 6, 5, DType::kF64, DType::kF64, seed++);
    expert_mlp_forward(p.config, p.tensors());
    std::mt19937 rng(seed++);
    std::uniform_real_distribution<double> u(0.05, 1.0);
    Tensor w = Tensor::empty({L.total}, DType::kF64), d_y_w = p.d_y.clone();
    for (int64_t r = 0; r < L.total; ++r) {
      const double wr = L.real(r) ? u(rng) : NAN;  // never read on padding rows
      w.ptr<double>()[r] = wr;
      if (L.real(r))
        for (int64_t n = 0; n < p.H; ++n) d_y_w.ptr<double>()[r * p.H + n] *= wr;
    }
    // The route it replaces: d_y weighted, plain backward, the dot against y.
    Problem q = p;
    q.d_x = Tensor::full(p.d_x.shape(), DType::kF64, kSentinel);
    q.d_w_in = Tensor::full(p.d_w_in.shape(), DType::kF64, kSentinel);
    q.d_w_out = Tensor::full(p.d_w_out.shape(), DType::kF64, kSentinel);
    q.d_y = d_y_w;
    expert_mlp_backward(q.config, q.tensors(), q.grads());

    MlpConfig late = p.config;
    late.combine_weight_grads = true;
    MlpTensors t = p.tensors();
    t.row_weights = w;
    MlpGrads g = p.grads();
    Tensor d_w = Tensor::full({L.total}, DType::kF64, kSentinel);
    g.d_row_weights = d_w;
    expert_mlp_backward(late, t, g);

    auto expect_same = [](const Tensor& got, const Tensor& want, const char* name) {
      ASSERT_EQ(got.numel(), want.numel()) << name;
      for (int64_t i = 0; i < got.numel(); ++i)
        ASSERT_NEAR(got.item(i), want.item(i), 1e-12 * (1 + std::fabs(want.item(i)))) << name << "[" << i << "]";
    };
    expect_same(p.d_x, q.d_x, "d_x");
    expect_same(p.d_w_in, q.d_w_in, "d_w_in");
    expect_same(p.d_w_out, q.d_w_out, "d_w_out");
    int64_t real_rows = 0;
    for (int64_t r = 0; r < L.total; ++r) {
      if (!L.real(r)) continue;
      double dot = 0;
      for (int64_t n = 0; n < p.H; ++n) dot += p.d_y.item(r * p.H + n) * p.y.item(r * p.H + n);
      ASSERT_NEAR(d_w.item(r), dot, 1e-12 * (1 + std::fabs(dot))) << "d_row_weights[" << r << "]";
      ++real_rows;
    }
    EXPECT_EQ(real_rows, 9);
    expect_padding_and_tail(d_w, L, "d_row_weights");
  }

  // With biases (b_out would add <d_y, b_out> to the dot) and with early weights: errors.
  Problem b = make_problem({Activation::kSwiGLU, false}, true, L, 6, 5, DType::kF64, DType::kF64, 1);
  Tensor w = Tensor::full({L.total}, DType::kF64, 0.5), d_w = Tensor::zeros({L.total}, DType::kF64);
  MlpConfig late{Activation::kSwiGLU, false};
  late.combine_weight_grads = true;
  MlpTensors t = b.tensors();
  t.row_weights = w;
  MlpGrads g = b.grads();
  g.d_row_weights = d_w;
  EXPECT_NE(what_of([&] { expert_mlp_backward(late, t, g); }).find("combine_weight_grads needs a layer without biases"),
            std::string::npos);
  Problem e = make_problem({Activation::kSwiGLU, true}, false, L, 6, 5, DType::kF64, DType::kF64, 2);
  MlpConfig both = e.config;
  both.combine_weight_grads = true;
  EXPECT_NE(what_of([&] { expert_mlp_backward(both, e.tensors(), e.grads()); }).find("are both set"),
            std::string::npos);
  Problem n = make_problem({Activation::kSwiGLU, false}, false, L, 6, 5, DType::kF64, DType::kF64, 3);
  MlpGrads ng = n.grads();
  ng.d_row_weights = d_w;
  EXPECT_NE(what_of([&] { expert_mlp_backward(late, n.tensors(), ng); }).find("row_weights is missing"),
            std::string::npos);
}

TEST(ExpertMlp, EdgeLayouts) {
  // G = 1 with one row; G = 1 with all rows; an empty group first; rows_total = 0; no real rows.
  const std::vector<Layout> layouts = {make_layout({1}, 1, 0), make_layout({6}, 4, 1), make_layout({0, 4}, 4, 2),
                                       make_layout({0, 0}, 1, 0), make_layout({0, 0, 0}, 16, 2)};
  uint32_t seed = 300;
  for (const Layout& L : layouts) {
    check_backward_by_fd({Activation::kSwiGLU, true}, true, L, seed++);
    check_backward_by_fd({Activation::kRelu2, false}, false, L, seed++);
    if (HasFatalFailure()) return;
  }
  // Gradients of experts without rows are zeros, overwritten (the sentinel is gone).
  const Layout L = make_layout({0, 3, 0}, 1, 0);
  Problem p = make_problem({Activation::kGeGLU, true}, true, L, 4, 3, DType::kF32, DType::kF32, 9);
  expert_mlp_forward(p.config, p.tensors());
  expert_mlp_backward(p.config, p.tensors(), p.grads());
  for (int64_t j : {0, 2}) {
    for (int64_t i = 0; i < p.P * p.H * p.F; ++i) ASSERT_EQ(p.d_w_in.item(j * p.P * p.H * p.F + i), 0.0);
    for (int64_t i = 0; i < p.F * p.H; ++i) ASSERT_EQ(p.d_w_out.item(j * p.F * p.H + i), 0.0);
    for (int64_t i = 0; i < p.P * p.F; ++i) ASSERT_EQ(p.d_b_in.item(j * p.P * p.F + i), 0.0);
    for (int64_t i = 0; i < p.H; ++i) ASSERT_EQ(p.d_b_out.item(j * p.H + i), 0.0);
  }
  double norm = 0;
  for (int64_t i = 0; i < p.F * p.H; ++i) norm += std::fabs(p.d_w_out.item(p.F * p.H + i));
  EXPECT_GT(norm, 0.0);  // the expert with rows did get a gradient
}

// accumulate_weight_grads: every weight and bias gradient becomes old + this backward's (the
// overwriting result added to the old value, one rounding), an expert without rows keeps its old
// gradient bit for bit, d_x is unaffected; bf16 gradients cannot accumulate (a clear error).
TEST(ExpertMlp, AccumulatedWeightGradsAddToTheOldOnes) {
  const Layout L = make_layout({0, 3, 5}, 1, 0);
  Problem p = make_problem({Activation::kSwiGLU, true}, true, L, 4, 3, DType::kF32, DType::kF32, 17);
  expert_mlp_forward(p.config, p.tensors());
  expert_mlp_backward(p.config, p.tensors(), p.grads());
  const std::vector<Tensor*> gs = {&p.d_w_in, &p.d_w_out, &p.d_b_in, &p.d_b_out};
  std::vector<Tensor> fresh, old;
  for (Tensor* g : gs) fresh.push_back(g->clone());
  const Tensor dx_fresh = p.d_x.clone();
  for (size_t k = 0; k < gs.size(); ++k) {  // arbitrary old values, -0 included
    for (int64_t i = 0; i < gs[k]->numel(); ++i)
      store_from_double(gs[k]->data(), DType::kF32, i, i % 7 == 0 ? -0.0 : 0.25 * static_cast<double>(i % 5) - 0.5);
    old.push_back(gs[k]->clone());
  }
  MlpConfig acc = p.config;
  acc.accumulate_weight_grads = true;
  expert_mlp_backward(acc, p.tensors(), p.grads());
  for (size_t k = 0; k < gs.size(); ++k) {
    const int64_t per = gs[k]->numel() / 3;  // three experts, expert 0 has no rows
    for (int64_t i = 0; i < gs[k]->numel(); ++i) {
      const float o = old[k].ptr<float>()[i], f = fresh[k].ptr<float>()[i], got = gs[k]->ptr<float>()[i];
      if (i < per) {
        ASSERT_EQ(std::signbit(got), std::signbit(o))
            << "gradient " << k << "[" << i << "]: an empty expert is untouched";
      }
      ASSERT_EQ(got, i < per ? o : o + f) << "gradient " << k << "[" << i << "]";
    }
  }
  for (int64_t i = 0; i < p.d_x.numel(); ++i) ASSERT_EQ(p.d_x.item(i), dx_fresh.item(i)) << "d_x[" << i << "]";

  Problem b = make_problem({Activation::kSwiGLU, true}, false, L, 4, 3, DType::kBF16, DType::kBF16, 17);
  MlpConfig bacc = b.config;
  bacc.accumulate_weight_grads = true;
  std::string msg;
  try {
    expert_mlp_forward(b.config, b.tensors());
    expert_mlp_backward(bacc, b.tensors(), b.grads());
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("accumulate needs an fp32 d_w_in"), std::string::npos) << msg;
}

// bf16 data (fp32 weight gradients) against the same values in fp64: within bf16 noise.
TEST(ExpertMlp, Bf16BackwardCloseToFp64) {
  const Layout L = make_layout({7, 0, 12, 1}, 8, 2);
  for (Activation act : kActivations) {
    SCOPED_TRACE(activation_name(act));
    const MlpConfig config{act, true};
    Problem lo = make_problem(config, true, L, 32, 24, DType::kBF16, DType::kF32, 41);
    Problem hi = make_problem(config, true, L, 32, 24, DType::kF64, DType::kF64, 41);
    const std::initializer_list<std::pair<Tensor*, Tensor*>> inputs = {
        {&lo.x, &hi.x},         {&lo.w_in, &hi.w_in}, {&lo.b_in, &hi.b_in},
        {&lo.w_out, &hi.w_out}, {&lo.b_out, &hi.b_out}, {&lo.row_weights, &hi.row_weights},
        {&lo.d_y, &hi.d_y}};
    for (auto [src, dst] : inputs)
      for (int64_t i = 0; i < src->numel(); ++i) store_from_double(dst->data(), dst->dtype(), i, src->item(i));
    for (Problem* p : {&lo, &hi}) {
      expert_mlp_forward(p->config, p->tensors());
      expert_mlp_backward(p->config, p->tensors(), p->grads());
    }
    auto compare = [&](const Tensor& got, const Tensor& want, const char* name, bool per_row) {
      const int64_t W = got.size(0) ? got.numel() / got.size(0) : 0;
      double scale = 0;
      for (int64_t i = 0; i < want.numel(); ++i)
        if (!per_row || L.real(i / W)) scale = std::max(scale, std::fabs(want.item(i)));
      for (int64_t i = 0; i < want.numel(); ++i) {
        if (per_row && !L.real(i / W)) continue;
        ASSERT_NEAR(got.item(i), want.item(i), 2e-2 * (std::fabs(want.item(i)) + 0.1 * scale)) << name << "[" << i << "]";
      }
    };
    compare(lo.y, hi.y, "y", true);
    compare(lo.d_x, hi.d_x, "d_x", true);
    compare(lo.d_row_weights, hi.d_row_weights, "d_row_weights", true);
    compare(lo.d_w_in, hi.d_w_in, "d_w_in", false);
    compare(lo.d_b_in, hi.d_b_in, "d_b_in", false);
    compare(lo.d_w_out, hi.d_w_out, "d_w_out", false);
    compare(lo.d_b_out, hi.d_b_out, "d_b_out", false);
  }
}

// ---- argument errors -------------------------------------------------------------------------------

TEST(ExpertMlp, ActivationNames) {
  EXPECT_STREQ(activation_name(Activation::kSwiGLU), "swiglu");
  EXPECT_STREQ(activation_name(Activation::kGeGLU), "geglu");
  EXPECT_STREQ(activation_name(Activation::kGelu), "gelu");
  EXPECT_STREQ(activation_name(Activation::kRelu2), "relu2");
  EXPECT_TRUE(is_gated(Activation::kSwiGLU) && is_gated(Activation::kGeGLU));
  EXPECT_FALSE(is_gated(Activation::kGelu) || is_gated(Activation::kRelu2));
}

TEST(ExpertMlp, PartialBiasSetIsAnError) {
  const Layout L = make_layout({2, 2}, 1, 0);
  Problem p = make_problem({Activation::kSwiGLU, false}, true, L, 4, 3, DType::kF32, DType::kF32, 1);
  MlpTensors t = p.tensors();
  t.b_out = TensorRef();
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: partial bias set: b_in is given but b_out is missing (give both biases or "
            "neither)");
  t = p.tensors();
  t.b_in = TensorRef();
  EXPECT_EQ(what_of([&] { expert_mlp_backward(p.config, t, p.grads()); }),
            "epx::expert_mlp_backward: partial bias set: b_out is given but b_in is missing (give both biases or "
            "neither)");
  // bias gradients exactly when the layer has biases
  MlpGrads g = p.grads();
  g.d_b_out = TensorRef();
  EXPECT_NE(what_of([&] { expert_mlp_backward(p.config, p.tensors(), g); }).find("d_b_out is missing"),
            std::string::npos);
  Problem nb = make_problem({Activation::kSwiGLU, false}, false, L, 4, 3, DType::kF32, DType::kF32, 1);
  g = nb.grads();
  g.d_b_in = p.d_b_in;
  EXPECT_NE(what_of([&] { expert_mlp_backward(nb.config, nb.tensors(), g); })
                .find("d_b_in is given but the layer has no biases"),
            std::string::npos);
  EXPECT_NO_THROW(expert_mlp_forward(nb.config, nb.tensors()));
  EXPECT_NO_THROW(expert_mlp_backward(nb.config, nb.tensors(), nb.grads()));
}

TEST(ExpertMlp, ProjectionCountMustMatchTheActivation) {
  const Layout L = make_layout({8, 8, 8, 8}, 1, 0);
  Problem gelu = make_problem({Activation::kGelu, false}, false, L, 64, 32, DType::kBF16, DType::kF32, 1);
  Problem swiglu = make_problem({Activation::kSwiGLU, false}, false, L, 64, 32, DType::kBF16, DType::kF32, 1);
  EXPECT_EQ(what_of([&] { expert_mlp_forward(swiglu.config, gelu.tensors()); }).rfind(
                "epx::expert_mlp_forward: w_in has shape [4, 64, 1, 32], expected [4, 64, 2, 32] for swiglu", 0),
            0u);
  EXPECT_EQ(what_of([&] { expert_mlp_backward(gelu.config, swiglu.tensors(), swiglu.grads()); }).rfind(
                "epx::expert_mlp_backward: w_in has shape [4, 64, 2, 32], expected [4, 64, 1, 32] for gelu", 0),
            0u);
}

TEST(ExpertMlp, ValidatesShapesDtypesRowWeightsAndDevices) {
  const Layout L = make_layout({3, 0, 2}, 4, 1);
  Problem p = make_problem({Activation::kSwiGLU, true}, false, L, 16, 8, DType::kBF16, DType::kF32, 1);
  const MlpConfig late{Activation::kSwiGLU, false};
  EXPECT_NO_THROW(expert_mlp_forward(p.config, p.tensors()));
  EXPECT_NO_THROW(expert_mlp_backward(p.config, p.tensors(), p.grads()));
  MlpTensors t = p.tensors();
  MlpGrads g = p.grads();

  // row_weights exactly when apply_weights_early
  t.row_weights = TensorRef();
  EXPECT_NE(what_of([&] { expert_mlp_forward(p.config, t); }).find("row_weights is missing"), std::string::npos);
  EXPECT_NE(what_of([&] { expert_mlp_forward(late, p.tensors()); }).find("row_weights is given but"),
            std::string::npos);
  t = p.tensors();
  t.row_weights = TensorRef();
  g.d_row_weights = TensorRef();
  EXPECT_NO_THROW(expert_mlp_backward(late, t, g));
  g.d_row_weights = p.d_row_weights;
  EXPECT_NE(what_of([&] { expert_mlp_backward(late, t, g); }).find("d_row_weights is given but"), std::string::npos);
  g = p.grads();
  g.d_row_weights = TensorRef();
  EXPECT_NE(what_of([&] { expert_mlp_backward(p.config, p.tensors(), g); }).find("d_row_weights is missing"),
            std::string::npos);
  Tensor rw64 = Tensor::zeros({L.total}, DType::kF64);
  t = p.tensors();
  t.row_weights = rw64;
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: row_weights has dtype fp64, expected fp32");

  // dtypes: one data dtype; weight gradients fp32 or the weights' dtype
  Tensor w_out32 = converted(p.w_out, DType::kF32);
  t = p.tensors();
  t.w_out = w_out32;
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: w_out has dtype fp32, expected bf16");
  Tensor d_w_in16 = Tensor::zeros(p.w_in.shape(), DType::kF16), d_w_inb = Tensor::zeros(p.w_in.shape(), DType::kBF16);
  g = p.grads();
  g.d_w_in = d_w_in16;
  EXPECT_EQ(what_of([&] { expert_mlp_backward(p.config, p.tensors(), g); }),
            "epx::expert_mlp_backward: d_w_in has dtype fp16, expected fp32 or bf16");
  g.d_w_in = d_w_inb;
  EXPECT_NO_THROW(expert_mlp_backward(p.config, p.tensors(), g));

  // shapes
  Tensor h_bad = Tensor::zeros({L.total, 9}, DType::kBF16), y_short = Tensor::zeros({L.total - 1, 16}, DType::kBF16);
  t = p.tensors();
  t.h = h_bad;
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: h has shape [9, 9], expected [9, 8]");
  t = p.tensors();
  t.y = y_short;
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: y has shape [8, 16], expected [9, 16]");
  Tensor w_out_t = Tensor::zeros({3, 16, 8}, DType::kBF16);
  t = p.tensors();
  t.w_out = w_out_t;
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: w_out has shape [3, 16, 8], expected [3, 8, 16]");
  Tensor rows2 = ints({3, 0});
  t = p.tensors();
  t.rows = rows2;
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: offsets has shape [4], expected [3]");
  // y is not read by backward, so it may be absent there
  t = p.tensors();
  t.y = TensorRef();
  EXPECT_NO_THROW(expert_mlp_backward(p.config, t, p.grads()));
  EXPECT_NE(what_of([&] { expert_mlp_forward(p.config, t); }).find("y is missing"), std::string::npos);

  // bad layout values are caught by the reference before anything is written
  Tensor bad_rows = ints({5, 0, 2});
  Tensor y_before = p.y.clone();
  t = p.tensors();
  t.rows = bad_rows;
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }),
            "epx::expert_mlp_forward: group 0 overflows into the next one: offsets[0] + rows[0] = 0 + 5 = 5 > "
            "offsets[1] = 4");
  EXPECT_EQ(std::memcmp(y_before.data(), p.y.data(), p.y.nbytes()), 0);

  // devices
  auto on_gpu = [](const Tensor& x) { return TensorRef(x.data(), x.dtype(), x.shape(), Device::cuda(0)); };
  t = p.tensors();
  t.a = on_gpu(p.a);
  EXPECT_EQ(what_of([&] { expert_mlp_forward(p.config, t); }), "epx::expert_mlp_forward: a is on cuda:0, expected cpu");
  g = p.grads();
  g.d_w_out = on_gpu(p.d_w_out);
  EXPECT_EQ(what_of([&] { expert_mlp_backward(p.config, p.tensors(), g); }),
            "epx::expert_mlp_backward: d_w_out is on cuda:0, expected cpu");
}

}  // namespace
}  // namespace epx
