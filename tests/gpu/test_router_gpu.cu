// GPU tests of the router kernels (src/cuda/router): every op of epx/router.h on CUDA tensors
// against the CPU reference (src/ref/router.cpp, reached through the same public API on host
// tensors), on random and adversarial inputs, with every output poisoned beforehand (a value the
// kernel forgets to write shows up as the poison), T = 0, large T and sequence-level statistics.
//
// Which comparisons are bit-exact, and why:
//  - topk_idx: exact. Selection compares keys, and the keys only differ from the reference's by
//    the few-ulp differences of expf and of summation order. Random rows are redrawn until no two
//    distinct selection scores (or group scores) lie within those errors (well_separated below);
//    adversarial rows are built from a few small integers, infinities, NaN and signed zeros, so
//    every pair of scores is either an exact tie on both sides (the same logit gives the same
//    score) or far apart.
//  - count_routed's counts, scalars[1] (valid tokens), update_expert_bias: exact (integers, and
//    the same float operations).
//  - two GPU runs on the same input: every output bit for bit (deterministic reductions).
//  - topk_weights, prob_sum, scalars[0], the losses and d_logits: tolerances. CUDA's expf/logf are
//    within 2 ulp where glibc's are within 1, the GPU sums over lanes and blocks in a tree where the
//    reference sums sequentially, and multiplies by 1/sum where the reference divides. bf16
//    d_logits may differ by one bf16 ulp where the two fp32 values straddle a rounding boundary.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/device_memory.h"
#include "cuda/router/router.h"
#include "epx/error.h"
#include "epx/router.h"
#include "epx/tensor.h"
#include "gpu/gpu_test_util.h"

namespace epx {
namespace {

using epx::testing::all_close;
using epx::testing::bit_equal;
using epx::testing::to_gpu;
using epx::testing::to_host;

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// Poison values: written into every output before a run; two different ones so that an unwritten
// element cannot match by coincidence.
constexpr double kPoisons[] = {12345.0, -777.0};

Tensor host_tensor(Shape shape, DType dt, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, dt);
  EXPECT_EQ(static_cast<int64_t>(v.size()), t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, v[i]);
  return t;
}

std::vector<double> values(const TensorRef& any) {
  Tensor h = to_host(any);
  std::vector<double> v(h.numel());
  for (int64_t i = 0; i < h.numel(); ++i) v[i] = h.item(i);
  return v;
}

Tensor on(Device dev, const Tensor& host) {
  if (!host.defined() || dev.is_cpu()) return host;
  return to_gpu(host, dev.index);
}

int64_t num_seq(const RouterConfig& c, int64_t T) { return c.aux_loss == AuxLossType::kSequence ? T / c.seq_len : 1; }

struct Routed {
  Tensor idx, w, prob, counts, scal;
  RouterStats stats() const { return RouterStats{prob.ref(), counts.ref(), scal.ref()}; }
};

Routed outputs(Device dev, const RouterConfig& c, int64_t T, DType idx_dt, double poison) {
  const int64_t S = num_seq(c, T);
  const int E = c.num_experts, K = c.topk;
  Routed r;
  r.idx = on(dev, Tensor::full({T, K}, idx_dt, poison));
  r.w = on(dev, Tensor::full({T, K}, DType::kF32, poison));
  r.prob = on(dev, Tensor::full({S, E}, DType::kF32, poison));
  r.counts = on(dev, Tensor::full({S, E}, DType::kF32, poison));
  r.scal = on(dev, Tensor::full({2}, DType::kF32, poison));
  return r;
}

// route_forward then count_routed of its routing, on `dev`, from host inputs.
Routed forward_on(Device dev, const RouterConfig& c, const Tensor& logits, const Tensor& bias, DType idx_dt,
                  double poison = kPoisons[0]) {
  const Tensor l = on(dev, logits), b = on(dev, bias);
  Routed r = outputs(dev, c, logits.size(0), idx_dt, poison);
  route_forward(c, l, b, r.idx, r.w, r.stats());
  count_routed(c, r.idx, r.stats());
  return r;
}

void expect_forward_match(const Routed& gpu, const Routed& cpu, const std::string& what) {
  EXPECT_TRUE(bit_equal(gpu.idx, cpu.idx)) << what << ": topk_idx";
  EXPECT_TRUE(all_close(gpu.w, cpu.w, 1e-7, 3e-5)) << what << ": topk_weights";
  EXPECT_TRUE(bit_equal(gpu.counts, cpu.counts)) << what << ": counts";
  EXPECT_TRUE(all_close(gpu.prob, cpu.prob, 1e-5, 2e-4)) << what << ": prob_sum";
  const std::vector<double> gs = values(gpu.scal), cs = values(cpu.scal);
  EXPECT_EQ(gs[1], cs[1]) << what << ": scalars[1] (valid tokens)";
  EXPECT_TRUE(gs[0] == cs[0] || std::fabs(gs[0] - cs[0]) <= 2e-4 * std::fabs(cs[0]) + 1e-6)
      << what << ": scalars[0] (sum of lse^2) got " << gs[0] << ", want " << cs[0];
}

void expect_all_bit_equal(const Routed& a, const Routed& b, const std::string& what) {
  EXPECT_TRUE(bit_equal(a.idx, b.idx)) << what << ": topk_idx";
  EXPECT_TRUE(bit_equal(a.w, b.w)) << what << ": topk_weights";
  EXPECT_TRUE(bit_equal(a.prob, b.prob)) << what << ": prob_sum";
  EXPECT_TRUE(bit_equal(a.scal, b.scal)) << what << ": scalars";
  EXPECT_TRUE(bit_equal(a.counts, b.counts)) << what << ": counts";
}

// ---- inputs -------------------------------------------------------------------------------------

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Whether every pair of distinct selection scores of a row (and of its group scores) is further
// apart than the GPU and the reference can disagree about (a few ulp of the score, plus the
// rounding of the bias sum). Equal logits give exactly equal scores on both sides, so exact ties
// in double are fine. Computed in double from the row as stored.
bool well_separated(const RouterConfig& c, const std::vector<double>& l, const std::vector<double>& bias) {
  const int E = c.num_experts;
  std::vector<int> el;
  for (int e = 0; e < E; ++e)
    if (!std::isnan(l[e])) el.push_back(e);
  if (el.empty()) return true;
  double m = -kInf;
  for (int e : el) m = std::max(m, l[e]);
  if (std::isinf(m)) return true;
  double z = 0;
  for (int e : el) z += std::exp(l[e] - m);
  std::vector<double> score(E, 0.0), key(E, 0.0);
  for (int e : el) {
    score[e] = c.score_function == ScoreFunction::kSoftmax   ? std::exp(l[e] - m) / z
               : c.score_function == ScoreFunction::kSigmoid ? sigmoid(l[e])
                                                              : l[e];
    key[e] = score[e] + (bias.empty() ? 0.0 : bias[e]);
  }
  auto tol = [](double sa, double sb, double ka, double kb) {
    return 1e-5 * (std::fabs(sa) + std::fabs(sb)) + 1e-6 * (std::fabs(ka) + std::fabs(kb)) + 1e-37;
  };
  std::vector<int> order = el;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
  for (size_t i = 0; i + 1 < order.size(); ++i) {
    const int a = order[i], b = order[i + 1];
    if (std::isinf(key[a]) || std::isinf(key[b])) continue;  // an infinity is far from any finite key
    if (key[a] != key[b] && key[a] - key[b] <= tol(score[a], score[b], key[a], key[b])) return false;
  }
  if (c.num_groups > 1) {
    const int per = E / c.num_groups;
    std::vector<double> gs(c.num_groups), gmag(c.num_groups);
    for (int g = 0; g < c.num_groups; ++g) {
      std::vector<int> v;
      for (int e = g * per; e < (g + 1) * per; ++e)
        if (!std::isnan(l[e])) v.push_back(e);
      std::sort(v.begin(), v.end(), [&](int a, int b) { return key[a] > key[b]; });
      if (v.empty()) {
        gs[g] = -kInf;
        gmag[g] = 0;
      } else if (v.size() == 1) {
        gs[g] = key[v[0]];
        gmag[g] = std::fabs(score[v[0]]);
      } else {
        gs[g] = key[v[0]] + key[v[1]];
        gmag[g] = std::fabs(score[v[0]]) + std::fabs(score[v[1]]);
      }
    }
    for (int a = 0; a < c.num_groups; ++a)
      for (int b = a + 1; b < c.num_groups; ++b)
        // Infinite group scores (no eligible expert) compare exactly; only finite ones can be near-ties.
        if (std::isfinite(gs[a]) && std::isfinite(gs[b]) && gs[a] != gs[b] &&
            std::fabs(gs[a] - gs[b]) <= tol(gmag[a], gmag[b], gs[a], gs[b]))
          return false;
  }
  return true;
}

// Random logits (normal * scale, a fraction NaN), each row redrawn until well separated; row 3 is
// fully masked and row 4 has only two eligible experts.
Tensor random_logits(const RouterConfig& c, int64_t T, DType dt, const std::vector<double>& bias, uint64_t seed,
                     double scale = 2.0, double nan_frac = 0.02) {
  const int E = c.num_experts;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  Tensor out = Tensor::empty({T, E}, dt);
  std::vector<double> row(E);
  for (int64_t t = 0; t < T; ++t) {
    bool ok = false;
    for (int attempt = 0; attempt < 1000 && !ok; ++attempt) {
      for (int e = 0; e < E; ++e) {
        double v = normal(rng);
        if (unif(rng) < nan_frac || t == 3) v = kNaN;
        if (t == 4) v = e < 2 ? v : kNaN;
        row[e] = round_to_dtype(v, dt);
      }
      ok = well_separated(c, row, bias);
    }
    EXPECT_TRUE(ok) << "could not draw a well separated row " << t;
    store_row(out.data(), dt, t * E, E, row.data());
  }
  return out;
}

std::vector<double> random_bias(int E, uint64_t seed, double range) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-range, range);
  std::vector<double> b(E);
  for (double& v : b) v = static_cast<double>(static_cast<float>(u(rng)));
  return b;
}

RouterConfig make_config(int E, int K, ScoreFunction f, int G = 1, int gk = 1, bool bias = false, bool normalize = false,
                         float scale = 1.0f) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  c.score_function = f;
  c.num_groups = G;
  c.group_topk = gk;
  c.use_expert_bias = bias;
  c.normalize_weights = normalize;
  c.routed_scaling_factor = scale;
  c.aux_loss = AuxLossType::kGlobalBatch;
  c.aux_loss_coeff = 0.01f;
  c.z_loss_coeff = 0.001f;
  return c;
}

std::string describe(const RouterConfig& c, DType dt, DType idx_dt, int64_t T) {
  std::ostringstream os;
  os << score_function_name(c.score_function) << " E=" << c.num_experts << " K=" << c.topk << " G=" << c.num_groups
     << "/" << c.group_topk << (c.use_expert_bias ? " bias" : "") << (c.normalize_weights ? " norm" : "")
     << " scale=" << c.routed_scaling_factor << " " << dtype_name(dt) << " ids " << dtype_name(idx_dt) << " T=" << T
     << (c.aux_loss == AuxLossType::kSequence ? " seq_len=" + std::to_string(c.seq_len) : "");
  return os.str();
}

struct Case {
  RouterConfig c;
  DType dt, idx_dt;
};

// Shapes chosen for the kernel's corners: every V (1..16), E not a multiple of 32 * V, a lane only
// partly inside E with and without 16-byte loads, groups whose boundaries cut through a lane
// (E / G not a multiple of V) and groups of a non-power-of-two number of lanes, K = E, K = 16.
std::vector<Case> forward_cases() {
  using SF = ScoreFunction;
  std::vector<Case> v;
  auto add = [&](RouterConfig c, DType dt, DType idx = DType::kI32) { v.push_back({c, dt, idx}); };
  add(make_config(1, 1, SF::kSoftmax), DType::kF32);
  add(make_config(2, 1, SF::kSigmoid, 1, 1, true), DType::kBF16, DType::kI64);
  add(make_config(8, 2, SF::kSoftmax), DType::kF32);
  add(make_config(8, 8, SF::kSigmoid, 1, 1, true, true), DType::kF32, DType::kI64);
  add(make_config(32, 4, SF::kSoftmaxAfterTopk), DType::kBF16);
  add(make_config(33, 3, SF::kSoftmax, 1, 1, false, true, 2.0f), DType::kF32);
  add(make_config(40, 3, SF::kSoftmax, 8, 3, true), DType::kBF16);
  add(make_config(64, 6, SF::kSoftmax, 1, 1, true, true), DType::kBF16);
  add(make_config(64, 8, SF::kSigmoid, 16, 4, true, true, 2.5f), DType::kF32);
  add(make_config(96, 8, SF::kSigmoid, 16, 8, false, true), DType::kF32, DType::kI64);
  add(make_config(96, 5, SF::kSoftmaxAfterTopk, 4, 2, true, false, 1.5f), DType::kF32);
  add(make_config(98, 4, SF::kSigmoid), DType::kF32);
  add(make_config(132, 8, SF::kSoftmax), DType::kF32);
  add(make_config(160, 6, SF::kSigmoid, 5, 2, true, true), DType::kBF16);
  add(make_config(200, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kF32);
  add(make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kF32);
  add(make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kBF16, DType::kI64);
  add(make_config(256, 16, SF::kSoftmax), DType::kF32, DType::kI64);
  add(make_config(256, 8, SF::kSoftmaxAfterTopk, 1, 1, true), DType::kF32);
  add(make_config(264, 8, SF::kSoftmax), DType::kBF16);
  add(make_config(512, 8, SF::kSigmoid, 16, 4, true, true, 2.5f), DType::kF32);
  add(make_config(512, 16, SF::kSoftmaxAfterTopk, 1, 1, false, true), DType::kBF16);
  add(make_config(500, 7, SF::kSoftmax, 4, 3, true), DType::kF32);
  // The wide kernel's shapes (E in {64, 128, 256}, groups of 32, 64 or 128 experts).
  add(make_config(64, 4, SF::kSigmoid, 2, 1, true, true), DType::kF32);
  add(make_config(128, 8, SF::kSigmoid, 4, 2, true, true, 2.5f), DType::kBF16);
  add(make_config(128, 4, SF::kSoftmaxAfterTopk, 2, 1, false, true), DType::kF32, DType::kI64);
  add(make_config(256, 6, SF::kSoftmax, 2, 1, true), DType::kF32);
  add(make_config(256, 16, SF::kSigmoid, 8, 8, true, true), DType::kF32);
  add(make_config(256, 1, SF::kSoftmax), DType::kBF16);
  return v;
}

// Puts back the router kernel that was in use when a test that forces kernels in turn ends, also
// when an assertion ends it early.
class RouterKernelRestorer {
 public:
  ~RouterKernelRestorer() { cuda::set_router_kernel(saved_); }

 private:
  const cuda::RouterKernel saved_ = cuda::router_kernel_in_use();
};

// ---- route_forward ------------------------------------------------------------------------------

TEST(RouterGpuForward, MatchesReferenceOnRandomRows) {
  EPX_REQUIRE_GPU();
  const int64_t T = 517;  // not a multiple of the chunk or warp counts
  uint64_t seed = 1;
  for (const Case& k : forward_cases()) {
    const RouterConfig& c = k.c;
    const std::vector<double> bias = c.use_expert_bias ? random_bias(c.num_experts, seed + 1000, 0.05) : std::vector<double>();
    const Tensor b = c.use_expert_bias ? host_tensor({c.num_experts}, DType::kF32, bias) : Tensor();
    const Tensor logits = random_logits(c, T, k.dt, bias, seed++);
    const std::string what = describe(c, k.dt, k.idx_dt, T);
    const Routed cpu = forward_on(Device::cpu(), c, logits, b, k.idx_dt);
    for (double poison : kPoisons) {
      const Routed gpu = forward_on(Device::cuda(0), c, logits, b, k.idx_dt, poison);
      expect_forward_match(gpu, cpu, what);
    }
  }
}

// Rows from a handful of values: exact ties everywhere (the exact fallback path of the top-k),
// infinities, NaN, signed zeros, underflow to exactly 0, fully masked rows, fewer eligible experts
// than K, and biases of +-inf and NaN.
TEST(RouterGpuForward, MatchesReferenceOnTiesAndNonFiniteRows) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  using SF = ScoreFunction;
  std::vector<Case> cases = {
      {make_config(64, 8, SF::kSoftmax), DType::kF32, DType::kI32},
      {make_config(64, 8, SF::kSigmoid, 8, 3, true, true, 2.5f), DType::kF32, DType::kI64},
      {make_config(64, 8, SF::kSoftmaxAfterTopk, 4, 2, true), DType::kBF16, DType::kI32},
      {make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kF32, DType::kI32},
      {make_config(256, 8, SF::kSoftmax, 8, 4, true), DType::kBF16, DType::kI32},
      {make_config(96, 16, SF::kSoftmaxAfterTopk, 16, 5), DType::kF32, DType::kI32},
      {make_config(512, 16, SF::kSoftmax), DType::kF32, DType::kI64},
      {make_config(12, 5, SF::kSigmoid, 3, 2, true), DType::kF32, DType::kI32},
      {make_config(128, 6, SF::kSoftmaxAfterTopk, 4, 2, true), DType::kF32, DType::kI32},
      {make_config(256, 12, SF::kSoftmax, 16, 4), DType::kF32, DType::kI32},
  };
  for (const Case& k : cases) {
    const RouterConfig& c = k.c;
    const int E = c.num_experts;
    std::mt19937_64 rng(99 + E);
    std::uniform_int_distribution<int> small(0, 3), pick(0, E - 1);
    std::vector<double> rows;
    auto add_row = [&](const std::function<double(int)>& f) {
      for (int e = 0; e < E; ++e) rows.push_back(round_to_dtype(f(e), k.dt));
    };
    add_row([](int) { return 0.25; });                                  // all equal
    add_row([](int) { return kNaN; });                                  // fully masked
    add_row([](int) { return -kInf; });                                 // every eligible -inf
    add_row([&](int e) { return e == 1 || e == E - 1 ? kInf : 1.0; });  // +inf splits the mass
    add_row([&](int e) { return e % 3 == 0 ? -kInf : 2.0; });
    add_row([&](int e) { return e == E / 2 ? 1.0 : kNaN; });            // one eligible expert
    add_row([&](int e) { return e % 5 == 0 ? 0.0 : kNaN; });            // a few eligible experts
    add_row([&](int e) { return e % 2 ? -0.0 : 0.0; });                 // signed zeros tie
    add_row([&](int e) { return -200.0 * (e % 4); });                   // exp underflows to exactly 0
    add_row([&](int e) { return e % 7 == 0 ? kInf : e % 7 == 1 ? -kInf : e % 7 == 2 ? kNaN : 1.0; });
    add_row([&](int e) { return e < E / 2 ? 3.0 : 0.0; });
    add_row([&](int e) { return e >= E / 2 ? 3.0 : 0.0; });
    for (int r = 0; r < 40; ++r) {
      add_row([&](int) { return static_cast<double>(small(rng)); });
      add_row([&](int) { const int v = small(rng); return v == 3 && pick(rng) % 16 == 0 ? kNaN : v; });
      add_row([&](int) { const int v = pick(rng) % 20; return v == 0 ? kInf : v == 1 ? -kInf : v == 2 ? kNaN : small(rng); });
    }
    const int64_t T = static_cast<int64_t>(rows.size()) / E;
    const Tensor logits = host_tensor({T, E}, k.dt, rows);
    // Only 0 and non-finite biases: a finite bias would let two different groups reach the same
    // score through differently rounded sums ((s_a + b) + s_b against (s_b + b) + s_a).
    std::vector<double> bias(E, 0.0);
    for (int e = 0; e < E; ++e) {
      const int v = e % 11;
      bias[e] = v == 0 ? kInf : v == 1 ? -kInf : v == 2 ? kNaN : 0.0;
    }
    const Tensor b = c.use_expert_bias ? host_tensor({E}, DType::kF32, bias) : Tensor();
    const std::string what = describe(c, k.dt, k.idx_dt, T) + " (adversarial rows)";
    const Routed cpu = forward_on(Device::cpu(), c, logits, b, k.idx_dt);
    for (cuda::RouterKernel kern : {cuda::RouterKernel::kWide, cuda::RouterKernel::kLean, cuda::RouterKernel::kSplit}) {
      cuda::set_router_kernel(kern);
      for (double poison : kPoisons)
        expect_forward_match(forward_on(Device::cuda(0), c, logits, b, k.idx_dt, poison), cpu,
                             what + " kernel " + cuda::router_kernel_name(kern));
    }
  }
}

// The benchmark shapes at full size: the multi-level statistics tree (16384 tokens = 512 chunks in
// 16 fan-in groups) and, for DeepSeek-V3's grouped sigmoid router, bf16 as well.
TEST(RouterGpuForward, BenchmarkShapesMatchReference) {
  EPX_REQUIRE_GPU();
  using SF = ScoreFunction;
  const int64_t T = 16384;
  const std::vector<Case> cases = {
      {make_config(256, 8, SF::kSoftmax), DType::kF32, DType::kI32},
      {make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kF32, DType::kI32},
      {make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kBF16, DType::kI64},
  };
  uint64_t seed = 500;
  for (const Case& k : cases) {
    const RouterConfig& c = k.c;
    const std::vector<double> bias = c.use_expert_bias ? random_bias(c.num_experts, seed + 7, 0.05) : std::vector<double>();
    const Tensor b = c.use_expert_bias ? host_tensor({c.num_experts}, DType::kF32, bias) : Tensor();
    const Tensor logits = random_logits(c, T, k.dt, bias, seed++, 2.0, 0.0);
    const Routed cpu = forward_on(Device::cpu(), c, logits, b, k.idx_dt);
    expect_forward_match(forward_on(Device::cuda(0), c, logits, b, k.idx_dt), cpu, describe(c, k.dt, k.idx_dt, T));
  }
}

// Sequence-level statistics: prob_sum [S, E] per sequence; sequences shorter than a chunk, exactly
// one chunk, several chunks in one fan-in group, and more than one group (two-level tree).
TEST(RouterGpuForward, SequenceStatisticsMatchReference) {
  EPX_REQUIRE_GPU();
  struct SeqCase {
    int64_t T, L;
  };
  const SeqCase seqs[] = {{240, 1}, {243, 3}, {1000, 8}, {1000, 40}, {1000, 1000}, {30000, 3000}, {16384, 4096},
                          {16384, 16384}, {8, 8}};
  uint64_t seed = 77;
  for (const SeqCase& s : seqs) {
    RouterConfig c = make_config(64, 4, ScoreFunction::kSigmoid, 4, 2, false, true);
    c.aux_loss = AuxLossType::kSequence;
    c.seq_len = static_cast<int>(s.L);
    const Tensor logits = random_logits(c, s.T, DType::kF32, {}, seed++, 2.0, 0.01);
    const Routed cpu = forward_on(Device::cpu(), c, logits, Tensor(), DType::kI32);
    expect_forward_match(forward_on(Device::cuda(0), c, logits, Tensor(), DType::kI32), cpu,
                         describe(c, DType::kF32, DType::kI32, s.T));
  }
}

TEST(RouterGpuForward, LargeBatch) {
  EPX_REQUIRE_GPU();
  const int64_t T = 131072;
  RouterConfig c = make_config(256, 8, ScoreFunction::kSoftmax, 1, 1, false, true);
  const Tensor logits = random_logits(c, T, DType::kBF16, {}, 4242, 2.0, 0.001);
  const Routed cpu = forward_on(Device::cpu(), c, logits, Tensor(), DType::kI64);
  expect_forward_match(forward_on(Device::cuda(0), c, logits, Tensor(), DType::kI64), cpu,
                       describe(c, DType::kBF16, DType::kI64, T));
  c.aux_loss = AuxLossType::kSequence;
  c.seq_len = 4096;
  const Routed cpu_seq = forward_on(Device::cpu(), c, logits, Tensor(), DType::kI64);
  expect_forward_match(forward_on(Device::cuda(0), c, logits, Tensor(), DType::kI64), cpu_seq,
                       describe(c, DType::kBF16, DType::kI64, T));
}

TEST(RouterGpuForward, EmptyBatchWritesZeroStats) {
  EPX_REQUIRE_GPU();
  for (AuxLossType aux : {AuxLossType::kGlobalBatch, AuxLossType::kSequence}) {
    RouterConfig c = make_config(64, 4, ScoreFunction::kSoftmax);
    c.aux_loss = aux;
    c.seq_len = 4;
    const Tensor logits = Tensor::empty({0, 64}, DType::kF32);
    const Routed gpu = forward_on(Device::cuda(0), c, logits, Tensor(), DType::kI32);
    const Routed cpu = forward_on(Device::cpu(), c, logits, Tensor(), DType::kI32);
    EXPECT_EQ(gpu.idx.numel(), 0);
    EXPECT_TRUE(bit_equal(gpu.prob, cpu.prob));
    EXPECT_TRUE(bit_equal(gpu.scal, cpu.scal));
    EXPECT_TRUE(bit_equal(gpu.counts, cpu.counts));
    for (double v : values(gpu.scal)) EXPECT_EQ(v, 0.0);
  }
}

// Every output, statistics included, bit for bit from run to run (and independent of the poison).
TEST(RouterGpuForward, DeterministicRunToRun) {
  EPX_REQUIRE_GPU();
  const int64_t T = 16384;
  for (AuxLossType aux : {AuxLossType::kGlobalBatch, AuxLossType::kSequence}) {
    RouterConfig c = make_config(256, 8, ScoreFunction::kSigmoid, 8, 4, true, true, 2.5f);
    c.aux_loss = aux;
    c.seq_len = 2048;
    const std::vector<double> bias = random_bias(256, 3, 0.05);
    const Tensor b = host_tensor({256}, DType::kF32, bias);
    // No separation needed: this compares the GPU with itself.
    std::mt19937_64 rng(11);
    std::normal_distribution<double> normal(0.0, 2.0);
    std::vector<double> l(static_cast<size_t>(T) * 256);
    for (double& v : l) v = normal(rng);
    const Tensor logits = host_tensor({T, 256}, DType::kF32, l);
    const Routed first = forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[0]);
    for (int run = 0; run < 3; ++run)
      expect_all_bit_equal(forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[run % 2]), first,
                           "run " + std::to_string(run + 1));
  }
}

// The fast kernels (two tokens per warp where the shape allows, and one token per warp) against the
// legacy kernel: the same expressions in the same order, so topk_idx and topk_weights must agree
// bit for bit on ANY input -- no separation needed -- while prob_sum and scalars[0] differ only in
// rounding (fixed-point accumulation, another summation tree). Rows are drawn to reach every path:
// ordinary, wide (sigmoid's direct path), very negative (the exact reciprocal), all far below zero,
// ties and non-finite values (the exact top-k), fully masked.
std::vector<double> mixed_rows(const RouterConfig& c, int64_t T, DType dt, uint64_t seed) {
  const int E = c.num_experts;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  std::uniform_int_distribution<int> small(0, 3);
  std::vector<double> v(static_cast<size_t>(T) * E);
  for (int64_t t = 0; t < T; ++t) {
    const int kind = static_cast<int>(t % 9);
    for (int e = 0; e < E; ++e) {
      double x = 2.0 * normal(rng);
      switch (kind) {
        case 1: x = 12.0 * normal(rng); break;                      // range > 16: direct sigmoid
        case 2: x = -100.0 + 3.0 * normal(rng); break;               // exact reciprocal paths
        case 3: x = e % 5 == 0 ? -95.0 + normal(rng) : 40.0 * normal(rng); break;
        case 4: x = small(rng); break;                               // exact ties
        case 5: { const int r = small(rng) + 4 * (e % 7 == 0); x = r == 4 ? kInf : r == 5 ? -kInf : r == 6 ? kNaN : r; } break;
        case 6: x = unif(rng) < 0.5 ? kNaN : x; break;
        case 7: x = t % 18 == 7 ? kNaN : x; break;                   // some rows fully masked
        default: break;
      }
      v[static_cast<size_t>(t) * E + e] = round_to_dtype(x, dt);
    }
  }
  return v;
}

TEST(RouterGpuForward, FastKernelsMatchLegacyBitForBit) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  std::vector<Case> cases = forward_cases();
  using SF = ScoreFunction;
  cases.push_back({make_config(256, 8, SF::kSoftmax), DType::kF32, DType::kI32});
  cases.push_back({make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kBF16, DType::kI32});
  cases.push_back({make_config(256, 15, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kF32, DType::kI32});
  cases.push_back({make_config(128, 8, SF::kSoftmaxAfterTopk, 16, 4, true, true), DType::kF32, DType::kI64});
  uint64_t seed = 7000;
  for (const Case& k : cases)
    for (int stats : {1, 2, 0}) {
      RouterConfig c = k.c;
      const int64_t T = stats == 2 ? 1200 : 517;
      if (stats == 2) {
        c.aux_loss = AuxLossType::kSequence;
        c.seq_len = 300;  // several chunks per sequence
      }
      if (stats == 0) {
        c.aux_loss = AuxLossType::kNone;
        c.z_loss_coeff = 0;
      }
      std::vector<double> bias;
      if (c.use_expert_bias) {
        bias = random_bias(c.num_experts, seed + 1, 0.05);
        bias[seed % c.num_experts] = kInf;
        if (c.num_experts > 2) bias[(seed + 1) % c.num_experts] = kNaN;
      }
      const Tensor b = c.use_expert_bias ? host_tensor({c.num_experts}, DType::kF32, bias) : Tensor();
      const Tensor logits = host_tensor({T, c.num_experts}, k.dt, mixed_rows(c, T, k.dt, seed++));
      const std::string what = describe(c, k.dt, k.idx_dt, T);
      auto run = [&](cuda::RouterKernel kern) {
        cuda::set_router_kernel(kern);
        Routed r = stats == 0 ? Routed{} : forward_on(Device::cuda(0), c, logits, b, k.idx_dt);
        if (stats == 0) {
          r.idx = to_gpu(Tensor::full({T, c.topk}, k.idx_dt, kPoisons[0]));
          r.w = to_gpu(Tensor::full({T, c.topk}, DType::kF32, kPoisons[0]));
          route_forward(c, to_gpu(logits), on(Device::cuda(0), b), r.idx, r.w, RouterStats{});
        }
        return r;
      };
      const Routed legacy = run(cuda::RouterKernel::kLegacy);
      for (cuda::RouterKernel kern : {cuda::RouterKernel::kFast, cuda::RouterKernel::kFastOneTokenPerWarp}) {
        const Routed fast = run(kern);
        const std::string w = what + " kernel " + cuda::router_kernel_name(kern) + " stats " + std::to_string(stats);
        EXPECT_TRUE(bit_equal(fast.idx, legacy.idx)) << w << ": topk_idx";
        EXPECT_TRUE(bit_equal(fast.w, legacy.w)) << w << ": topk_weights";
        if (stats == 0) continue;
        EXPECT_TRUE(bit_equal(fast.counts, legacy.counts)) << w << ": counts";
        EXPECT_TRUE(all_close(fast.prob, legacy.prob, 1e-5, 1e-5)) << w << ": prob_sum";
        const std::vector<double> fs = values(fast.scal), ls = values(legacy.scal);
        EXPECT_EQ(fs[1], ls[1]) << w << ": scalars[1] (valid tokens)";
        EXPECT_TRUE(fs[0] == ls[0] || std::fabs(fs[0] - ls[0]) <= 1e-5 * std::fabs(ls[0]) + 1e-6)
            << w << ": scalars[0] got " << fs[0] << ", legacy " << ls[0];
      }
    }
}

// The statistics of the fast kernels (wide, two and one tokens per warp) at the benchmark shape, run
// to run: their shared reduction is fixed point, so the order in which chunks finish cannot matter.
TEST(RouterGpuForward, FastStatisticsDeterministicAtScale) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  for (cuda::RouterKernel kern :
       {cuda::RouterKernel::kWide, cuda::RouterKernel::kFast, cuda::RouterKernel::kFastOneTokenPerWarp}) {
    cuda::set_router_kernel(kern);
    for (AuxLossType aux : {AuxLossType::kGlobalBatch, AuxLossType::kSequence}) {
      RouterConfig c = make_config(256, 8, ScoreFunction::kSoftmax);
      c.aux_loss = aux;
      c.seq_len = 4096;
      const int64_t T = 32768;
      const Tensor logits = host_tensor({T, 256}, DType::kBF16, mixed_rows(c, T, DType::kBF16, 99));
      const Routed first = forward_on(Device::cuda(0), c, logits, Tensor(), DType::kI32, kPoisons[0]);
      for (int run = 0; run < 3; ++run)
        expect_all_bit_equal(forward_on(Device::cuda(0), c, logits, Tensor(), DType::kI32, kPoisons[run % 2]), first,
                             std::string(cuda::router_kernel_name(kern)) + " run " + std::to_string(run + 1));
    }
  }
  // The lean and split kernels serve fp32 logits only; their fallback rows (ties, NaN, infinities) are
  // in the mix.
  for (cuda::RouterKernel kern : {cuda::RouterKernel::kLean, cuda::RouterKernel::kSplit}) {
    cuda::set_router_kernel(kern);
    for (AuxLossType aux : {AuxLossType::kGlobalBatch, AuxLossType::kSequence}) {
      RouterConfig c = make_config(256, 8, ScoreFunction::kSigmoid, 8, 4, true, true, 2.5f);
      c.aux_loss = aux;
      c.seq_len = 4096;
      const int64_t T = 32768;
      const Tensor b = host_tensor({256}, DType::kF32, random_bias(256, 5, 0.05));
      const Tensor logits = host_tensor({T, 256}, DType::kF32, mixed_rows(c, T, DType::kF32, 98));
      const Routed first = forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[0]);
      for (int run = 0; run < 3; ++run)
        expect_all_bit_equal(forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[run % 2]), first,
                             std::string(cuda::router_kernel_name(kern)) + " run " + std::to_string(run + 1));
    }
  }
}

// The wide kernel (the default where it applies) and the one-token-per-warp kernel against the
// reference on the wide kernel's shapes, each forced: random well-separated rows, the benchmark's T
// (one chunk per block over two waves of token pairs) and a T that leaves half-warps idle.
TEST(RouterGpuForward, WideAndFallbackKernelsMatchReference) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  using SF = ScoreFunction;
  const std::vector<Case> cases = {
      {make_config(256, 8, SF::kSoftmax), DType::kF32, DType::kI32},
      {make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kF32, DType::kI64},
      {make_config(256, 8, SF::kSoftmaxAfterTopk, 4, 2, true, true), DType::kBF16, DType::kI32},
      {make_config(128, 16, SF::kSoftmax, 1, 1, true, true, 1.5f), DType::kF32, DType::kI32},
      {make_config(64, 8, SF::kSigmoid, 2, 1, false, true), DType::kBF16, DType::kI32},
  };
  uint64_t seed = 900;
  for (const Case& k : cases)
    for (int64_t T : {int64_t{16384}, int64_t{33}, int64_t{1}}) {
      const RouterConfig& c = k.c;
      const std::vector<double> bias = c.use_expert_bias ? random_bias(c.num_experts, seed + 3, 0.05) : std::vector<double>();
      const Tensor b = c.use_expert_bias ? host_tensor({c.num_experts}, DType::kF32, bias) : Tensor();
      const Tensor logits = random_logits(c, T, k.dt, bias, seed++, 2.0, T > 100 ? 0.001 : 0.05);
      const Routed cpu = forward_on(Device::cpu(), c, logits, b, k.idx_dt);
      for (cuda::RouterKernel kern : {cuda::RouterKernel::kWide, cuda::RouterKernel::kFastOneTokenPerWarp}) {
        cuda::set_router_kernel(kern);
        expect_forward_match(forward_on(Device::cuda(0), c, logits, b, k.idx_dt), cpu,
                             describe(c, k.dt, k.idx_dt, T) + " kernel " + cuda::router_kernel_name(kern));
      }
    }
}

// The lean and split kernels, each forced, against the reference on their shapes: fp32 logits, E in
// {128, 256, 512}, K from 1 to 16 (lean's lane caches of 3 and 4 keys; split serves K <= 8 and runs lean
// above), groups of 2 to 16 lanes (split: groups of 32 and 64 experts), every score function, global and
// sequence statistics. Rows are NaN-free (but rows 3 and 4, and a few NaNs at T = 517), so the fast path
// decides most of them and the exact fallback the rest.
TEST(RouterGpuForward, LeanAndSplitKernelsMatchReference) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  using SF = ScoreFunction;
  std::vector<Case> cases = {
      {make_config(256, 8, SF::kSoftmax), DType::kF32, DType::kI32},
      {make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f), DType::kF32, DType::kI64},
      {make_config(256, 8, SF::kSoftmaxAfterTopk, 4, 2, true, true), DType::kF32, DType::kI32},
      {make_config(256, 16, SF::kSoftmax, 16, 5, false, true), DType::kF32, DType::kI32},
      {make_config(256, 9, SF::kSigmoid), DType::kF32, DType::kI32},
      {make_config(256, 1, SF::kSoftmax, 2, 1, true), DType::kF32, DType::kI32},
      {make_config(128, 8, SF::kSigmoid, 4, 2, true, true, 2.5f), DType::kF32, DType::kI32},
      {make_config(128, 16, SF::kSoftmaxAfterTopk), DType::kF32, DType::kI64},
      {make_config(512, 8, SF::kSigmoid, 16, 4, true, true, 2.5f), DType::kF32, DType::kI32},
      {make_config(512, 12, SF::kSoftmax, 1, 1, true, false, 1.5f), DType::kF32, DType::kI32},
      // Shapes only split serves in its own way: softmax without a bias at each E, groups of 64, no
      // bias with groups, K below 8.
      {make_config(128, 8, SF::kSoftmax, 1, 1, false, true), DType::kF32, DType::kI32},
      {make_config(512, 8, SF::kSoftmax, 1, 1, false, false, 2.0f), DType::kF32, DType::kI64},
      {make_config(256, 3, SF::kSoftmax, 1, 1, false, true), DType::kF32, DType::kI32},
      {make_config(256, 6, SF::kSigmoid, 4, 2, true, true, 2.5f), DType::kF32, DType::kI32},
      {make_config(128, 5, SF::kSigmoid, 2, 1, false, true), DType::kF32, DType::kI32},
      {make_config(512, 8, SF::kSigmoid, 8, 3, false, false), DType::kF32, DType::kI32},
      {make_config(256, 8, SF::kSigmoid, 1, 1, true, true), DType::kF32, DType::kI32},
  };
  RouterConfig seq = make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f);
  seq.aux_loss = AuxLossType::kSequence;
  seq.seq_len = 256;  // several chunks per sequence at T = 16384; one sequence where it does not divide T
  cases.push_back({seq, DType::kF32, DType::kI32});
  uint64_t seed = 1300;
  for (const Case& k : cases)
    for (int64_t T : {int64_t{16384}, int64_t{517}, int64_t{33}, int64_t{1}}) {
      RouterConfig c = k.c;
      if (c.aux_loss == AuxLossType::kSequence && T % c.seq_len != 0) c.seq_len = static_cast<int>(T);
      const std::vector<double> bias =
          c.use_expert_bias ? random_bias(c.num_experts, seed + 3, 0.05) : std::vector<double>();
      const Tensor b = c.use_expert_bias ? host_tensor({c.num_experts}, DType::kF32, bias) : Tensor();
      const Tensor logits = random_logits(c, T, k.dt, bias, seed++, 2.0, T == 517 ? 0.001 : 0.0);
      const Routed cpu = forward_on(Device::cpu(), c, logits, b, k.idx_dt);
      for (cuda::RouterKernel kern : {cuda::RouterKernel::kLean, cuda::RouterKernel::kSplit}) {
        cuda::set_router_kernel(kern);
        for (double poison : kPoisons)
          expect_forward_match(forward_on(Device::cuda(0), c, logits, b, k.idx_dt, poison), cpu,
                               describe(c, k.dt, k.idx_dt, T) + " kernel " + cuda::router_kernel_name(kern));
      }
    }
}

// One batch in which the lean kernel's three paths alternate token by token, so that a chunk's
// statistics join the fast path's and the fallback's: well-separated random rows (fast), rows
// whose V best experts all sit in one lane (a lane's cache runs dry: the row is routed again with
// every key of a lane cached; for split, the picks all come from one lane's list), rows of small
// integers (exact ties: the fallback) and rows with an infinity or NaN (the fallback's non-finite
// handling). Against the reference, and bit for bit run to run; the same for the split kernel.
TEST(RouterGpuForward, LeanAndSplitKernelsMixFastAndExactRows) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  using SF = ScoreFunction;
  for (const RouterConfig& c :
       {make_config(256, 8, SF::kSoftmax), make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f),
        make_config(512, 16, SF::kSoftmaxAfterTopk, 1, 1, false, true)}) {
    const int E = c.num_experts, V = E / 32;
    const int64_t T = 3000;
    const std::vector<double> bias = c.use_expert_bias ? random_bias(E, 17, 0.05) : std::vector<double>();
    const Tensor b = c.use_expert_bias ? host_tensor({E}, DType::kF32, bias) : Tensor();
    std::mt19937_64 rng(4242 + E);
    std::normal_distribution<double> normal(0.0, 2.0);
    std::uniform_int_distribution<int> small(0, 3);
    std::vector<double> rows(static_cast<size_t>(T) * E), row(E);
    for (int64_t t = 0; t < T; ++t) {
      const int kind = static_cast<int>(t % 4);
      bool ok = false;
      for (int attempt = 0; attempt < 1000 && !ok; ++attempt) {
        for (int e = 0; e < E; ++e) row[e] = round_to_dtype(normal(rng), DType::kF32);
        if (kind == 1) {  // the lane (t / 4) % 32 holds the row's V largest logits, well apart
          const int lane = static_cast<int>((t / 4) % 32);
          for (int i = 0; i < V; ++i)
            row[lane * V + i] = round_to_dtype(6.0 + 0.37 * i + 0.01 * normal(rng), DType::kF32);
        } else if (kind == 2) {
          for (int e = 0; e < E; ++e) row[e] = small(rng);
        } else if (kind == 3) {
          row[static_cast<size_t>(t % E)] = t % 8 == 3 ? kNaN : (t % 8 == 7 ? -kInf : kInf);
        }
        ok = well_separated(c, row, bias);  // exact ties pass, near ones (a bias sum) do not
      }
      ASSERT_TRUE(ok) << "could not draw row " << t;
      std::copy(row.begin(), row.end(), rows.begin() + t * E);
    }
    const Tensor logits = host_tensor({T, E}, DType::kF32, rows);
    const Routed cpu = forward_on(Device::cpu(), c, logits, b, DType::kI32);
    for (cuda::RouterKernel kern : {cuda::RouterKernel::kLean, cuda::RouterKernel::kSplit}) {
      const std::string what = describe(c, DType::kF32, DType::kI32, T) + " kernel " +
                               cuda::router_kernel_name(kern) + ", mixed rows";
      cuda::set_router_kernel(kern);
      const Routed first = forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[0]);
      expect_forward_match(first, cpu, what);
      for (int run = 0; run < 2; ++run)
        expect_all_bit_equal(forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[run % 2]), first,
                             what + " run " + std::to_string(run + 2));
    }
  }
}

// The split kernel's truncated keys (router_split_kernels.cuh), as a row builder needs them: for softmax the
// top 32 - IBK bits of u = exp(x), for sigmoid the fixed point of the selection value over [min b, 1 + max b],
// rounded. place() gives a logit whose key is bucket n, at fraction f of the bucket (0 and 1: its edges);
// where() gives the bucket and fraction of a logit as the host computes them.
class SplitKeys {
 public:
  SplitKeys(const RouterConfig& c, const std::vector<double>& bias)
      : sigmoid_(c.score_function == ScoreFunction::kSigmoid), ibk_(c.num_experts <= 256 ? 8 : 9), bias_(bias) {
    float lo = 0.0f, hi = 0.0f;
    if (!bias.empty()) {
      lo = static_cast<float>(*std::min_element(bias.begin(), bias.end()));
      hi = static_cast<float>(*std::max_element(bias.begin(), bias.end()));
    }
    lo_ = lo;
    scale_ = static_cast<float>((1u << 23) - 128u) / ((hi + 1.0f) - lo);
  }
  // A bucket whose values lie near `value` (softmax: u in [32, 64); sigmoid: a selection value).
  uint32_t bucket_near(double value) const {
    if (!sigmoid_) return static_cast<uint32_t>(float_bits(static_cast<float>(value)) >> ibk_);
    return static_cast<uint32_t>(std::floor((value - lo_) * scale_));
  }
  float place(uint32_t n, double f, int e) const {
    if (!sigmoid_) {
      const uint32_t bits = (n << ibk_) | static_cast<uint32_t>(f * (1u << ibk_));
      float u;
      std::memcpy(&u, &bits, sizeof u);
      return static_cast<float>(std::log(static_cast<double>(u)));
    }
    const double sel = lo_ + (n - 0.5 + f) / scale_;  // bucket n holds positions [n - 0.5, n + 0.5)
    const double sc = sel - b(e);
    return static_cast<float>(std::log(sc / (1.0 - sc)));
  }
  std::pair<uint32_t, double> where(float x, int e) const {
    if (!sigmoid_) {
      const uint32_t bits = float_bits(static_cast<float>(std::exp(static_cast<double>(x))));
      return {bits >> ibk_, (bits & ((1u << ibk_) - 1u)) / static_cast<double>(1u << ibk_)};
    }
    const float sc = static_cast<float>(sigmoid(x));
    const float sel = sc + static_cast<float>(b(e)), above = sel - lo_;
    const double pos = static_cast<double>(above) * scale_;
    const double n = std::nearbyint(pos);
    return {static_cast<uint32_t>(n), pos - n + 0.5};
  }

 private:
  static uint32_t float_bits(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return bits;
  }
  double b(int e) const { return bias_.empty() ? 0.0 : bias_[e]; }
  bool sigmoid_;
  int ibk_;
  std::vector<double> bias_;
  float lo_, scale_;
};

// Rows whose picks K - 1 and K share the split kernel's truncated key while their full keys differ by far more
// than the GPU and the reference can disagree about: the split kernel settles them from the tile (with three
// tied values, two of them picks, the exact code decides). Each tied value lies at least 0.1 of its bucket
// from either edge (>= 25 ulps of u or of the selection value), beyond the
// few-ulp errors of the GPU's approximate exponential and sigmoid. Row kinds, in turn: a tied pair at the
// boundary; an exact tie there (one logit twice: the lower expert wins); a tied trio; a tied pair inside the
// top K (a re-sort); with groups, a tied pair and a value of the tied key in a dropped group that would win if
// it counted. Values above the tie are well apart, the rest far below it.
TEST(RouterGpuForward, SplitSettlesBoundaryTiesFromTheTile) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  using SF = ScoreFunction;
  cuda::set_router_kernel(cuda::RouterKernel::kSplit);
  const std::vector<RouterConfig> configs = {
      make_config(256, 8, SF::kSoftmax),         make_config(256, 4, SF::kSoftmax, 1, 1, false, true),
      make_config(128, 8, SF::kSoftmax),         make_config(512, 8, SF::kSoftmax),
      make_config(256, 8, SF::kSigmoid),         make_config(256, 8, SF::kSigmoid, 8, 4, true, true, 2.5f),
      make_config(512, 8, SF::kSigmoid, 16, 4, true, true)};
  const int64_t T = 2003;
  for (const RouterConfig& c : configs) {
    const int E = c.num_experts, K = c.topk;
    const bool sigmoid = c.score_function == SF::kSigmoid, grouped = c.num_groups > 1;
    std::vector<double> bias = c.use_expert_bias ? random_bias(E, 77 + E, 1e-4) : std::vector<double>();
    for (size_t e = 0; e + 1 < bias.size(); e += 2) bias[e + 1] = bias[e];  // pairs of equal bias (exact ties)
    const SplitKeys keys(c, bias);
    std::mt19937_64 rng(9000 + E + K + 31 * c.num_groups);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> unif(0.0, 1.0);
    const int per = E / c.num_groups;
    std::vector<double> rows(static_cast<size_t>(T) * E);
    for (int64_t t = 0; t < T; ++t) {
      const int kind = static_cast<int>(t % (grouped ? 5 : 4));
      double* row = rows.data() + t * E;
      for (int e = 0; e < E; ++e)  // far below the tie: u < 21, or a score below 1.3e-4
        row[e] = round_to_dtype(sigmoid ? std::min(-12.0 + 0.5 * normal(rng), -9.0) : std::min(normal(rng), 3.0),
                                DType::kF32);
      // Kept groups: the first group_topk of a random order of the groups (every group without groups).
      std::vector<int> groups(c.num_groups);
      std::iota(groups.begin(), groups.end(), 0);
      std::shuffle(groups.begin(), groups.end(), rng);
      const int nkept = grouped ? c.group_topk : 1;
      std::vector<int> used;
      auto expert_in = [&](int g) {  // a random expert of group g not used yet in this row
        for (;;) {
          const int e = g * per + static_cast<int>(unif(rng) * per);
          if (std::find(used.begin(), used.end(), e) == used.end()) {
            used.push_back(e);
            return e;
          }
        }
      };
      int next_group = 0;
      auto kept_expert = [&] { return expert_in(groups[next_group++ % nkept]); };  // each kept group in turn first
      const int above = kind == 2 || kind == 3 ? K - 2 : K - 1;  // picks above the tie
      for (int i = 0; i < above; ++i)
        row[kept_expert()] = sigmoid ? -2.0 - 0.35 * i : 6.0 + 0.3 * i;  // scores 0.12 .. 0.016, or u >= 403
      const uint32_t n = keys.bucket_near(sigmoid ? 0.002 + 0.002 * unif(rng) : 32.0 + 31.0 * unif(rng));
      std::vector<std::pair<int, double>> tied;  // (expert, fraction of the bucket)
      if (kind == 1) {  // the same logit twice; with a bias, on two experts of the same bias (e, e ^ 1)
        int a = kept_expert(), b = a ^ 1;
        if (c.use_expert_bias) {
          while (std::find(used.begin(), used.end(), b) != used.end()) b = (a = kept_expert()) ^ 1;
          used.push_back(b);
        } else {
          b = kept_expert();
        }
        tied = {{a, 0.5}, {b, 0.5}};
        for (const auto& [e, f] : tied) row[e] = keys.place(n, f, e);
      } else {
        const int count = kind == 2 ? 3 : 2;
        const double fr[3] = {0.12, count == 3 ? 0.5 : 0.88, 0.88};
        for (int i = 0; i < count; ++i) tied.push_back({kept_expert(), fr[i]});
        if (kind == 4) {  // the pair lower in the bucket, and above both a value in a dropped group
          tied[1].second = 0.5;
          tied.push_back({expert_in(groups[nkept + static_cast<int>(unif(rng) * (c.num_groups - nkept))]), 0.88});
        }
        for (const auto& [e, f] : tied) row[e] = keys.place(n, f, e);
      }
      for (const auto& [e, f] : tied) {
        const auto [bucket, at] = keys.where(static_cast<float>(row[e]), e);
        ASSERT_EQ(bucket, n) << "row " << t << ": a tied value left its bucket";
        ASSERT_NEAR(at, f, 0.03) << "row " << t << ": a tied value moved inside its bucket";
      }
    }
    const Tensor b = c.use_expert_bias ? host_tensor({E}, DType::kF32, bias) : Tensor();
    const Tensor logits = host_tensor({T, E}, DType::kF32, rows);
    const Routed cpu = forward_on(Device::cpu(), c, logits, b, DType::kI32);
    const std::string what = describe(c, DType::kF32, DType::kI32, T) + " kernel split, boundary ties";
    const Routed first = forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[0]);
    expect_forward_match(first, cpu, what);
    expect_all_bit_equal(forward_on(Device::cuda(0), c, logits, b, DType::kI32, kPoisons[1]), first, what + " run 2");
  }
}

// One sequence of 2^22 + 5 rows in which expert 0 takes almost every row's probability: its prob_sum passes 2^22,
// which in the accumulators' 2^-32 units would reach the arrival count above the sum, so the kernels take coarser
// units for sequences this long (2^-30 here). prob_sum and the scalars, for each kernel that keeps the counted
// accumulators, against sums in double (the reference's fp32 running sums drift over this many rows).
TEST(RouterGpuForward, LongSequenceStatisticsStayInTheirBits) {
  EPX_REQUIRE_GPU();
  const RouterKernelRestorer restore_kernel;
  const RouterConfig c = make_config(128, 2, ScoreFunction::kSoftmax);
  const int64_t T = (int64_t{1} << 22) + 5, E = c.num_experts;
  Tensor logits = Tensor::empty({T, E}, DType::kF32);
  float* l = static_cast<float*>(logits.data());
  std::mt19937_64 rng(2222);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<double> prob(E, 0.0), p(E);
  double lse_sq = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    float* row = l + t * E;
    double z = 0.0;
    for (int e = 0; e < E; ++e) {
      row[e] = e == 0 ? 20.0f : normal(rng);
      p[e] = std::exp(static_cast<double>(row[e]) - 20.0);
      z += p[e];
    }
    for (int e = 0; e < E; ++e) prob[e] += p[e] / z;
    const double lse = 20.0 + std::log(z);
    lse_sq += lse * lse;
  }
  ASSERT_GT(prob[0], 4194304.0) << "expert 0's prob_sum should pass 2^22";
  const Tensor want_prob = host_tensor({1, E}, DType::kF32, prob);
  for (cuda::RouterKernel kern : {cuda::RouterKernel::kSplit, cuda::RouterKernel::kLean, cuda::RouterKernel::kWide}) {
    cuda::set_router_kernel(kern);
    const Routed gpu = forward_on(Device::cuda(0), c, logits, Tensor(), DType::kI32);
    const std::string what = std::string("kernel ") + cuda::router_kernel_name(kern);
    EXPECT_TRUE(all_close(gpu.prob, want_prob, 1e-5, 2e-4)) << what << ": prob_sum";
    const std::vector<double> gs = values(gpu.scal);
    EXPECT_EQ(gs[1], static_cast<double>(T)) << what << ": scalars[1] (valid tokens)";
    EXPECT_NEAR(gs[0], lse_sq, 2e-4 * lse_sq) << what << ": scalars[0] (sum of lse^2)";
    EXPECT_EQ(cuda::router_status(0, Stream{}), 0u) << what;
  }
}

// Without statistics tensors (no loss configured) only the routing is written.
TEST(RouterGpuForward, WithoutStatistics) {
  EPX_REQUIRE_GPU();
  for (ScoreFunction f : {ScoreFunction::kSoftmax, ScoreFunction::kSoftmaxAfterTopk, ScoreFunction::kSigmoid}) {
    RouterConfig c = make_config(128, 6, f, 4, 2, false, true);
    c.aux_loss = AuxLossType::kNone;
    c.z_loss_coeff = 0;
    const Tensor logits = random_logits(c, 300, DType::kF32, {}, 5 + static_cast<int>(f));
    Tensor idx = Tensor::full({300, 6}, DType::kI32, kPoisons[0]), w = Tensor::full({300, 6}, DType::kF32, kPoisons[0]);
    route_forward(c, logits, Tensor(), idx, w, RouterStats{});
    const Tensor g_logits = to_gpu(logits), g_idx = to_gpu(Tensor::full({300, 6}, DType::kI32, kPoisons[1]));
    const Tensor g_w = to_gpu(Tensor::full({300, 6}, DType::kF32, kPoisons[1]));
    route_forward(c, g_logits, Tensor(), g_idx, g_w, RouterStats{});
    EXPECT_TRUE(bit_equal(g_idx, idx)) << score_function_name(f);
    EXPECT_TRUE(all_close(g_w, w, 1e-7, 3e-5)) << score_function_name(f);
  }
}

// A non-blocking stream of its own: results as on the default stream, scratch per stream.
TEST(RouterGpuForward, OwnStream) {
  EPX_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  RouterConfig c = make_config(256, 8, ScoreFunction::kSoftmax);
  const Tensor logits = random_logits(c, 4096, DType::kF32, {}, 31);
  const Routed cpu = forward_on(Device::cpu(), c, logits, Tensor(), DType::kI32);
  const Tensor l = to_gpu(logits);
  Routed gpu = outputs(Device::cuda(0), c, 4096, DType::kI32, kPoisons[1]);
  // The uploads ran on the legacy default stream, which a non-blocking stream does not wait for.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  route_forward(c, l, Tensor(), gpu.idx, gpu.w, gpu.stats(), Stream{s});
  count_routed(c, gpu.idx, gpu.stats(), Stream{s});
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  expect_forward_match(gpu, cpu, "own stream");
  EXPECT_EQ(cuda::router_status(0, Stream{s}), 0u);
  ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// ---- count_routed -------------------------------------------------------------------------------

Tensor random_routing(int64_t T, int K, int E, DType dt, uint64_t seed, double mask_frac) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> ids;
  std::vector<int> perm(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    // Skewed: the first experts are picked more often.
    std::sort(perm.begin(), perm.begin() + std::min(E, 2 * K));
    for (int k = 0; k < K; ++k) ids.push_back(u(rng) < mask_frac ? -1.0 : perm[k]);
  }
  return host_tensor({T, K}, dt, ids);
}

TEST(RouterGpuCount, MatchesReferenceExactly) {
  EPX_REQUIRE_GPU();
  struct CountCase {
    int64_t T;
    int E, K;
    int seq_len;
    DType idx_dt, cnt_dt;
  };
  const CountCase cases[] = {{0, 8, 2, 0, DType::kI32, DType::kF32},      {1, 8, 8, 0, DType::kI64, DType::kF32},
                             {5000, 256, 8, 0, DType::kI32, DType::kF32}, {5000, 256, 8, 0, DType::kI64, DType::kF64},
                             {4096, 512, 16, 0, DType::kI32, DType::kF32}, {1200, 64, 6, 40, DType::kI32, DType::kF32},
                             {1200, 64, 6, 1, DType::kI64, DType::kF64},  {100000, 96, 8, 0, DType::kI32, DType::kF32}};
  uint64_t seed = 3;
  for (const CountCase& k : cases) {
    RouterConfig c = make_config(k.E, k.K, ScoreFunction::kSoftmax);
    if (k.seq_len) {
      c.aux_loss = AuxLossType::kSequence;
      c.seq_len = k.seq_len;
    }
    const int64_t S = num_seq(c, k.T);
    const Tensor ids = random_routing(k.T, k.K, k.E, k.idx_dt, seed++, 0.05);
    Tensor want = Tensor::full({S, k.E}, k.cnt_dt, kPoisons[0]);
    count_routed(c, ids, RouterStats{TensorRef(), want, TensorRef()});
    for (double poison : kPoisons) {
      Tensor got = to_gpu(Tensor::full({S, k.E}, k.cnt_dt, poison));
      const Tensor g_ids = to_gpu(ids);
      count_routed(c, g_ids, RouterStats{TensorRef(), got, TensorRef()});
      EXPECT_TRUE(bit_equal(got, want)) << "T=" << k.T << " E=" << k.E << " K=" << k.K << " seq_len=" << k.seq_len;
    }
  }
  EXPECT_EQ(cuda::router_status(0, Stream{}), 0u);
}

// Ids only the device sees: out of range or repeated within a row. The reference throws; the GPU
// masks them (counting the first occurrence of a repeat) and reports them in the status word.
TEST(RouterGpuCount, BadIdsAreMaskedAndReported) {
  EPX_REQUIRE_GPU();
  cuda::router_status(0, Stream{});  // start clean
  RouterConfig c = make_config(16, 4, ScoreFunction::kSoftmax);
  const std::vector<double> bad = {0, 1, 2, 3,  16, 1, 2, -1,  -2, 5, 5, 5,  7, 1e12, 7, 3,  4, 4, -1, -1};
  const std::vector<double> clean = {0, 1, 2, 3, -1, 1, 2, -1, -1, 5, -1, -1, 7, -1, -1, 3, 4, -1, -1, -1};
  Tensor want = Tensor::zeros({1, 16}, DType::kF32);
  count_routed(c, host_tensor({5, 4}, DType::kI64, clean), RouterStats{TensorRef(), want, TensorRef()});
  Tensor got = to_gpu(Tensor::full({1, 16}, DType::kF32, kPoisons[0]));
  count_routed(c, to_gpu(host_tensor({5, 4}, DType::kI64, bad)), RouterStats{TensorRef(), got, TensorRef()});
  EXPECT_TRUE(bit_equal(got, want));
  EXPECT_EQ(cuda::router_status(0, Stream{}), cuda::kRouterStatusBadExpertId | cuda::kRouterStatusRepeatedExpertId);
  EXPECT_EQ(cuda::router_status(0, Stream{}), 0u) << "reading clears the status";
  // int32 ids out of range only.
  const std::vector<double> bad32 = {0, 1, 2, 30, 3, -5, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  const std::vector<double> clean32 = {0, 1, 2, -1, 3, -1, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  count_routed(c, host_tensor({5, 4}, DType::kI32, clean32), RouterStats{TensorRef(), want, TensorRef()});
  count_routed(c, to_gpu(host_tensor({5, 4}, DType::kI32, bad32)), RouterStats{TensorRef(), got, TensorRef()});
  EXPECT_TRUE(bit_equal(got, want));
  EXPECT_EQ(cuda::router_status(0, Stream{}), cuda::kRouterStatusBadExpertId);
}

// ---- router_losses ------------------------------------------------------------------------------

TEST(RouterGpuLosses, MatchReference) {
  EPX_REQUIRE_GPU();
  std::mt19937_64 rng(8);
  std::uniform_real_distribution<double> u(0.0, 50.0);
  std::uniform_int_distribution<int> n(0, 400);
  for (DType sdt : {DType::kF32, DType::kF64})
    for (DType ldt : {DType::kF32, DType::kF64})
      for (AuxLossType aux : {AuxLossType::kNone, AuxLossType::kGlobalBatch, AuxLossType::kSequence})
        for (int variant = 0; variant < 3; ++variant) {
          RouterConfig c = make_config(256, 8, ScoreFunction::kSoftmax);
          c.aux_loss = aux;
          c.seq_len = 512;
          c.aux_loss_coeff = variant == 1 ? 0.0f : 0.01f;
          c.z_loss_coeff = variant == 2 ? 0.0f : 0.001f;
          const int64_t S = aux == AuxLossType::kSequence ? (variant == 2 ? 0 : 9) : 1;
          std::vector<double> p(S * 256), k(S * 256);
          for (auto& v : p) v = u(rng);
          for (auto& v : k) v = n(rng);
          const double tokens = variant == 2 ? 0.0 : 4096.0;
          const Tensor hp = host_tensor({S, 256}, sdt, p), hk = host_tensor({S, 256}, sdt, k);
          const Tensor hs = host_tensor({2}, sdt, {1234.5, tokens});
          const bool with_pk = aux != AuxLossType::kNone;
          const RouterStats hstats{with_pk ? hp.ref() : TensorRef(), with_pk ? hk.ref() : TensorRef(), hs.ref()};
          Tensor want = Tensor::full({2}, ldt, kPoisons[0]);
          router_losses(c, hstats, want);
          const Tensor gp = to_gpu(hp), gk = to_gpu(hk), gs = to_gpu(hs);
          const RouterStats gstats{with_pk ? gp.ref() : TensorRef(), with_pk ? gk.ref() : TensorRef(), gs.ref()};
          Tensor got = to_gpu(Tensor::full({2}, ldt, kPoisons[1]));
          router_losses(c, gstats, got);
          const double rtol = sdt == DType::kF64 && ldt == DType::kF64 ? 1e-13 : 1e-5;
          EXPECT_TRUE(all_close(got, want, 0.0, rtol))
              << dtype_name(sdt) << " stats, " << dtype_name(ldt) << " losses, aux " << static_cast<int>(aux)
              << ", variant " << variant;
        }
}

// ---- route_backward -----------------------------------------------------------------------------

struct BwdCase {
  RouterConfig c;
  DType dt;
  bool with_dw;
  double d_aux, d_z;
};

// Backward on the same logits, routing and statistics as the reference (the reference's own),
// so that only the backward is compared.
void check_backward(const BwdCase& k, const Tensor& logits, const Tensor& bias, const std::string& what) {
  const RouterConfig& c = k.c;
  const int64_t T = logits.size(0);
  const Routed ref = forward_on(Device::cpu(), c, logits, bias, DType::kI32);
  std::mt19937_64 rng(T + c.num_experts);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> g(static_cast<size_t>(T) * c.topk);
  for (double& v : g) v = normal(rng);
  const Tensor dw = host_tensor({T, c.topk}, DType::kF32, g);
  const TensorRef dw_ref = k.with_dw ? dw.ref() : TensorRef();
  Tensor want = Tensor::full({T, c.num_experts}, k.dt, kPoisons[0]);
  route_backward(c, logits, bias, ref.idx, dw_ref, ref.stats(), k.d_aux, k.d_z, want);

  const Tensor gl = to_gpu(logits), gb = on(Device::cuda(0), bias), gidx = to_gpu(ref.idx), gdw = to_gpu(dw);
  const Tensor gp = to_gpu(ref.prob), gc = to_gpu(ref.counts), gs = to_gpu(ref.scal);
  const RouterStats gstats{gp.ref(), gc.ref(), gs.ref()};
  double worst = 0;
  for (double v : values(want))
    if (std::isfinite(v)) worst = std::max(worst, std::fabs(v));
  const double atol = 1e-5 * worst + 1e-12, rtol = k.dt == DType::kBF16 ? 1e-2 : 1e-4;
  for (double poison : kPoisons) {
    Tensor got = to_gpu(Tensor::full({T, c.num_experts}, k.dt, poison));
    route_backward(c, gl, gb, gidx, k.with_dw ? gdw.ref() : TensorRef(), gstats, k.d_aux, k.d_z, got);
    EXPECT_TRUE(all_close(got, want, atol, rtol)) << what;
  }
}

TEST(RouterGpuBackward, MatchesReference) {
  EPX_REQUIRE_GPU();
  using SF = ScoreFunction;
  std::vector<BwdCase> cases;
  for (SF f : {SF::kSoftmax, SF::kSoftmaxAfterTopk, SF::kSigmoid})
    for (DType dt : {DType::kF32, DType::kBF16}) {
      cases.push_back({make_config(64, 6, f, 1, 1, false, true, 2.0f), dt, true, 1.0, 1.0});
      cases.push_back({make_config(256, 8, f, 8, 4, true, true, 2.5f), dt, true, 0.5, 2.0});
      cases.push_back({make_config(96, 5, f, 4, 2, false, false), dt, false, 1.0, 1.0});
      cases.push_back({make_config(512, 16, f), dt, true, 0.0, 1.0});
      cases.push_back({make_config(33, 4, f, 1, 1, false, true), dt, true, 1.0, 0.0});
      cases.push_back({make_config(8, 8, f, 1, 1, false, true), dt, true, 1.0, 1.0});
    }
  {
    RouterConfig c = make_config(128, 8, SF::kSigmoid, 4, 2, true, true, 2.5f);
    c.aux_loss = AuxLossType::kSequence;
    c.seq_len = 100;
    cases.push_back({c, DType::kF32, true, 1.0, 1.0});
    c.score_function = SF::kSoftmax;
    cases.push_back({c, DType::kBF16, true, 1.0, 1.0});
  }
  {
    RouterConfig c = make_config(64, 4, SF::kSoftmax);
    c.aux_loss = AuxLossType::kNone;
    c.z_loss_coeff = 0;
    cases.push_back({c, DType::kF32, true, 1.0, 1.0});
  }
  uint64_t seed = 900;
  for (const BwdCase& k : cases) {
    const RouterConfig& c = k.c;
    const std::vector<double> bias = c.use_expert_bias ? random_bias(c.num_experts, seed + 5, 0.05) : std::vector<double>();
    const Tensor b = c.use_expert_bias ? host_tensor({c.num_experts}, DType::kF32, bias) : Tensor();
    const Tensor logits = random_logits(c, 400, k.dt, bias, seed++);
    std::ostringstream what;
    what << describe(c, k.dt, DType::kI32, 400) << (k.with_dw ? " d_w" : " no d_w") << " d_aux=" << k.d_aux
         << " d_z=" << k.d_z;
    check_backward(k, logits, b, what.str());
  }
}

// Saturated rows (+inf, all -inf), NaN entries, masked rows and a single eligible expert: the
// reference gives exact zeros there; the GPU must too (within the same tolerance elsewhere).
TEST(RouterGpuBackward, NonFiniteRowsMatchReference) {
  EPX_REQUIRE_GPU();
  using SF = ScoreFunction;
  for (SF f : {SF::kSoftmax, SF::kSoftmaxAfterTopk, SF::kSigmoid}) {
    RouterConfig c = make_config(16, 4, f, 1, 1, false, true, 1.5f);
    c.z_loss_coeff = 0;  // an infinite lse would make the z gradient meaningless
    std::vector<double> rows;
    auto add_row = [&](const std::function<double(int)>& fn) {
      for (int e = 0; e < 16; ++e) rows.push_back(fn(e));
    };
    add_row([](int e) { return e == 3 ? kNaN : 0.5 * e - 2; });
    add_row([](int) { return kNaN; });
    add_row([](int e) { return e == 9 ? 1.0 : kNaN; });
    add_row([](int e) { return e == 2 || e == 5 ? kInf : 0.25 * e; });
    add_row([](int) { return -kInf; });
    add_row([](int e) { return e % 2 ? kInf : -kInf; });
    add_row([](int e) { return e % 3 ? 1.0 : 2.0; });
    add_row([](int e) { return std::sin(e) * 3; });
    const Tensor logits = host_tensor({8, 16}, DType::kF32, rows);
    check_backward({c, DType::kF32, true, 1.0, 0.0}, logits, Tensor(), std::string(score_function_name(f)) + " non-finite");
  }
}

TEST(RouterGpuBackward, BadIdsAreMaskedAndReported) {
  EPX_REQUIRE_GPU();
  cuda::router_status(0, Stream{});
  RouterConfig c = make_config(16, 4, ScoreFunction::kSoftmax, 1, 1, false, true);
  const Tensor logits = random_logits(c, 5, DType::kF32, {}, 17, 2.0, 0.0);
  const std::vector<double> bad = {0, 1, 2, 3, 16, 1, 2, -1, -2, 5, 5, 5, 7, 1e12, 7, 3, 4, 4, -1, -1};
  const std::vector<double> clean = {0, 1, 2, 3, -1, 1, 2, -1, -1, 5, -1, -1, 7, -1, -1, 3, 4, -1, -1, -1};
  const Tensor ids_clean = host_tensor({5, 4}, DType::kI64, clean);
  Routed ref = forward_on(Device::cpu(), c, logits, Tensor(), DType::kI32);
  count_routed(c, ids_clean, ref.stats());
  const Tensor dw = host_tensor({5, 4}, DType::kF32, std::vector<double>(20, 0.5));
  Tensor want = Tensor::empty({5, 16}, DType::kF32);
  route_backward(c, logits, Tensor(), ids_clean, dw, ref.stats(), 1.0, 1.0, want);
  const Tensor gp = to_gpu(ref.prob), gc = to_gpu(ref.counts), gs = to_gpu(ref.scal);
  Tensor got = to_gpu(Tensor::full({5, 16}, DType::kF32, kPoisons[0]));
  route_backward(c, to_gpu(logits), Tensor(), to_gpu(host_tensor({5, 4}, DType::kI64, bad)), to_gpu(dw),
                 RouterStats{gp.ref(), gc.ref(), gs.ref()}, 1.0, 1.0, got);
  EXPECT_TRUE(all_close(got, want, 1e-7, 1e-4));
  EXPECT_EQ(cuda::router_status(0, Stream{}), cuda::kRouterStatusBadExpertId | cuda::kRouterStatusRepeatedExpertId);
}

// ---- update_expert_bias -------------------------------------------------------------------------

TEST(RouterGpuBias, UpdateMatchesReferenceExactly) {
  EPX_REQUIRE_GPU();
  std::mt19937_64 rng(21);
  std::uniform_int_distribution<int> n(0, 30);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int E : {1, 7, 256, 3000})
    for (DType cdt : {DType::kF32, DType::kF64}) {
      std::vector<double> b(E), k(E);
      for (auto& v : b) v = static_cast<float>(u(rng));
      for (auto& v : k) v = n(rng);
      if (E == 7) std::fill(k.begin(), k.end(), 5.0);  // every load equal to the mean: exact 0 steps
      Tensor want = host_tensor({E}, DType::kF32, b);
      const Tensor counts = host_tensor({E}, cdt, k);
      update_expert_bias(want, counts, 0.001f);
      Tensor got = to_gpu(host_tensor({E}, DType::kF32, b));
      update_expert_bias(got, to_gpu(counts), 0.001f);
      EXPECT_TRUE(bit_equal(got, want)) << "E=" << E << " counts " << dtype_name(cdt);
    }
}

// ---- requests the kernels do not serve ----------------------------------------------------------

template <class F>
void expect_error(F&& f, const std::string& needle, Status status) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(RouterGpuErrors, UnsupportedRequestsAreRefused) {
  EPX_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  auto fwd = [&](const RouterConfig& c, DType dt) {
    const Tensor l = Tensor::zeros({4, c.num_experts}, dt, dev);
    const Tensor idx = Tensor::empty({4, c.topk}, DType::kI32, dev);
    const DType f = dt == DType::kF64 ? DType::kF64 : DType::kF32;
    const Tensor w = Tensor::empty({4, c.topk}, f, dev);
    route_forward(c, l, Tensor(), idx, w, RouterStats{});
  };
  RouterConfig c = make_config(64, 4, ScoreFunction::kSoftmax);
  c.aux_loss = AuxLossType::kNone;
  c.z_loss_coeff = 0;
  expect_error([&] { fwd(c, DType::kF64); }, "epx::route_forward: logits are fp64, the CUDA router takes fp32 or bf16",
               Status::kNotSupported);
  RouterConfig big = c;
  big.num_experts = 513;
  expect_error([&] { fwd(big, DType::kF32); }, "config.num_experts is 513, the CUDA router supports at most 512",
               Status::kNotSupported);
  RouterConfig many = c;
  many.topk = 17;
  expect_error([&] { fwd(many, DType::kF32); }, "config.topk is 17, the CUDA router supports at most 16",
               Status::kNotSupported);
  RouterConfig groups = c;
  groups.num_groups = 32;
  groups.group_topk = 4;
  expect_error([&] { fwd(groups, DType::kBF16); }, "config.num_groups is 32, the CUDA router supports at most 16",
               Status::kNotSupported);
  // Backward in fp64 and count_routed beyond the limits too.
  {
    const Tensor l = Tensor::zeros({4, 64}, DType::kF64, dev), d = Tensor::zeros({4, 64}, DType::kF64, dev);
    const Tensor idx = Tensor::zeros({4, 4}, DType::kI32, dev);
    expect_error([&] { route_backward(c, l, Tensor(), idx, TensorRef(), RouterStats{}, 1, 1, d); },
                 "epx::route_backward: logits are fp64", Status::kNotSupported);
  }
  {
    const Tensor idx = Tensor::zeros({4, 17}, DType::kI32, dev), counts = Tensor::zeros({1, 64}, DType::kF32, dev);
    expect_error([&] { count_routed(many, idx, RouterStats{TensorRef(), counts, TensorRef()}); },
                 "epx::count_routed: config.topk is 17", Status::kNotSupported);
  }
}

// ---- the whole router on the GPU ----------------------------------------------------------------

// forward -> count -> losses -> backward, every step on the device (no host round trip in
// between), against the same chain on the host.
TEST(RouterGpuPipeline, ForwardLossesBackwardMatchReference) {
  EPX_REQUIRE_GPU();
  for (AuxLossType aux : {AuxLossType::kGlobalBatch, AuxLossType::kSequence}) {
    RouterConfig c = make_config(256, 8, ScoreFunction::kSigmoid, 8, 4, true, true, 2.5f);
    c.aux_loss = aux;
    c.seq_len = 1024;
    const int64_t T = 4096;
    const std::vector<double> bias = random_bias(256, 41, 0.05);
    const Tensor b = host_tensor({256}, DType::kF32, bias);
    const Tensor logits = random_logits(c, T, DType::kBF16, bias, 40, 2.0, 0.01);
    std::mt19937_64 rng(5);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> g(T * 8);
    for (double& v : g) v = normal(rng);
    const Tensor dw = host_tensor({T, 8}, DType::kF32, g);

    const Routed cpu = forward_on(Device::cpu(), c, logits, b, DType::kI32);
    Tensor cpu_losses = Tensor::empty({2}, DType::kF32);
    router_losses(c, cpu.stats(), cpu_losses);
    Tensor cpu_d = Tensor::empty({T, 256}, DType::kBF16);
    route_backward(c, logits, b, cpu.idx, dw, cpu.stats(), 1.0, 1.0, cpu_d);

    const Tensor gl = to_gpu(logits), gb = to_gpu(b), gdw = to_gpu(dw);
    const Routed gpu = forward_on(Device::cuda(0), c, logits, b, DType::kI32);
    Tensor gpu_losses = to_gpu(Tensor::full({2}, DType::kF32, kPoisons[0]));
    router_losses(c, gpu.stats(), gpu_losses);
    Tensor gpu_d = to_gpu(Tensor::full({T, 256}, DType::kBF16, kPoisons[0]));
    route_backward(c, gl, gb, gpu.idx, gdw, gpu.stats(), 1.0, 1.0, gpu_d);

    const std::string what = describe(c, DType::kBF16, DType::kI32, T);
    expect_forward_match(gpu, cpu, what);
    EXPECT_TRUE(all_close(gpu_losses, cpu_losses, 0.0, 2e-4)) << what << ": losses";
    double worst = 0;
    for (double v : values(cpu_d)) worst = std::max(worst, std::fabs(v));
    EXPECT_TRUE(all_close(gpu_d, cpu_d, 1e-4 * worst, 1e-2)) << what << ": d_logits";
  }
}

}  // namespace
}  // namespace epx
