// GPU grouped GEMMs, the GPU expert FFN and the MoE layer on one GPU against the CPU reference.
// The tensor cores sum in their own order and the GPU FFN rounds a, d_h and d_a to bf16 where the
// reference keeps fp32, so comparisons use a relative norm: ||got - want|| / ||want||.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/error_text.h"
#include "core/gemm_sm_limit.h"
#include "core/scoped_env.h"
#include "cuda/gemm/grouped_gemm_cuda.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/grouped_gemm.h"
#include "epx/moe.h"
#include "epx/presets.h"
#include "epx/quant.h"
#include "gpu/gpu_test_util.h"
#include "ref/expert_mlp.h"

namespace epx {
namespace {

using testing::to_gpu;
using testing::to_host;
using testing::what_of;

double rel_err(const TensorRef& got_any, const TensorRef& want_any) {
  Tensor got = to_host(got_any), want = to_host(want_any);
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = got.item(i) - want.item(i);
    num += d * d;
    den += want.item(i) * want.item(i);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double max_abs(const TensorRef& t_any) {
  const Tensor t = to_host(t_any);
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.item(i)));
  return m;
}

Tensor randn(Shape s, DType dt, uint32_t seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> n(0, scale);
  Tensor t = Tensor::empty(s, dt);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, n(rng));
  return t;
}

struct Layout {
  Tensor offsets, rows;
  int64_t total = 0;
};

// Group sizes with empty and single-row groups, padded to `align`.
Layout make_layout(const std::vector<int>& sizes, int align) {
  Layout L;
  const int G = static_cast<int>(sizes.size());
  L.offsets = Tensor::empty({G + 1}, DType::kI32);
  L.rows = Tensor::empty({G}, DType::kI32);
  int64_t at = 0;
  for (int g = 0; g < G; ++g) {
    L.offsets.ptr<int32_t>()[g] = static_cast<int32_t>(at);
    L.rows.ptr<int32_t>()[g] = sizes[g];
    at += round_up(sizes[g], align);
  }
  L.offsets.ptr<int32_t>()[G] = static_cast<int32_t>(at);
  L.total = at;
  return L;
}

#define EPX_REQUIRE_GROUPED()                                                                              \
  do {                                                                                                     \
    EPX_REQUIRE_GPU();                                                                                     \
    if (!cuda::grouped_gemm_available()) GTEST_SKIP() << "built without CUTLASS: GPU grouped GEMMs absent"; \
  } while (0)

TEST(GroupedGemmGpu, ForwardDgradWgradMatchReference) {
  EPX_REQUIRE_GROUPED();
  const int64_t K = 64, N = 128;
  const Layout L = make_layout({37, 0, 1, 130, 16, 0, 9}, 16);
  const int G = static_cast<int>(L.rows.size(0));
  Tensor x = randn({L.total + 5, K}, DType::kBF16, 1), w = randn({G, K, N}, DType::kBF16, 2, 0.1);
  Tensor dy = randn({L.total + 5, N}, DType::kBF16, 3);
  Tensor y_ref = Tensor::zeros({L.total + 5, N}, DType::kBF16), dx_ref = Tensor::zeros({L.total + 5, K}, DType::kBF16);
  Tensor dw_ref = Tensor::zeros({G, K, N}, DType::kF32);
  grouped_gemm_forward(x, w, L.offsets, L.rows, y_ref);
  grouped_gemm_dgrad(dy, w, L.offsets, L.rows, dx_ref);
  grouped_gemm_wgrad(x, dy, L.offsets, L.rows, dw_ref);
  Tensor off = to_gpu(L.offsets), rows = to_gpu(L.rows);
  // The forward and dgrad on both schedules (EPX_GEMM_FORWARD_KERNEL, read at every call): each
  // matches the reference, and ping-pong's bits are cooperative's (the same MMAs per output tile).
  Tensor y_first, dx_first;
  for (const char* schedule : {"cooperative", "pingpong"}) {
    SCOPED_TRACE(schedule);
    const detail::ScopedEnv kernel("EPX_GEMM_FORWARD_KERNEL", schedule);
    Tensor y = to_gpu(Tensor::full({L.total + 5, N}, DType::kBF16, 7.0));
    Tensor dx = to_gpu(Tensor::full({L.total + 5, K}, DType::kBF16, 7.0));
    grouped_gemm_forward(to_gpu(x), to_gpu(w), off, rows, y);
    grouped_gemm_dgrad(to_gpu(dy), to_gpu(w), off, rows, dx);
    const TensorRef used_y = y.ref().slice_rows(0, L.total), used_dx = dx.ref().slice_rows(0, L.total);
    EXPECT_LT(rel_err(used_y, y_ref.ref().slice_rows(0, L.total)), 1e-2);
    EXPECT_LT(rel_err(used_dx, dx_ref.ref().slice_rows(0, L.total)), 1e-2);
    // rows past offsets[G] keep their contents; padding rows are zero
    Tensor yh = to_host(y), dxh = to_host(dx);
    for (int64_t i = L.total * N; i < (L.total + 5) * N; ++i)
      ASSERT_EQ(yh.item(i), 7.0) << "row past the layout written";
    for (int64_t i = L.total * K; i < (L.total + 5) * K; ++i)
      ASSERT_EQ(dxh.item(i), 7.0) << "dgrad row past the layout written";
    for (int64_t r = 37; r < 48; ++r) ASSERT_EQ(yh.item(r * N), 0.0) << "padding row " << r;
    if (y_first.defined()) {
      EXPECT_TRUE(testing::bit_equal(yh, y_first)) << "forward, ping-pong against cooperative";
      EXPECT_TRUE(testing::bit_equal(dxh, dx_first)) << "dgrad, ping-pong against cooperative";
    } else {
      y_first = yh;
      dx_first = dxh;
    }
  }
  {
    const detail::ScopedEnv kernel("EPX_GEMM_FORWARD_KERNEL", "sideways");
    Tensor y = to_gpu(Tensor::zeros({L.total + 5, N}, DType::kBF16));
    try {
      grouped_gemm_forward(to_gpu(x), to_gpu(w), off, rows, y);
      ADD_FAILURE() << "an unknown EPX_GEMM_FORWARD_KERNEL was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("EPX_GEMM_FORWARD_KERNEL"), std::string::npos) << e.what();
    }
  }
  Tensor dw = to_gpu(Tensor::full({G, K, N}, DType::kF32, 7.0));
  grouped_gemm_wgrad(to_gpu(x), to_gpu(dy), off, rows, dw);
  EXPECT_LT(rel_err(dw, dw_ref), 1e-2);
  Tensor dwh = to_host(dw);
  for (int64_t i = K * N; i < 2 * K * N; ++i) ASSERT_EQ(dwh.item(i), 0.0) << "empty expert's gradient must be zero";
}

// A GEMM SM limit (detail::GemmSmLimit, what an overlapped layer sets while its collectives run)
// shrinks the persistent grid, never a tile's sums: forward, dgrad and wgrad (fp32 and bf16 out) give
// the unlimited bits on every forward schedule and with 128-row-aligned groups.
TEST(GroupedGemmGpu, SmLimitGivesIdenticalResults) {
  EPX_REQUIRE_GROUPED();
  const int64_t K = 256, N = 384;
  for (int align : {16, 128}) {
    const Layout L = make_layout({300, 0, 1, 130, 16, 0, 900}, align);
    const int G = static_cast<int>(L.rows.size(0));
    const Tensor x = to_gpu(randn({L.total, K}, DType::kBF16, 81)), w = to_gpu(randn({G, K, N}, DType::kBF16, 82, 0.1));
    const Tensor dy = to_gpu(randn({L.total, N}, DType::kBF16, 83));
    const Tensor off = to_gpu(L.offsets), rows = to_gpu(L.rows);
    for (const char* schedule : {"auto", "cooperative", "pingpong", "contiguous"}) {
      if (align != 128 && std::string(schedule) == "contiguous") continue;
      SCOPED_TRACE(std::string(schedule) + ", align " + std::to_string(align));
      const detail::ScopedEnv kernel("EPX_GEMM_FORWARD_KERNEL", schedule);
      auto run = [&](int sms) {
        const detail::GemmSmLimit limit(sms);
        std::vector<Tensor> out = {to_gpu(Tensor::zeros({L.total, N}, DType::kBF16)),
                                   to_gpu(Tensor::zeros({L.total, K}, DType::kBF16)),
                                   to_gpu(Tensor::zeros({G, K, N}, DType::kF32)),
                                   to_gpu(Tensor::zeros({G, K, N}, DType::kBF16))};
        grouped_gemm_forward(x, w, off, rows, out[0], {}, align);
        grouped_gemm_dgrad(dy, w, off, rows, out[1], {}, align);
        grouped_gemm_wgrad(x, dy, off, rows, out[2]);
        grouped_gemm_wgrad(x, dy, off, rows, out[3]);
        std::vector<Tensor> host;
        for (const Tensor& t : out) host.push_back(to_host(t));
        return host;
      };
      const std::vector<Tensor> all = run(0), few = run(8);
      const char* names[] = {"forward", "dgrad", "wgrad fp32", "wgrad bf16"};
      for (size_t i = 0; i < all.size(); ++i) EXPECT_TRUE(testing::bit_equal(few[i], all[i])) << names[i];
    }
  }
}

// The persistent scheduler's tile order (EPX_GEMM_RASTER, EPX_GEMM_SWIZZLE) changes which CTA runs
// which tile, never a tile's sums: the forward and the bf16 wgrad are bit-identical under every
// order, and a value outside the documented ones is an error that names the variable.
TEST(GroupedGemmGpu, TileOrdersGiveIdenticalResultsAndBadOrdersAreNamed) {
  EPX_REQUIRE_GROUPED();
  const int64_t K = 256, N = 640;  // several tiles along both M and N
  const Layout L = make_layout({300, 0, 1, 260, 129, 517}, 16);
  const int G = static_cast<int>(L.rows.size(0));
  Tensor x = to_gpu(randn({L.total, K}, DType::kBF16, 31)), w = to_gpu(randn({G, K, N}, DType::kBF16, 32, 0.1));
  Tensor dy = to_gpu(randn({L.total, N}, DType::kBF16, 33));
  Tensor off = to_gpu(L.offsets), rows = to_gpu(L.rows);
  // ~205 rows a group of capacity: the wgrads run on the no-source ping-pong kernels (wgrad_schedule())
  auto run = [&](Tensor& y, Tensor& dw16, Tensor& dw32) {
    grouped_gemm_forward(x, w, off, rows, y);
    grouped_gemm_wgrad(x, dy, off, rows, dw16);
    grouped_gemm_wgrad(x, dy, off, rows, dw32);
  };
  Tensor y0 = to_gpu(Tensor::zeros({L.total, N}, DType::kBF16)), dw0 = to_gpu(Tensor::zeros({G, K, N}, DType::kBF16));
  Tensor dw0_32 = to_gpu(Tensor::zeros({G, K, N}, DType::kF32));
  {
    const detail::ScopedEnv r("EPX_GEMM_RASTER", nullptr), z("EPX_GEMM_SWIZZLE", nullptr);
    run(y0, dw0, dw0_32);
  }
  const std::pair<const char*, const char*> orders[] = {{"n", "1"}, {"m", "4"}, {"n", "8"}, {"m", "2"}};
  for (const auto& [raster, swizzle] : orders) {
    const detail::ScopedEnv r("EPX_GEMM_RASTER", raster), z("EPX_GEMM_SWIZZLE", swizzle);
    Tensor y = to_gpu(Tensor::full({L.total, N}, DType::kBF16, 7.0));
    Tensor dw = to_gpu(Tensor::full({G, K, N}, DType::kBF16, 7.0));
    Tensor dw32 = to_gpu(Tensor::full({G, K, N}, DType::kF32, 7.0));
    run(y, dw, dw32);
    EXPECT_TRUE(testing::bit_equal(y, y0)) << "forward, raster " << raster << ", swizzle " << swizzle;
    EXPECT_TRUE(testing::bit_equal(dw, dw0)) << "bf16 wgrad, raster " << raster << ", swizzle " << swizzle;
    EXPECT_TRUE(testing::bit_equal(dw32, dw0_32)) << "fp32 wgrad, raster " << raster << ", swizzle " << swizzle;
  }
  Tensor y = to_gpu(Tensor::zeros({L.total, N}, DType::kBF16));
  const std::pair<const char*, const char*> bad[] = {{"EPX_GEMM_RASTER", "diagonal"}, {"EPX_GEMM_SWIZZLE", "3"}};
  for (const auto& [name, value] : bad) {
    const detail::ScopedEnv v(name, value);
    try {
      grouped_gemm_forward(x, w, off, rows, y);
      ADD_FAILURE() << name << "=" << value << " was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(name), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::string("\"") + value + "\""), std::string::npos) << msg;
      EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    }
  }
}

// A wgrad problem on the host and the GPU: x [rows, K] and dy [rows, N] in bf16 over layout L, the
// reference gradient, device copies and the kernels' operand views. prepare_x may change x (on the
// host) before the reference and the copies are made.
struct WgradProblem {
  int64_t K, N;
  Layout L;
  int G;
  Tensor x, dy, dw_ref, xg, dyg, off, rows;
  cuda::GroupedOperand a, d;
  const int32_t* o;
  const int32_t* r;

  template <class PrepareX>
  WgradProblem(int64_t K_, int64_t N_, Layout layout, uint64_t seed, PrepareX&& prepare_x)
      : K(K_), N(N_), L(std::move(layout)), G(static_cast<int>(L.rows.size(0))) {
    x = randn({L.total, K}, DType::kBF16, seed);
    dy = randn({L.total, N}, DType::kBF16, seed + 1);
    prepare_x(*this);
    dw_ref = Tensor::zeros({G, K, N}, DType::kF32);
    grouped_gemm_wgrad(x, dy, L.offsets, L.rows, dw_ref);
    xg = to_gpu(x);
    dyg = to_gpu(dy);
    off = to_gpu(L.offsets);
    rows = to_gpu(L.rows);
    a = {xg.data(), K, 0};
    d = {dyg.data(), N, 0};
    o = off.ptr<int32_t>();
    r = rows.ptr<int32_t>();
  }
  WgradProblem(int64_t K_, int64_t N_, Layout layout, uint64_t seed)
      : WgradProblem(K_, N_, std::move(layout), seed, [](WgradProblem&) {}) {}

  bool empty_group_of(int64_t element) const { return L.rows.ptr<int32_t>()[element / (K * N)] == 0; }
};

// Both wgrad schedules, fp32 and bf16 out: each matches the reference, the schedules agree bit for
// bit (same k order inside a tile), bf16 out is the fp32 result rounded once, empty groups are zero.
TEST(GroupedGemmGpu, WgradSchedulesAgreeAndMatchReference) {
  EPX_REQUIRE_GROUPED();
  const WgradProblem p(136, 264, make_layout({300, 0, 1, 130, 16, 0, 9}, 16), 11);  // K, N off either tile
  const int64_t K = p.K, N = p.N;
  const int G = p.G;
  const cuda::GroupedOperand &a = p.a, &d = p.d;
  const int32_t *o = p.o, *r = p.r;
  Tensor c32 = to_gpu(Tensor::zeros({G, K, N}, DType::kF32)), p32 = to_gpu(Tensor::zeros({G, K, N}, DType::kF32));
  Tensor c16 = to_gpu(Tensor::zeros({G, K, N}, DType::kBF16)), p16 = to_gpu(Tensor::zeros({G, K, N}, DType::kBF16));
  cuda::grouped_wgrad_bf16(a, d, c32.ptr<float>(), K * N, K, N, o, r, G, {});
  cuda::grouped_wgrad_bf16_pingpong(a, d, p32.ptr<float>(), K * N, K, N, o, r, G, {});
  cuda::grouped_wgrad_bf16_out(a, d, c16.data(), K * N, K, N, o, r, G, {});
  cuda::grouped_wgrad_bf16_out_pingpong(a, d, p16.data(), K * N, K, N, o, r, G, {});
  Tensor k16 = to_gpu(Tensor::zeros({G, K, N}, DType::kBF16));
  cuda::grouped_wgrad_bf16_out_cluster(a, d, k16.data(), K * N, K, N, o, r, G, {});
  Tensor n16 = to_gpu(Tensor::full({G, K, N}, DType::kBF16, 7.0));
  cuda::grouped_wgrad_bf16_out_nosource(a, d, n16.data(), K * N, K, N, o, r, G, {});
  Tensor q16 = to_gpu(Tensor::full({G, K, N}, DType::kBF16, 7.0));
  cuda::grouped_wgrad_bf16_out_pingpong_nosource(a, d, q16.data(), K * N, K, N, o, r, G, {});
  Tensor t16 = to_gpu(Tensor::full({G, K, N}, DType::kBF16, 7.0));
  cuda::grouped_wgrad_bf16_out_coop_tma(a, d, t16.data(), K * N, K, N, o, r, G, {});
  Tensor q32 = to_gpu(Tensor::full({G, K, N}, DType::kF32, 7.0));
  cuda::grouped_wgrad_f32_pingpong_nosource(a, d, q32.ptr<float>(), K * N, K, N, o, r, G, {});
  EXPECT_LT(rel_err(c32, p.dw_ref), 1e-2);
  EXPECT_TRUE(testing::bit_equal(p32, c32)) << "ping-pong vs cooperative, fp32 out";
  EXPECT_TRUE(testing::bit_equal(p16, c16)) << "ping-pong vs cooperative, bf16 out";
  EXPECT_TRUE(testing::bit_equal(k16, c16)) << "2x1 clusters vs cooperative, bf16 out";
  // The no-source kernels skip empty groups like the others (their 7s stay; the layer zeroes them
  // first) and write every other element, identical to the cooperative result.
  const Tensor ch16 = to_host(c16), ch32 = to_host(c32);
  struct NoSource {
    const char* what;
    const Tensor* got;
    const Tensor* want;
  };
  for (const NoSource& v : {NoSource{"no-source cooperative, bf16 out", &n16, &ch16},
                            NoSource{"no-source ping-pong, bf16 out", &q16, &ch16},
                            NoSource{"cooperative with TMA stores of a staged tile, bf16 out", &t16, &ch16},
                            NoSource{"no-source ping-pong, fp32 out", &q32, &ch32}}) {
    const Tensor h = to_host(*v.got);
    int64_t differ = 0;
    for (int64_t i = 0; i < h.numel(); ++i)
      differ += p.empty_group_of(i) ? h.item(i) != 7.0 : h.item(i) != v.want->item(i);
    EXPECT_EQ(differ, 0) << v.what << " vs cooperative";
  }
  Tensor h32 = to_host(c32), h16 = to_host(c16), rounded = Tensor::empty({G, K, N}, DType::kBF16);
  for (int64_t i = 0; i < h32.numel(); ++i) store_from_double(rounded.data(), DType::kBF16, i, h32.item(i));
  EXPECT_TRUE(testing::bit_equal(h16, rounded)) << "bf16 out must be the fp32 accumulator rounded once";
  // the public op through the configured schedule agrees too
  Tensor pub = to_gpu(Tensor::full({G, K, N}, DType::kF32, 7.0));
  grouped_gemm_wgrad(p.xg, p.dyg, p.off, p.rows, pub);
  EXPECT_TRUE(testing::bit_equal(pub, c32)) << "grouped_gemm_wgrad";
  Tensor ph = to_host(pub);
  for (int64_t i = K * N; i < 2 * K * N; ++i) ASSERT_EQ(ph.item(i), 0.0) << "empty expert's gradient must be zero";
  // bf16 gradients through the public op (auto: the no-source cooperative kernel at groups this small)
  Tensor pub16 = to_gpu(Tensor::full({G, K, N}, DType::kBF16, 7.0));
  grouped_gemm_wgrad(p.xg, p.dyg, p.off, p.rows, pub16);
  EXPECT_TRUE(testing::bit_equal(pub16, c16)) << "grouped_gemm_wgrad, bf16 out";
}

// The cooperative wgrad with TMA-stored tiles and the ping-pong ones without a source operand issue only
// the MMAs of a group's last 64-row K block that reach its rows (EPX_WGRAD_K_TAIL=trim, the default).
// Every residue of the rows modulo 64 and 16 around the block and MMA boundaries, groups of one K block
// and of several, an empty group, and a group whose rows of x are all zero (its products are +-0, where
// a dropped +0 could leave a -0): the trimmed gradient equals every-MMA's and the cooperative kernel's
// of the same output dtype element for element (+0 == -0), and the reference within the bf16
// tolerance. Enough groups that a CTA's ring of per-tile counts wraps.
TEST(GroupedGemmGpu, WgradLastKBlockTrimmedEqualsEveryMma) {
  EPX_REQUIRE_GROUPED();
  std::vector<int> sizes = {1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 0, 79, 80, 81, 127, 128, 129, 200, 256};
  for (int i = 0; i < 40; ++i) sizes.push_back(1 + (i * 37) % 300);
  const int zero_group = 3;  // 17 rows of zeros times nonzero gradients
  const WgradProblem p(136, 264, make_layout(sizes, 1), 31, [&](WgradProblem& q) {
    for (int64_t row = q.L.offsets.ptr<int32_t>()[zero_group]; row < q.L.offsets.ptr<int32_t>()[zero_group + 1]; ++row)
      for (int64_t k = 0; k < q.K; ++k) store_from_double(q.x.data(), DType::kBF16, row * q.K + k, 0.0);
  });
  const int64_t K = p.K, N = p.N;
  const int G = p.G;
  const cuda::GroupedOperand &a = p.a, &d = p.d;
  const int32_t *o = p.o, *r = p.r;
  // kernel(out, k_tail): one of the trimming kernels into a gradient full of 7s, on the host
  using Kernel = void (*)(const cuda::GroupedOperand&, const cuda::GroupedOperand&, void*, int64_t, int64_t,
                          const int32_t*, const int32_t*, int);
  struct Trimming {
    const char* what;
    DType out;
    Kernel run;
  };
  const Trimming kernels[] = {
      {"cooperative with TMA-stored tiles, bf16", DType::kBF16,
       [](const cuda::GroupedOperand& a, const cuda::GroupedOperand& d, void* out, int64_t K, int64_t N,
          const int32_t* o, const int32_t* r, int G) {
         cuda::grouped_wgrad_bf16_out_coop_tma(a, d, out, K * N, K, N, o, r, G, {});
       }},
      {"ping-pong without a source, bf16", DType::kBF16,
       [](const cuda::GroupedOperand& a, const cuda::GroupedOperand& d, void* out, int64_t K, int64_t N,
          const int32_t* o, const int32_t* r, int G) {
         cuda::grouped_wgrad_bf16_out_pingpong_nosource(a, d, out, K * N, K, N, o, r, G, {});
       }},
      {"ping-pong without a source, fp32", DType::kF32,
       [](const cuda::GroupedOperand& a, const cuda::GroupedOperand& d, void* out, int64_t K, int64_t N,
          const int32_t* o, const int32_t* r, int G) {
         cuda::grouped_wgrad_f32_pingpong_nosource(a, d, static_cast<float*>(out), K * N, K, N, o, r, G, {});
       }}};
  Tensor c16 = to_gpu(Tensor::zeros({G, K, N}, DType::kBF16)), c32 = to_gpu(Tensor::zeros({G, K, N}, DType::kF32));
  cuda::grouped_wgrad_bf16_out(a, d, c16.data(), K * N, K, N, o, r, G, {});
  cuda::grouped_wgrad_bf16(a, d, c32.ptr<float>(), K * N, K, N, o, r, G, {});
  const Tensor coop16 = to_host(c16), coop32 = to_host(c32);
  Tensor want = Tensor::empty({G, K, N}, DType::kF32);
  for (int64_t i = 0; i < want.numel(); ++i)
    want.ptr<float>()[i] = p.empty_group_of(i) ? 7.0f : p.dw_ref.ptr<float>()[i];
  for (const Trimming& k : kernels) {
    auto run = [&](const char* k_tail) {
      const detail::ScopedEnv scoped("EPX_WGRAD_K_TAIL", k_tail);
      Tensor out = to_gpu(Tensor::full({G, K, N}, k.out, 7.0));
      k.run(a, d, out.data(), K, N, o, r, G);
      return to_host(out);
    };
    const Tensor trimmed = run(nullptr), full = run("full");
    const Tensor& coop = k.out == DType::kF32 ? coop32 : coop16;
    int64_t differ_full = 0, differ_coop = 0, nonzero_in_zero_group = 0;
    for (int64_t i = 0; i < trimmed.numel(); ++i) {
      const int64_t g = i / (K * N);
      if (p.empty_group_of(i)) {  // skipped like every no-source kernel (the layer zeroes it first)
        differ_full += trimmed.item(i) != 7.0 || full.item(i) != 7.0;
        continue;
      }
      differ_full += trimmed.item(i) != full.item(i);
      differ_coop += trimmed.item(i) != coop.item(i);
      if (g == zero_group) nonzero_in_zero_group += trimmed.item(i) != 0.0;
    }
    EXPECT_EQ(differ_full, 0) << k.what << ": trimmed last K block vs every MMA";
    EXPECT_EQ(differ_coop, 0) << k.what << ": trimmed last K block vs the cooperative kernel";
    EXPECT_EQ(nonzero_in_zero_group, 0) << k.what << ": zero rows of x give a zero gradient";
    EXPECT_LT(rel_err(trimmed, want), 1e-2) << k.what;
  }
}

// Accumulating wgrad (the epilogue's beta = 1): the public op with accumulate adds this gradient to
// what dw holds, bit for bit old + the overwriting result (one fp32 add of the same two values),
// on both schedules; an empty expert keeps its old gradient.
TEST(GroupedGemmGpu, AccumulatingWgradAddsToTheOldGradient) {
  EPX_REQUIRE_GROUPED();
  const WgradProblem p(136, 264, make_layout({300, 0, 1, 130, 16, 0, 9}, 16), 21);
  const int64_t K = p.K, N = p.N;
  const int G = p.G;
  const cuda::GroupedOperand &a = p.a, &d = p.d;
  const int32_t *o = p.o, *r = p.r;
  const Tensor old = randn({G, K, N}, DType::kF32, 23);
  Tensor fresh = to_gpu(Tensor::zeros({G, K, N}, DType::kF32));
  grouped_gemm_wgrad(p.xg, p.dyg, p.off, p.rows, fresh);
  const Tensor fh = to_host(fresh), oh = old;
  Tensor want = Tensor::empty({G, K, N}, DType::kF32);
  for (int64_t i = 0; i < want.numel(); ++i) want.ptr<float>()[i] = oh.ptr<float>()[i] + fh.ptr<float>()[i];
  for (const char* schedule : {"cooperative", "pingpong"}) {  // EPX_WGRAD_KERNEL is read once: the cuda:: entry points
    Tensor acc = to_gpu(old);
    if (std::string(schedule) == "cooperative")
      cuda::grouped_wgrad_bf16(a, d, acc.ptr<float>(), K * N, K, N, o, r, G, {}, 1.0f);
    else
      cuda::grouped_wgrad_bf16_pingpong(a, d, acc.ptr<float>(), K * N, K, N, o, r, G, {}, 1.0f);
    EXPECT_TRUE(testing::bit_equal(to_host(acc), want)) << schedule << ": old + gradient";
  }
  Tensor pub = to_gpu(old);
  grouped_gemm_wgrad(p.xg, p.dyg, p.off, p.rows, pub, /*accumulate=*/true);
  const Tensor ph = to_host(pub);
  EXPECT_TRUE(testing::bit_equal(ph, want)) << "grouped_gemm_wgrad with accumulate";
  for (int64_t i = K * N; i < 2 * K * N; ++i) ASSERT_EQ(ph.item(i), oh.item(i)) << "an empty expert keeps its gradient";
  // and the reference agrees within the GEMM's rounding
  Tensor ref = old.to(Device::cpu());
  grouped_gemm_wgrad(p.x, p.dy, p.L.offsets, p.L.rows, ref, true);
  EXPECT_LT(rel_err(pub, ref), 1e-2);

  // bf16 gradients (MlpConfig::accumulate_in_weight_dtype): the epilogue forms old + gradient in
  // fp32 and rounds once, on both schedules that read a source operand.
  Tensor old16 = Tensor::empty({G, K, N}, DType::kBF16);
  for (int64_t i = 0; i < old16.numel(); ++i) store_from_double(old16.data(), DType::kBF16, i, oh.item(i));
  Tensor want16 = Tensor::empty({G, K, N}, DType::kBF16);
  for (int64_t i = 0; i < want16.numel(); ++i)
    store_from_double(want16.data(), DType::kBF16, i,
                      static_cast<double>(static_cast<float>(old16.item(i)) + fh.ptr<float>()[i]));
  for (const char* schedule : {"cooperative", "pingpong"}) {
    Tensor acc = to_gpu(old16);
    void* out = acc.data();
    if (std::string(schedule) == "cooperative")
      cuda::grouped_wgrad_bf16_out(a, d, out, K * N, K, N, o, r, G, {}, 1.0f);
    else
      cuda::grouped_wgrad_bf16_out_pingpong(a, d, out, K * N, K, N, o, r, G, {}, 1.0f);
    const Tensor h16 = to_host(acc);
    EXPECT_TRUE(testing::bit_equal(h16, want16)) << schedule << ": bf16 old + gradient, rounded once";
    for (int64_t i = K * N; i < 2 * K * N; ++i)
      ASSERT_EQ(h16.item(i), old16.item(i)) << schedule << ": an empty expert keeps its bf16 gradient";
  }
}

// FP8 forward (DeepSeek-V3 block scales): the weight preparation is the reference's bit for bit;
// the GEMM matches the reference's per-block fp32 sums within the FP8 MMA's accumulation error, on
// empty groups, single rows, one group holding almost every row, and skewed scales across rows.
TEST(GroupedGemmGpu, Fp8BlockwiseForwardMatchesReference) {
  EPX_REQUIRE_GROUPED();
  const int64_t N = 384;
  const std::vector<const char*> schedules = cuda::fp8_gemm_schedule_names();
  // K from one to five 128-deep blocks: the promotion-overlapping mainloop pairs them up.
  const std::vector<std::pair<int64_t, std::vector<int>>> cases = {
      {256, {37, 0, 1, 130, 16, 0, 9}}, {256, {0, 300, 0, 1}}, {128, {5, 140, 0}}, {384, {200, 1, 0, 64}},
      {640, {129, 0, 3}}};
  for (const auto& [K, sizes] : cases) {
    SCOPED_TRACE(::testing::Message() << "K = " << K);
    const Layout L = make_layout(sizes, 16);
    const int G = static_cast<int>(L.rows.size(0));
    const int64_t R = L.total + 5;
    Tensor w = randn({G, K, N}, DType::kBF16, 31, 0.05);
    Tensor x = randn({R, K}, DType::kBF16, 32);
    for (int64_t r = 0; r < R; r += 7)  // rows three orders of magnitude apart: each keeps its own scales
      for (int64_t k = 0; k < K; ++k) store_from_double(x.data(), DType::kBF16, r * K + k, 1e3 * x.item(r * K + k));
    Tensor x_q = Tensor::empty({R, K}, DType::kF8E4M3), x_s = Tensor::empty({R, K / 128}, DType::kF32);
    quantize(QuantRecipe::kFp8Block1x128, x, x_q, x_s);
    Tensor w_q = Tensor::empty({G, N, K}, DType::kF8E4M3), w_s = Tensor::empty({G, K / 128, N / 128}, DType::kF32);
    quantize_grouped_weights_fp8(w, w_q, w_s);
    Tensor y_ref = Tensor::zeros({R, N}, DType::kF32);
    grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets, L.rows, y_ref);

    Tensor gw_q = to_gpu(Tensor::zeros({G, N, K}, DType::kF8E4M3)), gw_s = to_gpu(Tensor::zeros(w_s.shape(), DType::kF32));
    quantize_grouped_weights_fp8(to_gpu(w), gw_q, gw_s);
    EXPECT_TRUE(testing::bit_equal(gw_q, w_q)) << "transposed weight codes";
    EXPECT_TRUE(testing::bit_equal(gw_s, w_s)) << "weight block scales";
    Tensor y_cooperative, y_pingpong;
    for (const char* schedule : schedules) {  // EPX_FP8_GEMM_KERNEL is read at every call
      SCOPED_TRACE(schedule);
      Tensor y = to_gpu(Tensor::full({R, N}, DType::kBF16, 7.0));
      if (std::strcmp(schedule, "contiguous") == 0) {  // needs 128-row groups: Fp8ContiguousGroups... below
        const detail::ScopedEnv kernel("EPX_FP8_GEMM_KERNEL", schedule);
        EXPECT_EQ(what_of([&] {
                    grouped_gemm_forward_fp8(to_gpu(x_q), to_gpu(x_s), gw_q, gw_s, to_gpu(L.offsets), to_gpu(L.rows),
                                             y, {}, 16);
                  }),
                  "epx::grouped_gemm_forward_fp8: EPX_FP8_GEMM_KERNEL is contiguous, which needs every group to start "
                  "at a multiple of 128 rows; row_align is 16, expected a multiple of 128");
        continue;
      }
      {
        const detail::ScopedEnv kernel("EPX_FP8_GEMM_KERNEL", schedule);
        grouped_gemm_forward_fp8(to_gpu(x_q), to_gpu(x_s), gw_q, gw_s, to_gpu(L.offsets), to_gpu(L.rows), y);
      }
      Tensor yh = to_host(y);
      // Candidates of a schedule do its arithmetic in its order: the same bits.
      if (std::strcmp(schedule, "cooperative") == 0) {
        y_cooperative = yh;
      } else if (std::strcmp(schedule, "pingpong") == 0) {
        y_pingpong = yh;
      } else if (std::strncmp(schedule, "cooperative", 11) == 0) {
        EXPECT_TRUE(testing::bit_equal(yh, y_cooperative)) << schedule << " against cooperative";
      } else if (std::strncmp(schedule, "pingpong", 8) == 0) {
        EXPECT_TRUE(testing::bit_equal(yh, y_pingpong)) << schedule << " against pingpong";
      }
      for (int g = 0; g < G; ++g)  // row by row, so the small rows beside the scaled-up ones are checked too
        for (int64_t r = L.offsets.ptr<int32_t>()[g]; r < L.offsets.ptr<int32_t>()[g] + L.rows.ptr<int32_t>()[g]; ++r)
          ASSERT_LT(rel_err(yh.ref().slice_rows(r, r + 1), y_ref.ref().slice_rows(r, r + 1)), 1e-2)
              << "group " << g << " row " << r;
      for (int64_t i = L.total * N; i < R * N; ++i) ASSERT_EQ(yh.item(i), 7.0) << "row past the layout written";
      for (int g = 0; g < G; ++g)
        for (int64_t r = L.offsets.ptr<int32_t>()[g] + L.rows.ptr<int32_t>()[g]; r < L.offsets.ptr<int32_t>()[g + 1];
             ++r)
          ASSERT_EQ(yh.item(r * N), 0.0) << "padding row " << r;
    }
  }
}

// The contiguous FP8 kernel (one GEMM over all rows, groups starting at multiples of 128 rows), with
// either epilogue (the staged tile's, CUTLASS's), does the cooperative kernel's arithmetic on the same
// 128-row tiles: the same bits on every row, padding
// zeroed, rows past the layout untouched; auto picks it when the caller promises row_align 128.
// Layouts: empty groups, single rows, a group of 300 rows between empty ones, one group holding every
// row, no rows at all, and align 256 (whole padding tiles between groups, computed then zeroed).
TEST(GroupedGemmGpu, Fp8ContiguousGroupsMatchCooperative) {
  EPX_REQUIRE_GROUPED();
  const int64_t N = 384;
  struct Case {
    int64_t K;
    std::vector<int> sizes;
    int align;
  };
  const std::vector<Case> cases = {{256, {37, 0, 1, 130, 16, 0, 9}, 128}, {256, {0, 300, 0, 1}, 128},
                                   {128, {5, 140, 0}, 128},  {384, {200, 1, 0, 64}, 256},
                                   {640, {129, 0, 3}, 128},  {256, {1000}, 128},
                                   {256, {0, 0, 0}, 128}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "K = " << c.K << ", align " << c.align << ", groups " << c.sizes.size());
    const int64_t K = c.K;
    const Layout L = make_layout(c.sizes, c.align);
    const int G = static_cast<int>(L.rows.size(0));
    const int64_t R = L.total + 5;
    Tensor x = randn({R, K}, DType::kBF16, 41);
    for (int64_t r = 0; r < R; r += 5)
      for (int64_t k = 0; k < K; ++k) store_from_double(x.data(), DType::kBF16, r * K + k, 1e3 * x.item(r * K + k));
    Tensor x_q = Tensor::empty({R, K}, DType::kF8E4M3), x_s = Tensor::empty({R, K / 128}, DType::kF32);
    quantize(QuantRecipe::kFp8Block1x128, x, x_q, x_s);
    Tensor w_q = Tensor::empty({G, N, K}, DType::kF8E4M3), w_s = Tensor::empty({G, K / 128, N / 128}, DType::kF32);
    quantize_grouped_weights_fp8(randn({G, K, N}, DType::kBF16, 42, 0.05), w_q, w_s);
    Tensor y_ref = Tensor::zeros({R, N}, DType::kF32);
    grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets, L.rows, y_ref, {}, c.align);
    const Tensor gx_q = to_gpu(x_q), gx_s = to_gpu(x_s), gw_q = to_gpu(w_q), gw_s = to_gpu(w_s);
    const Tensor off = to_gpu(L.offsets), rows = to_gpu(L.rows);
    auto run = [&](const char* schedule, const char* epilogue = "staged") {
      Tensor y = to_gpu(Tensor::full({R, N}, DType::kBF16, 7.0));
      const detail::ScopedEnv kernel("EPX_FP8_GEMM_KERNEL", schedule);
      const detail::ScopedEnv epi("EPX_CONTIGUOUS_EPILOGUE", epilogue);
      grouped_gemm_forward_fp8(gx_q, gx_s, gw_q, gw_s, off, rows, y, {}, c.align);
      return to_host(y);
    };
    const Tensor want = run("cooperative");
    const Tensor got = run("contiguous");
    EXPECT_TRUE(testing::bit_equal(got, want)) << "contiguous (staged epilogue) against cooperative";
    EXPECT_TRUE(testing::bit_equal(run("contiguous", "cutlass"), want)) << "contiguous, CUTLASS's epilogue";
    EXPECT_TRUE(testing::bit_equal(run("auto"), want)) << "auto with row_align " << c.align;
    for (int g = 0; g < G; ++g)
      for (int64_t r = L.offsets.ptr<int32_t>()[g]; r < L.offsets.ptr<int32_t>()[g] + L.rows.ptr<int32_t>()[g]; ++r)
        ASSERT_LT(rel_err(got.ref().slice_rows(r, r + 1), y_ref.ref().slice_rows(r, r + 1)), 1e-2)
            << "group " << g << " row " << r;
    for (int g = 0; g < G; ++g)
      for (int64_t r = L.offsets.ptr<int32_t>()[g] + L.rows.ptr<int32_t>()[g]; r < L.offsets.ptr<int32_t>()[g + 1]; ++r)
        for (int64_t n = 0; n < N; n += 127) ASSERT_EQ(got.item(r * N + n), 0.0) << "padding row " << r;
    for (int64_t i = L.total * N; i < R * N; ++i) ASSERT_EQ(got.item(i), 7.0) << "row past the layout written";
  }
}

// The bf16 forward and dgrad over contiguous 128-row blocks: the cooperative pointer-array kernels'
// bits on every row (same tiles, same epilogue), padding zeroed, rows past the layout untouched, auto
// picks them for row_align 128, and asking for them without 128-row groups is an error naming row_align.
TEST(GroupedGemmGpu, Bf16ContiguousGroupsMatchCooperative) {
  EPX_REQUIRE_GROUPED();
  const int64_t K = 192, N = 264;
  for (const auto& [sizes, align] : std::vector<std::pair<std::vector<int>, int>>{
           {{37, 0, 1, 130, 16, 0, 9}, 128}, {{0, 300, 0, 1}, 256}, {{1000}, 128}, {{0, 0}, 128}}) {
    SCOPED_TRACE(::testing::Message() << "align " << align << ", groups " << sizes.size());
    const Layout L = make_layout(sizes, align);
    const int G = static_cast<int>(L.rows.size(0));
    const int64_t R = L.total + 3;
    const Tensor x = to_gpu(randn({R, K}, DType::kBF16, 51)), w = to_gpu(randn({G, K, N}, DType::kBF16, 52, 0.1));
    const Tensor off = to_gpu(L.offsets), rows = to_gpu(L.rows);
    auto run = [&](const char* schedule, int64_t row_align, const char* epilogue = "staged") {
      Tensor y = to_gpu(Tensor::full({R, N}, DType::kBF16, 7.0));
      const detail::ScopedEnv kernel("EPX_GEMM_FORWARD_KERNEL", schedule);
      const detail::ScopedEnv epi("EPX_CONTIGUOUS_EPILOGUE", epilogue);
      grouped_gemm_forward(x, w, off, rows, y, {}, row_align);
      return to_host(y);
    };
    const Tensor want = run("cooperative", align);
    const Tensor got = run("contiguous", align);
    EXPECT_TRUE(testing::bit_equal(got, want)) << "contiguous (staged epilogue) against cooperative";
    EXPECT_TRUE(testing::bit_equal(run("contiguous", align, "cutlass"), want)) << "contiguous, CUTLASS's epilogue";
    EXPECT_TRUE(testing::bit_equal(run("auto", align), want)) << "auto with row_align " << align;
    Tensor ref = Tensor::full({R, N}, DType::kBF16, 7.0);
    grouped_gemm_forward(to_host(x), to_host(w), L.offsets, L.rows, ref, {}, align);
    EXPECT_LT(rel_err(got, ref), 1e-2);
    for (int64_t i = L.total * N; i < R * N; ++i) ASSERT_EQ(got.item(i), 7.0) << "row past the layout written";
    if (G > 1) {
      EXPECT_EQ(what_of([&] { run("contiguous", 16); }),
                "epx::grouped_gemm_forward: EPX_GEMM_FORWARD_KERNEL is contiguous, which needs every group to start "
                "at a multiple of 128 rows; row_align is 16, expected a multiple of 128");
    }
    // dgrad: dx [R, K] = dy [R, N] . w_g^T
    const Tensor dy = to_gpu(randn({R, N}, DType::kBF16, 53));
    auto dgrad = [&](const char* schedule, const char* epilogue = "staged") {
      Tensor dx = to_gpu(Tensor::full({R, K}, DType::kBF16, 7.0));
      const detail::ScopedEnv kernel("EPX_GEMM_FORWARD_KERNEL", schedule);
      const detail::ScopedEnv epi("EPX_CONTIGUOUS_EPILOGUE", epilogue);
      grouped_gemm_dgrad(dy, w, off, rows, dx, {}, align);
      return to_host(dx);
    };
    const Tensor dx_want = dgrad("cooperative"), dx_got = dgrad("contiguous");
    EXPECT_TRUE(testing::bit_equal(dx_got, dx_want)) << "dgrad: contiguous (staged epilogue) against cooperative";
    EXPECT_TRUE(testing::bit_equal(dgrad("contiguous", "cutlass"), dx_want)) << "dgrad: CUTLASS's epilogue";
    EXPECT_TRUE(testing::bit_equal(dgrad("auto"), dx_want)) << "dgrad: auto with row_align " << align;
    for (int64_t i = L.total * K; i < R * K; ++i) ASSERT_EQ(dx_got.item(i), 7.0) << "dgrad: row past the layout";
  }
}

TEST(GroupedGemmGpu, Fp8ForwardRejectsShapesOffTheBlocks) {
  EPX_REQUIRE_GROUPED();
  const Layout L = make_layout({4}, 16);
  Tensor x_q = to_gpu(Tensor::zeros({16, 200}, DType::kF8E4M3)), y = to_gpu(Tensor::zeros({16, 128}, DType::kBF16));
  Tensor x_s = to_gpu(Tensor::zeros({16, 1}, DType::kF32)), w_q = to_gpu(Tensor::zeros({1, 128, 200}, DType::kF8E4M3));
  Tensor w_s = to_gpu(Tensor::zeros({1, 1, 1}, DType::kF32));
  try {
    grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, to_gpu(L.offsets), to_gpu(L.rows), y);
    FAIL() << "K = 200 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 128"), std::string::npos) << e.what();
  }
}

// Row weights: none (combine weights d_y), early (between FC1 and FC2), or combine's with their
// gradient through FC2 (MlpConfig::combine_weight_grads; d_h over h and d_x over x, as a layer runs it).
TEST(ExpertMlpGpu, ForwardBackwardMatchReference) {
  EPX_REQUIRE_GROUPED();
  for (Activation act : {Activation::kSwiGLU, Activation::kGelu})
    for (int mode : {0, 1, 2}) {
      const bool early = mode == 1, late = mode == 2, weighted = early || late;
      SCOPED_TRACE(std::string(activation_name(act)) + (early ? " early" : late ? " combine_weight_grads" : ""));
      const int64_t H = 64, F = 48, P = is_gated(act) ? 2 : 1;
      const Layout L = make_layout({20, 0, 33, 1, 7}, 8);
      const int G = static_cast<int>(L.rows.size(0));
      const int64_t R = L.total;
      MlpConfig cfg{act, early, MlpPrecision::kHigh}, bwd = cfg;
      bwd.combine_weight_grads = late;
      bwd.backward_consumes_saved = late;
      Tensor x = randn({R, H}, DType::kBF16, 10), w_in = randn({G, H, P, F}, DType::kBF16, 11, 0.15);
      Tensor w_out = randn({G, F, H}, DType::kBF16, 12, 0.15), rw = randn({R}, DType::kF32, 13, 0.5);
      Tensor d_y = randn({R, H}, DType::kBF16, 14);
      auto run = [&](bool gpu, Tensor& y, Tensor& d_x, Tensor& d_w_in, Tensor& d_w_out, Tensor& d_rw) {
        auto put = [&](const Tensor& t) { return gpu ? to_gpu(t) : t.clone(); };
        auto zeros = [&](Shape s, DType dt) { return put(Tensor::zeros(s, dt)); };
        Tensor xs = put(x), wi = put(w_in), wo = put(w_out), off = put(L.offsets), rows = put(L.rows), r = put(rw);
        Tensor a = zeros({R, P, F}, DType::kBF16), h = zeros({R, F}, DType::kBF16);
        y = zeros({R, H}, DType::kBF16);
        MlpTensors t{xs, off, rows, early ? r.ref() : TensorRef(), wi, {}, wo, {}, a, h, y};
        expert_mlp_forward(cfg, t);
        d_x = late ? xs : zeros({R, H}, DType::kBF16);  // late: d_x over x, as a consuming layer runs it
        d_w_in = zeros({G, H, P, F}, DType::kF32);
        d_w_out = zeros({G, F, H}, DType::kF32);
        d_rw = zeros({R}, DType::kF32);
        const Tensor dys = put(d_y);  // named: the grads view must not outlive its storage
        MlpGrads g{dys, d_x, weighted ? d_rw.ref() : TensorRef(), d_w_in, {}, d_w_out, {}};
        if (late) t.row_weights = r;
        expert_mlp_backward(bwd, t, g);
      };
      Tensor y0, dx0, dwi0, dwo0, drw0, y1, dx1, dwi1, dwo1, drw1;
      run(false, y0, dx0, dwi0, dwo0, drw0);
      run(true, y1, dx1, dwi1, dwo1, drw1);
      EXPECT_LT(rel_err(y1, y0), 2e-2) << "y";
      EXPECT_LT(rel_err(dx1, dx0), 3e-2) << "d_x";
      EXPECT_LT(rel_err(dwi1, dwi0), 3e-2) << "d_w_in";
      EXPECT_LT(rel_err(dwo1, dwo0), 2e-2) << "d_w_out";
      if (weighted) {
        EXPECT_LT(rel_err(drw1, drw0), 3e-2) << "d_row_weights";
        EXPECT_GT(max_abs(drw0), 0.0) << "a check of zeros";
      }
    }
}

// Every row of the activation kernels, whichever block and group boundary it falls on: ~6000 rows in
// 60 groups (empty, one-row and padded ones), more rows than a launch has blocks, for a gated and a
// plain activation; and every activation at F = 2056, where thread 0 takes two column steps a row and
// the others one.
// Checked element by element against the reference's formulas (ref::activation_grad) applied to the
// GPU's own a (no GEMM rounding in the comparison): h = act(a) [* w] on real rows, a, h, y zero on
// padding rows, rows past the layout untouched; backward (consuming: d_a lands in a, d_h in h)
// d_a = d_h [* w] * d act / d a and d_row_weights = sum d_h * act on real rows, zero on padding rows.
TEST(ExpertMlpGpu, ActivationKernelsCoverEveryRowAcrossBlocks) {
  EPX_REQUIRE_GROUPED();
  struct Shape2 {
    int64_t F;
    int groups, max_rows, align;
    bool every_activation;  // else SwiGLU and GELU only (the host check of ~6000 rows takes seconds)
  };
  for (const Shape2& sh : {Shape2{264, 60, 230, 16, false}, Shape2{2056, 6, 20, 8, true}})
    for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kGelu, Activation::kRelu2})
      for (bool early : {false, true}) {
        if (!sh.every_activation && act != Activation::kSwiGLU && act != Activation::kGelu) continue;
        SCOPED_TRACE(::testing::Message() << activation_name(act) << (early ? " early" : "") << ", F " << sh.F);
        std::mt19937 rng(static_cast<uint32_t>(sh.F) + 7u * static_cast<uint32_t>(act) + (early ? 1u : 0u));
        std::vector<int> sizes(static_cast<size_t>(sh.groups));
        for (int& n : sizes) n = rng() % 5 == 0 ? static_cast<int>(rng() % 2) : static_cast<int>(rng() % sh.max_rows);
        const Layout L = make_layout(sizes, sh.align);
        const int G = sh.groups;
        const int64_t H = 64, F = sh.F, P = is_gated(act) ? 2 : 1, R = L.total + 5;
        const Tensor x = to_gpu(randn({R, H}, DType::kBF16, 61));
        const Tensor w_in = to_gpu(randn({G, H, P, F}, DType::kBF16, 62, 0.2));
        const Tensor w_out = to_gpu(randn({G, F, H}, DType::kBF16, 63, 0.1));
        const Tensor rw_host = randn({R}, DType::kF32, 64, 0.5);
        const Tensor rw = to_gpu(rw_host), off = to_gpu(L.offsets), rows = to_gpu(L.rows);
        Tensor a = to_gpu(Tensor::full({R, P, F}, DType::kBF16, 7.0));
        Tensor h = to_gpu(Tensor::full({R, F}, DType::kBF16, 7.0)), y = to_gpu(Tensor::full({R, H}, DType::kBF16, 7.0));
        const MlpTensors t{x, off, rows, early ? rw.ref() : TensorRef(), w_in, {}, w_out, {}, a, h, y};
        expert_mlp_forward(MlpConfig{act, early, MlpPrecision::kHigh}, t);
        const Tensor a_f = to_host(a), h_f = to_host(h), y_f = to_host(y);
        const Tensor d_y = to_gpu(randn({R, H}, DType::kBF16, 65)), d_x = to_gpu(Tensor::zeros({R, H}, DType::kBF16));
        const Tensor d_w_in = to_gpu(Tensor::zeros({G, H, P, F}, DType::kF32));
        const Tensor d_w_out = to_gpu(Tensor::zeros({G, F, H}, DType::kF32));
        const Tensor d_rw = to_gpu(Tensor::full({R}, DType::kF32, 7.0));
        const MlpGrads g{d_y, d_x, early ? d_rw.ref() : TensorRef(), d_w_in, {}, d_w_out, {}};
        expert_mlp_backward(MlpConfig{act, early, MlpPrecision::kHigh, /*backward_consumes_saved=*/true}, t, g);
        const Tensor d_a = to_host(a), d_h = to_host(h), d_rw_b = to_host(d_rw);

        int64_t bad = 0;
        auto expect_near = [&](double got, double want, double tol, const char* what, int64_t r, int64_t j) {
          if (std::fabs(got - want) <= tol) return;
          if (++bad <= 5) ADD_FAILURE() << what << " row " << r << " column " << j << ": " << got << ", want " << want;
        };
        for (int gi = 0; gi < G; ++gi) {
          const int64_t begin = L.offsets.ptr<int32_t>()[gi], real_end = begin + L.rows.ptr<int32_t>()[gi];
          for (int64_t r = begin; r < L.offsets.ptr<int32_t>()[gi + 1]; ++r) {
            const bool real = r < real_end;
            const double w = early ? rw_host.item(r) : 1.0;
            double dw = 0, dw_scale = 0;
            for (int64_t j = 0; j < F; ++j) {
              const double a0 = a_f.item(r * P * F + j), a1 = P == 2 ? a_f.item(r * P * F + F + j) : 0.0;
              if (!real) {
                expect_near(a0, 0, 0, "padding a", r, j);
                expect_near(a1, 0, 0, "padding a", r, j);
                expect_near(h_f.item(r * F + j), 0, 0, "padding h", r, j);
                expect_near(d_a.item(r * P * F + j), 0, 0, "padding d_a", r, j);
                continue;
              }
              const ref::ActivationGrad v = ref::activation_grad(act, a0, a1);
              expect_near(h_f.item(r * F + j), v.value * w, 1e-2 * std::fabs(v.value * w) + 1e-3, "h", r, j);
              const double dh = d_h.item(r * F + j);
              dw += dh * v.value;
              dw_scale += std::fabs(dh * v.value);
              expect_near(d_a.item(r * P * F + j), dh * w * v.d0, 1e-2 * std::fabs(dh * w * v.d0) + 1e-3, "d_a0", r, j);
              if (P == 2)
                expect_near(d_a.item(r * P * F + F + j), dh * w * v.d1, 1e-2 * std::fabs(dh * w * v.d1) + 1e-3, "d_a1",
                            r, j);
            }
            for (int64_t j = 0; !real && j < H; ++j) expect_near(y_f.item(r * H + j), 0, 0, "padding y", r, j);
            if (early) expect_near(d_rw_b.item(r), real ? dw : 0.0, 1e-2 * dw_scale + 1e-4, "d_row_weights", r, 0);
          }
        }
        for (int64_t r = L.total; r < R; ++r) {
          for (int64_t j = 0; j < P * F; ++j) expect_near(d_a.item(r * P * F + j), 7.0, 0, "a past the layout", r, j);
          for (int64_t j = 0; j < F; ++j) expect_near(d_h.item(r * F + j), 7.0, 0, "h past the layout", r, j);
          if (early) expect_near(d_rw_b.item(r), 7.0, 0, "d_row_weights past the layout", r, 0);
        }
        EXPECT_EQ(bad, 0) << "elements off (first five reported above)";
      }
}

// Expert biases (b_in joins FC1's sums in the activation kernel, b_out FC2's output; their
// gradients are column sums over each expert's rows) in bf16 and with FP8 block scales, against
// the reference. d_b_out sums the very d_y the reference sums, in its order: bit for bit. A second
// backward with accumulate doubles it exactly; an expert without rows keeps zero.
TEST(ExpertMlpGpu, ExpertBiasesMatchReference) {
  EPX_REQUIRE_GROUPED();
  struct Case {
    MlpPrecision precision;
    Activation act;
    bool early;
    int64_t H, F;
  };
  // skewed with an empty and a one-row expert, and every row in one expert
  for (const std::vector<int>& sizes : {std::vector<int>{20, 0, 33, 1, 7}, std::vector<int>{0, 0, 61, 0}})
  for (const Case& k : {Case{MlpPrecision::kHigh, Activation::kSwiGLU, false, 64, 48},
                        Case{MlpPrecision::kHigh, Activation::kGelu, true, 64, 48},
                        Case{MlpPrecision::kFp8Block, Activation::kSwiGLU, false, 256, 128}}) {
    SCOPED_TRACE(std::string(mlp_precision_name(k.precision)) + " " + activation_name(k.act) +
                 (k.early ? " early" : "") + ", " + std::to_string(sizes.size()) + " experts");
    const int64_t H = k.H, F = k.F, P = is_gated(k.act) ? 2 : 1;
    const Layout L = make_layout(sizes, 16);
    const int G = static_cast<int>(L.rows.size(0));
    const int64_t R = L.total;
    MlpConfig cfg{k.act, k.early, k.precision};
    Tensor x = randn({R, H}, DType::kBF16, 60), w_in = randn({G, H, P, F}, DType::kBF16, 61, 0.1);
    Tensor w_out = randn({G, F, H}, DType::kBF16, 62, 0.1), rw = randn({R}, DType::kF32, 63, 0.5);
    Tensor b_in = randn({G, P, F}, DType::kBF16, 64, 0.5), b_out = randn({G, H}, DType::kBF16, 65, 0.5);
    Tensor d_y = randn({R, H}, DType::kBF16, 66);
    struct Out {
      Tensor y, d_x, d_w_in, d_w_out, d_b_in, d_b_out, d_b_out_twice;
    };
    auto run = [&](bool gpu) {
      auto put = [&](const Tensor& t) { return gpu ? to_gpu(t) : t.clone(); };
      auto zeros = [&](Shape sh, DType dt) { return put(Tensor::zeros(sh, dt)); };
      Tensor xs = put(x), wi = put(w_in), wo = put(w_out), bi = put(b_in), bo = put(b_out), off = put(L.offsets);
      Tensor rows = put(L.rows), r = put(rw), a = zeros({R, P, F}, DType::kBF16), h = zeros({R, F}, DType::kBF16);
      Out o;
      o.y = zeros({R, H}, DType::kBF16);
      MlpTensors t{xs, off, rows, k.early ? r.ref() : TensorRef(), wi, bi, wo, bo, a, h, o.y};
      expert_mlp_forward(cfg, t);
      o.d_x = zeros({R, H}, DType::kBF16);
      o.d_w_in = zeros({G, H, P, F}, DType::kF32);
      o.d_w_out = zeros({G, F, H}, DType::kF32);
      o.d_b_in = zeros({G, P, F}, DType::kF32);
      o.d_b_out = zeros({G, H}, DType::kF32);
      Tensor d_rw = zeros({R}, DType::kF32);
      const Tensor dys = put(d_y);
      MlpGrads g{dys, o.d_x, k.early ? d_rw.ref() : TensorRef(), o.d_w_in, o.d_b_in, o.d_w_out, o.d_b_out};
      MlpConfig keep = cfg;
      keep.backward_consumes_saved = false;  // a second backward below
      expert_mlp_backward(keep, t, g);
      // again, adding to copies of the first gradients
      o.d_b_out_twice = put(o.d_b_out);
      Tensor d_x2 = zeros({R, H}, DType::kBF16), d_rw2 = zeros({R}, DType::kF32);
      const Tensor d_w_in2 = put(o.d_w_in), d_b_in2 = put(o.d_b_in), d_w_out2 = put(o.d_w_out);
      MlpGrads g2{dys, d_x2, k.early ? d_rw2.ref() : TensorRef(), d_w_in2, d_b_in2, d_w_out2, o.d_b_out_twice};
      MlpConfig acc = keep;
      acc.accumulate_weight_grads = true;
      expert_mlp_backward(acc, t, g2);
      return o;
    };
    const Out want = run(false), got = run(true);
    EXPECT_LT(rel_err(got.y, want.y), 3e-2) << "y";
    EXPECT_LT(rel_err(got.d_x, want.d_x), 4e-2) << "d_x";
    EXPECT_LT(rel_err(got.d_w_in, want.d_w_in), 4e-2) << "d_w_in";
    EXPECT_LT(rel_err(got.d_w_out, want.d_w_out), 3e-2) << "d_w_out";
    EXPECT_LT(rel_err(got.d_b_in, want.d_b_in), 4e-2) << "d_b_in";
    const Tensor dbo = to_host(got.d_b_out), twice = to_host(got.d_b_out_twice);
    EXPECT_TRUE(testing::bit_equal(dbo, want.d_b_out)) << "d_b_out: the reference's sums in its order";
    int64_t nonzero = 0;
    for (int64_t i = 0; i < dbo.numel(); ++i) {
      ASSERT_EQ(twice.ptr<float>()[i], 2.0f * dbo.ptr<float>()[i]) << "accumulated d_b_out element " << i;
      nonzero += dbo.ptr<float>()[i] != 0.0f;
    }
    for (int64_t i = H; i < 2 * H; ++i) ASSERT_EQ(dbo.ptr<float>()[i], 0.0f) << "the expert without rows";
    EXPECT_GT(nonzero, 0);
    // the biases really took part: without them y differs
    Tensor yb = to_gpu(Tensor::zeros({R, H}, DType::kBF16)), ab = to_gpu(Tensor::zeros({R, P, F}, DType::kBF16));
    Tensor hb = to_gpu(Tensor::zeros({R, F}, DType::kBF16)), xg = to_gpu(x), wig = to_gpu(w_in), wog = to_gpu(w_out);
    Tensor offg = to_gpu(L.offsets), rowsg = to_gpu(L.rows), rwg = to_gpu(rw);
    const TensorRef early_w = k.early ? rwg.ref() : TensorRef();
    expert_mlp_forward(cfg, MlpTensors{xg, offg, rowsg, early_w, wig, {}, wog, {}, ab, hb, yb});
    EXPECT_GT(rel_err(got.y, yb), 1e-2) << "b_in and b_out changed nothing";
  }
}

// The FP8 forwards of the expert FFN (the DeepSeek-V3 block recipe on FP8 tensor cores; MXFP8 as
// bf16 GEMMs on the exact images of its quantized operands) with x bf16, quantized inside, and x
// arriving as fp8 with its scales, as an FP8 dispatch delivers it; and the backward after each,
// against the reference with the same precision: both quantize the same values with the same recipe,
// so the residue is the GEMMs' accumulation and h's requantization of a slightly different a.
// The FFN told its layout starts every group on a 128-row block (MlpTensors::row_align, the
// dispatch's align in the layer) runs the contiguous GEMMs: the same a, h, y and gradient bits as
// without the promise, in bf16 and with FP8 block scales; padding rows stay zero.
TEST(ExpertMlpGpu, RowAlign128IsBitIdentical) {
  EPX_REQUIRE_GROUPED();
  const int64_t H = 256, F = 128, P = 2;
  const Layout L = make_layout({37, 0, 1, 130, 9}, 128);
  const int G = static_cast<int>(L.rows.size(0));
  const int64_t R = L.total;
  const Tensor x = to_gpu(randn({R, H}, DType::kBF16, 60)), w_in = to_gpu(randn({G, H, P, F}, DType::kBF16, 61, 0.06));
  const Tensor w_out = to_gpu(randn({G, F, H}, DType::kBF16, 62, 0.06)), d_y = to_gpu(randn({R, H}, DType::kBF16, 63));
  const Tensor off = to_gpu(L.offsets), rows = to_gpu(L.rows);
  for (MlpPrecision prec : {MlpPrecision::kHigh, MlpPrecision::kFp8Block}) {
    SCOPED_TRACE(mlp_precision_name(prec));
    const MlpConfig cfg{Activation::kSwiGLU, false, prec};
    auto run = [&](int64_t row_align) {
      // bf16's auto wants >= 256 rows of capacity a group for the contiguous kernel: asked for here.
      std::optional<detail::ScopedEnv> contiguous;
      if (row_align == 128) contiguous.emplace("EPX_GEMM_FORWARD_KERNEL", "contiguous");
      Tensor a = to_gpu(Tensor::zeros({R, P, F}, DType::kBF16)), h = to_gpu(Tensor::zeros({R, F}, DType::kBF16));
      Tensor y = to_gpu(Tensor::full({R, H}, DType::kBF16, 7.0));
      MlpTensors t{x, off, rows, {}, w_in, {}, w_out, {}, a, h, y};
      t.row_align = row_align;
      expert_mlp_forward(cfg, t);
      std::vector<Tensor> out{to_host(a), to_host(h), to_host(y)};
      Tensor d_x = to_gpu(Tensor::zeros({R, H}, DType::kBF16));
      Tensor d_w_in = to_gpu(Tensor::zeros({G, H, P, F}, DType::kF32));
      Tensor d_w_out = to_gpu(Tensor::zeros({G, F, H}, DType::kF32));
      expert_mlp_backward(cfg, t, MlpGrads{d_y, d_x, {}, d_w_in, {}, d_w_out, {}});
      out.push_back(to_host(d_x));
      out.push_back(to_host(d_w_in));
      out.push_back(to_host(d_w_out));
      return out;
    };
    const std::vector<Tensor> want = run(1), got = run(128);
    const char* names[] = {"a", "h", "y", "d_x", "d_w_in", "d_w_out"};
    for (int i = 0; i < 6; ++i) EXPECT_TRUE(testing::bit_equal(got[i], want[i])) << names[i];
    for (int g = 0; g < G; ++g)
      for (int64_t r = L.offsets.ptr<int32_t>()[g] + L.rows.ptr<int32_t>()[g]; r < L.offsets.ptr<int32_t>()[g + 1]; ++r)
        ASSERT_EQ(got[2].item(r * H), 0.0) << "padding row " << r;
  }
}

TEST(ExpertMlpGpu, Fp8ForwardsAndTheirBackwardMatchReference) {
  EPX_REQUIRE_GROUPED();
  for (MlpPrecision prec : {MlpPrecision::kFp8Block, MlpPrecision::kMxfp8}) {
    const bool mx = prec == MlpPrecision::kMxfp8;
    const QuantRecipe x_recipe = mx ? QuantRecipe::kMxfp8Rowwise : QuantRecipe::kFp8Block1x128;
    for (bool fp8_x : {false, true}) {
      SCOPED_TRACE(std::string(mlp_precision_name(prec)) + (fp8_x ? ", x fp8 with scales" : ", x bf16"));
      const int64_t H = 256, F = 128, P = 2;
      const Layout L = make_layout({20, 0, 33, 1, 7}, 16);
      const int G = static_cast<int>(L.rows.size(0));
      const int64_t R = L.total;
      MlpConfig cfg{Activation::kSwiGLU, false, prec};
      Tensor xb = randn({R, H}, DType::kBF16, 40), w_in = randn({G, H, P, F}, DType::kBF16, 41, 0.06);
      Tensor w_out = randn({G, F, H}, DType::kBF16, 42, 0.06), d_y = randn({R, H}, DType::kBF16, 43);
      Tensor xq = Tensor::empty({R, H}, DType::kF8E4M3);
      Tensor xs = Tensor::empty(quant_scale_shape(x_recipe, R, H), quant_scale_dtype(x_recipe));
      QuantOptions qo;
      qo.mx_rounding = E8M0Rounding::kCeil;  // what the MXFP8 forward quantizes with
      quantize(x_recipe, xb, xq, xs, qo);
      auto run = [&](bool gpu, Tensor& y, Tensor& d_x, Tensor& d_w_in, Tensor& d_w_out) {
        auto put = [&](const Tensor& t) { return gpu ? to_gpu(t) : t.clone(); };
        auto zeros = [&](Shape sh, DType dt) { return put(Tensor::zeros(sh, dt)); };
        Tensor x = put(fp8_x ? xq : xb), sc = put(xs), wi = put(w_in), wo = put(w_out), off = put(L.offsets);
        Tensor rows = put(L.rows), a = zeros({R, P, F}, DType::kBF16), h = zeros({R, F}, DType::kBF16);
        y = zeros({R, H}, DType::kBF16);
        MlpTensors t{x, off, rows, {}, wi, {}, wo, {}, a, h, y, fp8_x ? sc.ref() : TensorRef()};
        expert_mlp_forward(cfg, t);
        d_x = zeros({R, H}, DType::kBF16);
        d_w_in = zeros({G, H, P, F}, DType::kF32);
        d_w_out = zeros({G, F, H}, DType::kF32);
        const Tensor dys = put(d_y);
        expert_mlp_backward(cfg, t, MlpGrads{dys, d_x, {}, d_w_in, {}, d_w_out, {}});
      };
      Tensor y0, dx0, dwi0, dwo0, y1, dx1, dwi1, dwo1;
      run(false, y0, dx0, dwi0, dwo0);
      run(true, y1, dx1, dwi1, dwo1);
      EXPECT_LT(rel_err(y1, y0), 3e-2) << "y";
      EXPECT_LT(rel_err(dx1, dx0), 4e-2) << "d_x";
      EXPECT_LT(rel_err(dwi1, dwi0), 4e-2) << "d_w_in";
      EXPECT_LT(rel_err(dwo1, dwo0), 3e-2) << "d_w_out";
      // and it is a different computation from the bf16 path (the operands really are quantized)
      Tensor yb = to_gpu(Tensor::zeros({R, H}, DType::kBF16)), ab = to_gpu(Tensor::zeros({R, P, F}, DType::kBF16));
      Tensor hb = to_gpu(Tensor::zeros({R, F}, DType::kBF16)), xg = to_gpu(xb), wig = to_gpu(w_in), wog = to_gpu(w_out);
      Tensor offg = to_gpu(L.offsets), rowsg = to_gpu(L.rows);
      expert_mlp_forward(MlpConfig{}, MlpTensors{xg, offg, rowsg, {}, wig, {}, wog, {}, ab, hb, yb, {}});
      const double vs_bf16 = rel_err(y1, yb);
      EXPECT_GT(vs_bf16, 1e-3) << "the FP8 forward gave the bf16 result";
      EXPECT_LT(vs_bf16, 1e-1) << "the FP8 forward is far from the bf16 one";
    }
  }
}

// The MXFP8 forward's images are exact: with whole-number-of-blocks shapes its FC1 output equals a
// bf16 GEMM on the dequantized operands made by hand, bit for bit (the same CUTLASS kernel, the same
// inputs).
TEST(ExpertMlpGpu, Mxfp8ForwardIsTheBf16GemmOfTheQuantizedImages) {
  EPX_REQUIRE_GROUPED();
  const int64_t H = 128, F = 64, P = 2;
  const Layout L = make_layout({16, 5, 0, 40}, 8);
  const int G = static_cast<int>(L.rows.size(0));
  const int64_t R = L.total;
  Tensor xb = randn({R, H}, DType::kBF16, 50), w_in = randn({G, H, P, F}, DType::kBF16, 51, 0.06);
  Tensor w_out = randn({G, F, H}, DType::kBF16, 52, 0.06);
  QuantOptions qo;
  qo.mx_rounding = E8M0Rounding::kCeil;
  // src viewed as [M, N], quantized and dequantized on the CPU reference, in src's shape
  auto image = [&](const Tensor& src, QuantRecipe r, int64_t M, int64_t N) {
    const TensorRef v(src.data(), src.dtype(), {M, N}, src.device());
    Tensor q = Tensor::empty({M, N}, DType::kF8E4M3), sc = Tensor::empty(quant_scale_shape(r, M, N), quant_scale_dtype(r));
    Tensor out = Tensor::empty(src.shape(), DType::kBF16);
    quantize(r, v, q, sc, qo);
    dequantize(r, q, sc, TensorRef(out.data(), DType::kBF16, {M, N}, out.device()));
    return out;
  };
  const Tensor x_img = image(xb, QuantRecipe::kMxfp8Rowwise, R, H);
  const Tensor wi_img = image(w_in, QuantRecipe::kMxfp8Colwise, G * H, P * F);
  auto gpu_fc1 = [&](const MlpConfig& cfg, const Tensor& x, const Tensor& wi) {
    Tensor a = to_gpu(Tensor::zeros({R, P, F}, DType::kBF16)), h = to_gpu(Tensor::zeros({R, F}, DType::kBF16));
    Tensor y = to_gpu(Tensor::zeros({R, H}, DType::kBF16));
    Tensor xg = to_gpu(x), wig = to_gpu(wi), wog = to_gpu(w_out), off = to_gpu(L.offsets), rows = to_gpu(L.rows);
    expert_mlp_forward(cfg, MlpTensors{xg, off, rows, {}, wig, {}, wog, {}, a, h, y, {}});
    return a.to(Device::cpu());
  };
  const Tensor a_mx = gpu_fc1(MlpConfig{Activation::kSwiGLU, false, MlpPrecision::kMxfp8}, xb, w_in);
  const Tensor a_img = gpu_fc1(MlpConfig{}, x_img, wi_img);
  ASSERT_EQ(a_mx.numel(), a_img.numel());
  EXPECT_EQ(std::memcmp(a_mx.data(), a_img.data(), a_mx.numel() * dtype_size(DType::kBF16)), 0);
}

// The whole layer on one GPU against the same layer on the CPU reference (bf16 both): outputs,
// losses and input gradients agree within bf16 rounding (FP8's for the FP8 forward) for tokens
// whose routing agrees.
// The "small" preset at the given widths, and a group for 64 tokens of it.
MoEConfig small_layer(int64_t hidden, int64_t ffn, int64_t shared_ffn, MlpPrecision precision) {
  MoEConfig c = moe_config(find_preset("small"), DType::kBF16);
  c.hidden = hidden;
  c.ffn_hidden = ffn;
  c.shared_ffn_hidden = shared_ffn;
  c.precision = precision;
  return c;
}

GroupConfig group_for_64_tokens(const MoEConfig& c) {
  GroupConfig gc;
  gc.num_experts = c.router.num_experts;
  gc.hidden = c.hidden;
  gc.max_tokens_per_rank = 64;
  gc.max_topk = c.router.topk;
  gc.align = 16;
  return gc;
}

void check_one_gpu_layer(MlpPrecision precision, int64_t hidden, int64_t ffn, double tol, bool biases = false) {
  MoEConfig c = small_layer(hidden, ffn, ffn, precision);
  c.expert_bias_terms = biases;
  const GroupConfig gc = group_for_64_tokens(c);
  auto host = Group::create_simulated(1, gc);
  Group gpu = Group::create_local(gc, 0);
  MoELayer lh(host[0], c), lg(gpu, c);
  lh.init_params(3, 0.1);
  lg.init_params(3, 0.1);
  // a sharper gate, so that rounding differences do not move tokens between experts
  Tensor gate = randn(lh.params().gate.shape(), DType::kBF16, 21, 1.0);
  copy(gate, lh.params().gate);
  copy(gate, lg.params().gate);
  Tensor x = randn({64, c.hidden}, DType::kBF16, 22), d_out = randn({64, c.hidden}, DType::kBF16, 23, 0.1);
  Tensor out_h = Tensor::zeros({64, c.hidden}, DType::kBF16), dx_h = Tensor::zeros({64, c.hidden}, DType::kBF16);
  MoEContext ch = lh.forward(x, out_h);
  lh.backward(ch, d_out, dx_h);
  Tensor xg = to_gpu(x), out_g = to_gpu(out_h), dx_g = to_gpu(dx_h);
  MoEContext cg = lg.forward(xg, out_g);
  lg.backward(cg, to_gpu(d_out), dx_g);
  gpu.check();
  Tensor ih = to_host(ch.topk_idx()), ig = to_host(cg.topk_idx());
  int same = 0;
  for (int t = 0; t < 64; ++t) {
    bool eq = true;
    for (int k = 0; k < c.router.topk; ++k) eq &= ih.ptr<int32_t>()[t * c.router.topk + k] == ig.ptr<int32_t>()[t * c.router.topk + k];
    same += eq;
  }
  EXPECT_GE(same, 60) << "routing agrees on too few tokens";
  EXPECT_LT(rel_err(out_g, out_h), 5e-2 * tol);
  EXPECT_LT(rel_err(dx_g, dx_h), 8e-2 * tol);
  Tensor lsh = to_host(ch.losses()), lsg = to_host(cg.losses());
  EXPECT_NEAR(lsg.item(0), lsh.item(0), 1e-2 * std::fabs(lsh.item(0)) + 1e-6);
  EXPECT_NEAR(lsg.item(1), lsh.item(1), 1e-2 * std::fabs(lsh.item(1)) + 1e-6);
  EXPECT_LT(rel_err(lg.grads().w_in, lh.grads().w_in), 8e-2 * tol);
  EXPECT_LT(rel_err(lg.grads().gate, lh.grads().gate), 8e-2 * tol);
  if (biases) {
    EXPECT_LT(rel_err(lg.grads().b_in, lh.grads().b_in), 8e-2 * tol);
    EXPECT_LT(rel_err(lg.grads().b_out, lh.grads().b_out), 8e-2 * tol);
  }
}

TEST(MoELayerGpu, OneGpuMatchesReference) {
  EPX_REQUIRE_GROUPED();
  check_one_gpu_layer(MlpPrecision::kHigh, 64, 32, 1.0);
}

// The FP8 block forward end to end: x quantized at the source, dispatched as fp8 with its scales,
// the FP8 expert GEMMs, and the backward from the dequantized rows.
TEST(MoELayerGpu, OneGpuFp8ForwardMatchesReference) {
  EPX_REQUIRE_GROUPED();
  check_one_gpu_layer(MlpPrecision::kFp8Block, 128, 128, 1.5);
}

TEST(MoELayerGpu, OneGpuWithExpertBiasesMatchesReference) {
  EPX_REQUIRE_GROUPED();
  check_one_gpu_layer(MlpPrecision::kHigh, 64, 32, 1.0, /*biases=*/true);
}

TEST(MoELayerGpu, OneGpuMxfp8ForwardMatchesReference) {
  EPX_REQUIRE_GROUPED();
  check_one_gpu_layer(MlpPrecision::kMxfp8, 128, 128, 1.5);
}

// MoEConfig::fp8_weight_cache: the kept FP8 weights give the per-call result bit for bit; after a
// weight change the kept copy is stale until refresh_fp8_weights(), then bit-identical again.
TEST(MoELayerGpu, Fp8WeightCacheMatchesPerCallQuantizationAndRefreshes) {
  EPX_REQUIRE_GROUPED();
  const MoEConfig c = small_layer(128, 128, 0, MlpPrecision::kFp8Block);
  Group gpu = Group::create_local(group_for_64_tokens(c), 0);
  MoEConfig cached_cfg = c;
  cached_cfg.fp8_weight_cache = true;
  MoELayer per_call(gpu, c), cached(gpu, cached_cfg);
  per_call.init_params(5, 0.1);
  cached.init_params(5, 0.1);
  const Tensor x = to_gpu(randn({64, c.hidden}, DType::kBF16, 51));
  auto forward = [&](MoELayer& l) {
    Tensor out = to_gpu(Tensor::zeros({64, c.hidden}, DType::kBF16));
    l.forward(x, out);
    return to_host(out);
  };
  EXPECT_TRUE(testing::bit_equal(forward(cached), forward(per_call))) << "first forward (copy made there)";
  // an optimizer step on both layers' expert weights
  for (MoELayer* l : {&per_call, &cached}) {
    Tensor w = to_host(l->params().w_in);
    for (int64_t i = 0; i < w.numel(); ++i) store_from_double(w.data(), DType::kBF16, i, 1.5 * w.item(i));
    copy(to_gpu(w), l->params().w_in);
  }
  EXPECT_FALSE(testing::bit_equal(forward(cached), forward(per_call))) << "the kept copy should be stale";
  cached.refresh_fp8_weights();
  EXPECT_TRUE(testing::bit_equal(forward(cached), forward(per_call))) << "after refresh_fp8_weights";
  gpu.check();
}

}  // namespace
}  // namespace epx
