// Router reference tests. Expected values come from formulas evaluated here in double (never from
// the code under test): hand-sized cases per score function, an independent brute-force top-k
// (grouped included) for the losses, central finite differences in fp64 for the backward, and a
// simulated multi-rank run whose aux loss must match a brute force over every rank's tokens with
// the same capacity dropping.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm.h"
#include "epx/error.h"
#include "epx/layout.h"
#include "epx/router.h"
#include "epx/tensor.h"

namespace epx {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

Tensor tensor_of(Shape shape, DType dt, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, dt);
  EXPECT_EQ(static_cast<int64_t>(v.size()), t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, v[i]);
  return t;
}

std::vector<double> values(const TensorRef& t) {
  std::vector<double> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = load_as_double(t.data(), t.dtype(), i);
  return v;
}

DType float_dtype(DType logits) { return logits == DType::kF64 ? DType::kF64 : DType::kF32; }

// Outputs of one forward (+ count_routed on its own routing), stats pre-filled with junk so that
// a test sees whether they were overwritten.
struct Routed {
  Tensor idx, w, prob_sum, counts, scalars;
  RouterStats stats() const { return RouterStats{prob_sum.ref(), counts.ref(), scalars.ref()}; }
};

Routed alloc(const RouterConfig& c, int64_t T, DType logits_dt, DType idx_dt = DType::kI32) {
  const DType f = float_dtype(logits_dt);
  const int64_t S = c.aux_loss == AuxLossType::kSequence ? T / c.seq_len : 1;
  Routed r;
  r.idx = Tensor::full({T, c.topk}, idx_dt, 99);
  r.w = Tensor::full({T, c.topk}, f, 99);
  r.prob_sum = Tensor::full({S, c.num_experts}, f, -7);
  r.counts = Tensor::full({S, c.num_experts}, f, -7);
  r.scalars = Tensor::full({2}, f, -7);
  return r;
}

Routed forward(const RouterConfig& c, const Tensor& logits, const Tensor& bias = Tensor(),
               DType idx_dt = DType::kI32) {
  Routed r = alloc(c, logits.size(0), logits.dtype(), idx_dt);
  route_forward(c, logits, bias, r.idx, r.w, r.stats());
  count_routed(c, r.idx, r.stats());
  return r;
}

std::vector<double> losses_of(const RouterConfig& c, const RouterStats& s, DType dt = DType::kF64) {
  Tensor out = Tensor::full({2}, dt, -7);
  router_losses(c, s, out);
  return values(out);
}

template <class F>
void expect_error(F&& f, const std::string& needle, Status status = Status::kInvalidArgument) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what()
                                                                      << "\nexpected to contain: " << needle;
  }
}

RouterConfig basic(int E, int K, ScoreFunction f = ScoreFunction::kSoftmax) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = K;
  c.score_function = f;
  return c;
}

// ---- independent brute force (double) ----------------------------------------------------------

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Softmax over the non-NaN entries (finite inputs).
std::vector<double> softmax_of(const double* l, int E) {
  double m = -kInf, z = 0;
  for (int e = 0; e < E; ++e)
    if (!std::isnan(l[e])) m = std::max(m, l[e]);
  std::vector<double> p(E, 0.0);
  for (int e = 0; e < E; ++e)
    if (!std::isnan(l[e])) z += std::exp(l[e] - m);
  for (int e = 0; e < E; ++e)
    if (!std::isnan(l[e])) p[e] = std::exp(l[e] - m) / z;
  return p;
}

double lse_of(const double* l, int E) {
  double z = 0;
  for (int e = 0; e < E; ++e)
    if (!std::isnan(l[e])) z += std::exp(l[e]);
  return std::log(z);
}

// The probability the aux loss uses.
std::vector<double> aux_prob(const RouterConfig& c, const double* l, int E) {
  if (c.score_function != ScoreFunction::kSigmoid) return softmax_of(l, E);
  std::vector<double> s(E, 0.0);
  double sum = 0;
  for (int e = 0; e < E; ++e)
    if (!std::isnan(l[e])) sum += (s[e] = sigmoid(l[e]));
  for (double& v : s) v = sum > 0 ? v / sum : 0;
  return s;
}

// Top-k written differently from the reference: sort (negated score, index) pairs.
std::vector<int> brute_select(const RouterConfig& c, const double* l, const std::vector<double>& bias) {
  const int E = c.num_experts;
  const std::vector<double> p = softmax_of(l, E);
  std::vector<double> sel(E);
  for (int e = 0; e < E; ++e) {
    const double score = c.score_function == ScoreFunction::kSoftmax ? p[e]
                         : c.score_function == ScoreFunction::kSigmoid ? sigmoid(l[e])
                                                                        : l[e];
    sel[e] = score + (bias.empty() ? 0.0 : bias[e]);
  }
  std::vector<char> allowed(E, 1);
  if (c.num_groups > 1) {
    const int per = E / c.num_groups;
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < c.num_groups; ++g) {
      std::vector<double> v;
      for (int e = g * per; e < (g + 1) * per; ++e)
        if (!std::isnan(l[e])) v.push_back(sel[e]);
      std::sort(v.rbegin(), v.rend());
      const double gs = v.empty() ? -kInf : v.size() == 1 ? v[0] : v[0] + v[1];
      groups.push_back({-gs, g});
    }
    std::sort(groups.begin(), groups.end());
    std::fill(allowed.begin(), allowed.end(), 0);
    for (int i = 0; i < c.group_topk; ++i)
      for (int e = groups[i].second * per; e < (groups[i].second + 1) * per; ++e) allowed[e] = 1;
  }
  std::vector<std::pair<double, int>> cand;
  for (int e = 0; e < E; ++e)
    if (allowed[e] && !std::isnan(l[e])) cand.push_back({-sel[e], e});
  std::sort(cand.begin(), cand.end());
  std::vector<int> ids(c.topk, -1);
  for (int k = 0; k < c.topk && k < static_cast<int>(cand.size()); ++k) ids[k] = cand[k].second;
  return ids;
}

// Rows of random logits whose entries are at least ~0.6 * gap apart, so that selection (and group
// selection) is stable under finite-difference steps.
std::vector<double> separated_logits(std::mt19937& rng, int T, int E, double gap) {
  std::uniform_real_distribution<double> jitter(-0.1, 0.1);
  std::vector<double> l(static_cast<size_t>(T) * E);
  std::vector<int> perm(E);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < E; ++e) l[t * E + e] = (perm[e] - (E - 1) / 2.0 + jitter(rng)) * gap;
  }
  return l;
}

// ---- forward: hand-computed cases --------------------------------------------------------------

TEST(RouterForward, SoftmaxHandComputed) {
  RouterConfig c = basic(4, 2);
  c.aux_loss = AuxLossType::kGlobalBatch;
  c.aux_loss_coeff = 1.0f;
  // Row 0: softmax([1, 2, 3, 0]); row 1: all equal, so ties decide: experts 0 and 1 at 1/4 each.
  Tensor logits = tensor_of({2, 4}, DType::kF32, {1, 2, 3, 0, 0.5, 0.5, 0.5, 0.5});
  Routed r = forward(c, logits);
  const double Z = std::exp(0.0) + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(std::exp(3.0) / Z, 0.6439142598879722, 1e-12);  // by hand, as a check on the formula
  EXPECT_EQ(values(r.idx), (std::vector<double>{2, 1, 0, 1}));
  const std::vector<double> w = values(r.w);
  EXPECT_NEAR(w[0], std::exp(3.0) / Z, 1e-6);
  EXPECT_NEAR(w[1], std::exp(2.0) / Z, 1e-6);
  EXPECT_NEAR(w[2], 0.25, 1e-7);
  EXPECT_NEAR(w[3], 0.25, 1e-7);
  // prob_sum and scalars were -7 before: overwritten, not accumulated.
  const std::vector<double> ps = values(r.prob_sum);
  EXPECT_NEAR(ps[0], std::exp(1.0) / Z + 0.25, 1e-6);
  EXPECT_NEAR(ps[1], std::exp(2.0) / Z + 0.25, 1e-6);
  EXPECT_NEAR(ps[2], std::exp(3.0) / Z + 0.25, 1e-6);
  EXPECT_NEAR(ps[3], std::exp(0.0) / Z + 0.25, 1e-6);
  const double lse1 = 0.5 + std::log(4.0);
  const std::vector<double> sc = values(r.scalars);
  EXPECT_NEAR(sc[0], std::log(Z) * std::log(Z) + lse1 * lse1, 1e-5);
  EXPECT_EQ(sc[1], 2.0);
  EXPECT_EQ(values(r.counts), (std::vector<double>{1, 2, 1, 0}));
  // A second forward into the same stats gives the same numbers (no accumulation).
  route_forward(c, logits, Tensor(), r.idx, r.w, r.stats());
  EXPECT_EQ(values(r.prob_sum), ps);
  EXPECT_EQ(values(r.scalars), sc);
}

TEST(RouterForward, SigmoidHandComputed) {
  RouterConfig c = basic(4, 2, ScoreFunction::kSigmoid);
  c.aux_loss = AuxLossType::kGlobalBatch;
  Tensor logits = tensor_of({1, 4}, DType::kF32, {0, 2, -1, 1});
  Routed r = forward(c, logits);
  EXPECT_EQ(values(r.idx), (std::vector<double>{1, 3}));
  const double s[4] = {0.5, sigmoid(2), sigmoid(-1), sigmoid(1)};
  EXPECT_NEAR(s[1], 0.8807970779778823, 1e-12);
  const std::vector<double> w = values(r.w);
  EXPECT_NEAR(w[0], s[1], 1e-6);
  EXPECT_NEAR(w[1], s[3], 1e-6);
  const double sum = s[0] + s[1] + s[2] + s[3];
  const std::vector<double> ps = values(r.prob_sum);
  for (int e = 0; e < 4; ++e) EXPECT_NEAR(ps[e], s[e] / sum, 1e-6) << e;
  // lse is of the logits whatever the score function.
  const double lse = std::log(1 + std::exp(2.0) + std::exp(-1.0) + std::exp(1.0));
  EXPECT_NEAR(values(r.scalars)[0], lse * lse, 1e-5);

  c.normalize_weights = true;
  c.routed_scaling_factor = 2.5f;
  r = forward(c, logits);
  EXPECT_NEAR(values(r.w)[0], 2.5 * s[1] / (s[1] + s[3]), 1e-6);
  EXPECT_NEAR(values(r.w)[1], 2.5 * s[3] / (s[1] + s[3]), 1e-6);
}

TEST(RouterForward, SoftmaxAfterTopkHandComputed) {
  RouterConfig c = basic(4, 2, ScoreFunction::kSoftmaxAfterTopk);
  c.routed_scaling_factor = 2.5f;
  c.aux_loss = AuxLossType::kGlobalBatch;
  Tensor logits = tensor_of({1, 4}, DType::kF64, {1, 3, 2, 0.5});
  Routed r = forward(c, logits);
  EXPECT_EQ(values(r.idx), (std::vector<double>{1, 2}));
  // softmax([3, 2]) = [1 / (1 + e^-1), e^-1 / (1 + e^-1)] = [0.7310585786, 0.2689414214].
  const std::vector<double> w = values(r.w);
  EXPECT_NEAR(w[0], 2.5 * 0.7310585786300049, 1e-12);
  EXPECT_NEAR(w[1], 2.5 * 0.2689414213699951, 1e-12);
  // The aux loss still sees softmax over all experts.
  const double Z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.5);
  const std::vector<double> ps = values(r.prob_sum);
  EXPECT_NEAR(ps[0], std::exp(1.0) / Z, 1e-12);
  EXPECT_NEAR(ps[3], std::exp(0.5) / Z, 1e-12);
}

TEST(RouterForward, NormalizationAndScaling) {
  RouterConfig c = basic(4, 2);
  c.normalize_weights = true;
  c.routed_scaling_factor = 2.5f;
  Tensor logits = tensor_of({1, 4}, DType::kF32, {1, 2, 3, 0});
  Routed r = forward(c, logits);
  // p2 / (p2 + p1) = e^3 / (e^3 + e^2): the partition function cancels.
  const double a = std::exp(3.0) / (std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(values(r.w)[0], 2.5 * a, 1e-6);
  EXPECT_NEAR(values(r.w)[1], 2.5 * (1 - a), 1e-6);
}

TEST(RouterForward, GroupedTopkDropsTheGroupOfTheBestExpert) {
  RouterConfig c = basic(8, 2, ScoreFunction::kSoftmaxAfterTopk);
  c.num_groups = 4;
  c.group_topk = 2;
  // Row 0: group 0 holds the best expert (10) but its pair sums to 0; groups 1 (sum 8) and 2
  // (sum 6) win, and inside them the tie 4 = 4 goes to expert 2.
  // Row 1: group 0's partner is NaN, so its score is the single 10 and it is kept.
  Tensor logits = tensor_of({2, 8}, DType::kF64,
                            {10, -10, 4, 4, 3, 3, 1, 1,  //
                             10, kNaN, 4, 4, 3, 3, 1, 1});
  Routed r = forward(c, logits);
  EXPECT_EQ(values(r.idx), (std::vector<double>{2, 3, 0, 2}));
  EXPECT_NEAR(values(r.w)[0], 0.5, 1e-15);
  EXPECT_NEAR(values(r.w)[2], 1 / (1 + std::exp(-6.0)), 1e-15);
  // Without groups expert 0 wins row 0.
  c.num_groups = 1;
  c.group_topk = 1;
  EXPECT_EQ(values(forward(c, logits).idx), (std::vector<double>{0, 2, 0, 2}));
}

TEST(RouterForward, TiesGoToTheLowerIndex) {
  RouterConfig c = basic(8, 3, ScoreFunction::kSigmoid);
  c.num_groups = 4;
  c.group_topk = 2;
  Tensor logits = tensor_of({1, 8}, DType::kF32, std::vector<double>(8, 0.25));
  EXPECT_EQ(values(forward(c, logits).idx), (std::vector<double>{0, 1, 2}));
  // Groups tie too: ones in every group, the two lowest groups win.
  Tensor l2 = tensor_of({1, 8}, DType::kF32, {0, 1, 1, 0, 0, 1, 1, 0});
  EXPECT_EQ(values(forward(c, l2).idx), (std::vector<double>{1, 2, 0}));
}

TEST(RouterForward, BiasChangesSelectionNotWeights) {
  RouterConfig c = basic(4, 2);
  c.use_expert_bias = true;
  c.aux_loss = AuxLossType::kGlobalBatch;
  Tensor logits = tensor_of({1, 4}, DType::kF32, {2, 1, 0, -1});
  Tensor bias = tensor_of({4}, DType::kF32, {0, 0, 0.9, 0});
  Routed r = forward(c, logits, bias);
  const double Z = std::exp(2.0) + std::exp(1.0) + 1 + std::exp(-1.0);
  // Selection scores: p + bias = {0.644, 0.237, 0.087 + 0.9, 0.032}: expert 2 first, then 0.
  EXPECT_EQ(values(r.idx), (std::vector<double>{2, 0}));
  EXPECT_NEAR(values(r.w)[0], 1 / Z, 1e-6);
  EXPECT_NEAR(values(r.w)[1], std::exp(2.0) / Z, 1e-6);
  EXPECT_NEAR(values(r.prob_sum)[2], 1 / Z, 1e-6);
  Tensor zero = tensor_of({4}, DType::kF32, {0, 0, 0, 0});
  EXPECT_EQ(values(forward(c, logits, zero).idx), (std::vector<double>{0, 1}));
}

TEST(RouterForward, NaNAndInfinity) {
  RouterConfig c = basic(4, 2);
  c.aux_loss = AuxLossType::kGlobalBatch;
  c.z_loss_coeff = 0.1f;
  Tensor logits = tensor_of({4, 4}, DType::kF64,
                            {kNaN, 1, 0, 2,           // the NaN would have been the max: never chosen
                             kNaN, kNaN, kNaN, kNaN,  // fully masked
                             kNaN, kNaN, kNaN, 1,     // one eligible expert for K = 2
                             kInf, 0, kInf, 1});      // +inf splits the mass evenly
  Routed r = forward(c, logits);
  EXPECT_EQ(values(r.idx), (std::vector<double>{3, 1, -1, -1, 3, -1, 0, 2}));
  const double Z = std::exp(1.0) + 1 + std::exp(2.0);
  const std::vector<double> w = values(r.w);
  EXPECT_NEAR(w[0], std::exp(2.0) / Z, 1e-15);
  EXPECT_NEAR(w[1], std::exp(1.0) / Z, 1e-15);
  EXPECT_EQ(w[2], 0.0);
  EXPECT_EQ(w[3], 0.0);
  EXPECT_EQ(w[4], 1.0);
  EXPECT_EQ(w[5], 0.0);
  EXPECT_EQ(w[6], 0.5);
  EXPECT_EQ(w[7], 0.5);
  const std::vector<double> ps = values(r.prob_sum);
  EXPECT_NEAR(ps[0], 0.5, 1e-15);  // only the +inf row puts mass on expert 0
  EXPECT_NEAR(ps[3], std::exp(2.0) / Z + 1 + 0, 1e-15);
  const std::vector<double> sc = values(r.scalars);
  EXPECT_EQ(sc[1], 3.0);  // the masked row is not a token of the losses
  EXPECT_TRUE(std::isinf(sc[0]));
  EXPECT_EQ(values(r.counts), (std::vector<double>{1, 1, 1, 2}));

  // Backward: NaN entries, the masked row and the saturated +inf row get exactly zero.
  Tensor dw = tensor_of({4, 2}, DType::kF64, {1, 2, 3, 4, 5, 6, 7, 8});
  Tensor d = Tensor::full({4, 4}, DType::kF64, 99);
  c.z_loss_coeff = 0;  // the +inf row's z loss is infinite; keep the rest finite to look at it
  r = forward(c, logits);
  route_backward(c, logits, Tensor(), r.idx, dw, r.stats(), 1.0, 1.0, d);
  const std::vector<double> g = values(d);
  EXPECT_EQ(g[0], 0.0);
  for (int e = 4; e < 12; ++e) EXPECT_EQ(g[e], 0.0) << e;  // rows 1 and 2 (a single p = 1 is flat)
  for (int e = 12; e < 16; ++e) EXPECT_EQ(g[e], 0.0) << e;
  EXPECT_NE(g[1], 0.0);
  EXPECT_NE(g[3], 0.0);
}

TEST(RouterForward, Bf16LogitsAndInt64Ids) {
  RouterConfig c = basic(4, 2, ScoreFunction::kSigmoid);
  c.z_loss_coeff = 1;
  Tensor logits = tensor_of({2, 4}, DType::kBF16, {0, 2, -1, 1, 0.5, -0.5, 3, 0.25});
  Routed r = forward(c, logits, Tensor(), DType::kI64);
  EXPECT_EQ(r.idx.dtype(), DType::kI64);
  EXPECT_EQ(values(r.idx), (std::vector<double>{1, 3, 2, 0}));
  EXPECT_NEAR(values(r.w)[2], sigmoid(3), 1e-6);
  EXPECT_NEAR(values(r.w)[3], sigmoid(0.5), 1e-6);
  // bf16 backward agrees with the fp64 one to bf16 precision.
  Tensor l64 = tensor_of({2, 4}, DType::kF64, values(logits));
  Routed r64 = forward(c, l64);
  Tensor dw = tensor_of({2, 2}, DType::kF32, {1, -2, 0.5, 3});
  Tensor dw64 = tensor_of({2, 2}, DType::kF64, values(dw));
  Tensor d16 = Tensor::empty({2, 4}, DType::kBF16), d64 = Tensor::empty({2, 4}, DType::kF64);
  route_backward(c, logits, Tensor(), r.idx, dw, r.stats(), 0, 1, d16);
  route_backward(c, l64, Tensor(), r64.idx, dw64, r64.stats(), 0, 1, d64);
  const std::vector<double> a = values(d16), b = values(d64);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(a[i], b[i], 1e-2 * std::abs(b[i]) + 1e-6) << i;
}

TEST(RouterForward, EmptyBatch) {
  for (AuxLossType aux : {AuxLossType::kGlobalBatch, AuxLossType::kSequence}) {
    RouterConfig c = basic(8, 2);
    c.aux_loss = aux;
    c.aux_loss_coeff = 0.1f;
    c.seq_len = 4;
    c.z_loss_coeff = 0.1f;
    Tensor logits = Tensor::empty({0, 8}, DType::kF32);
    Routed r = forward(c, logits);
    EXPECT_EQ(r.idx.numel(), 0);
    EXPECT_EQ(r.prob_sum.size(0), aux == AuxLossType::kSequence ? 0 : 1);
    for (double v : values(r.prob_sum)) EXPECT_EQ(v, 0.0);
    for (double v : values(r.counts)) EXPECT_EQ(v, 0.0);
    EXPECT_EQ(values(r.scalars), (std::vector<double>{0, 0}));
    EXPECT_EQ(losses_of(c, r.stats()), (std::vector<double>{0, 0}));
    Tensor d = Tensor::empty({0, 8}, DType::kF32);
    route_backward(c, logits, Tensor(), r.idx, r.w, r.stats(), 1, 1, d);
  }
}

TEST(RouterForward, StatsAreOptionalWhenNoLossUsesThem) {
  RouterConfig c = basic(4, 2);
  Tensor logits = tensor_of({1, 4}, DType::kF32, {1, 2, 3, 0});
  Tensor idx = Tensor::empty({1, 2}, DType::kI32), w = Tensor::empty({1, 2}, DType::kF32);
  route_forward(c, logits, Tensor(), idx, w, RouterStats{});
  EXPECT_EQ(values(idx), (std::vector<double>{2, 1}));
  Tensor d = Tensor::empty({1, 4}, DType::kF32);
  route_backward(c, logits, Tensor(), idx, Tensor(), RouterStats{}, 0, 0, d);  // no weight grad: zero
  EXPECT_EQ(values(d), (std::vector<double>{0, 0, 0, 0}));
}

TEST(RouterCount, PerSequenceAndMaskedIds) {
  RouterConfig c = basic(4, 2);
  c.aux_loss = AuxLossType::kSequence;
  c.seq_len = 2;
  Tensor ids = tensor_of({4, 2}, DType::kI64, {0, 1, 1, -1, 2, 3, 2, 0});
  Tensor counts = Tensor::full({2, 4}, DType::kF32, 5);
  count_routed(c, ids, RouterStats{TensorRef(), counts, TensorRef()});
  EXPECT_EQ(values(counts), (std::vector<double>{1, 2, 0, 0, 1, 0, 2, 1}));
}

TEST(RouterBias, UpdateFollowsTheSignOfTheImbalance) {
  Tensor bias = tensor_of({4}, DType::kF32, {0.5, 0, -0.25, 1});
  Tensor counts = tensor_of({4}, DType::kF32, {3, 1, 2, 2});  // mean 2
  update_expert_bias(bias, counts, 0.125f);
  EXPECT_EQ(values(bias), (std::vector<double>{0.375, 0.125, -0.25, 1}));
  Tensor even = tensor_of({4}, DType::kF64, {7, 7, 7, 7});
  update_expert_bias(bias, even, 0.125f);
  EXPECT_EQ(values(bias), (std::vector<double>{0.375, 0.125, -0.25, 1}));
}

// ---- losses against brute force ----------------------------------------------------------------

std::vector<RouterConfig> loss_configs(AuxLossType aux) {
  std::vector<RouterConfig> out;
  for (ScoreFunction f : {ScoreFunction::kSoftmax, ScoreFunction::kSoftmaxAfterTopk, ScoreFunction::kSigmoid})
    for (int grouped = 0; grouped < 2; ++grouped) {
      RouterConfig c = basic(8, 3, f);
      c.num_groups = grouped ? 4 : 1;
      c.group_topk = grouped ? 2 : 1;
      c.aux_loss = aux;
      c.aux_loss_coeff = 0.25f;
      c.seq_len = 4;
      c.z_loss_coeff = 0.125f;
      c.use_expert_bias = grouped;
      out.push_back(c);
    }
  return out;
}

void check_losses_brute_force(AuxLossType aux, DType dt) {
  const int T = 12, E = 8;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.5);
  std::vector<double> l(T * E);
  for (double& v : l) v = normal(rng);
  l[2 * E + 5] = kNaN;
  for (int e = 0; e < E; ++e) l[9 * E + e] = kNaN;  // one masked token
  Tensor logits = tensor_of({T, E}, dt, l);
  l = values(logits);  // what the op sees (bf16 rounding)
  const std::vector<double> bias = {0.01, -0.02, 0.03, 0.0, -0.01, 0.02, 0.05, -0.03};
  for (const RouterConfig& c : loss_configs(aux)) {
    SCOPED_TRACE(std::string(score_function_name(c.score_function)) + (c.num_groups > 1 ? " grouped" : ""));
    const std::vector<double> b = c.use_expert_bias ? bias : std::vector<double>();
    Routed r = forward(c, logits, c.use_expert_bias ? tensor_of({E}, DType::kF32, bias) : Tensor());
    const std::vector<double> ids = values(r.idx);
    const int K = c.topk, S = aux == AuxLossType::kSequence ? T / c.seq_len : 1;
    // Counts from an independent selection; it must also agree with the op's routing.
    std::vector<double> n(S * E, 0.0);
    for (int t = 0; t < T; ++t) {
      const std::vector<int> sel = brute_select(c, &l[t * E], b);
      for (int k = 0; k < K; ++k) {
        EXPECT_EQ(ids[t * K + k], sel[k]) << "t=" << t << " k=" << k;
        if (sel[k] >= 0) n[(aux == AuxLossType::kSequence ? t / c.seq_len : 0) * E + sel[k]] += 1;
      }
    }
    // Double loop over (t, e).
    double aux_ref = 0, lse2 = 0;
    int valid = 0;
    std::vector<double> per_seq(S, 0.0);
    for (int t = 0; t < T; ++t) {
      if (t == 9) continue;
      ++valid;
      lse2 += std::pow(lse_of(&l[t * E], E), 2);
      const std::vector<double> p = aux_prob(c, &l[t * E], E);
      const int s = aux == AuxLossType::kSequence ? t / c.seq_len : 0;
      for (int e = 0; e < E; ++e) per_seq[s] += p[e] * n[s * E + e];
    }
    if (aux == AuxLossType::kGlobalBatch) {
      aux_ref = c.aux_loss_coeff * E / (K * double(valid) * valid) * per_seq[0];
    } else {
      for (int s = 0; s < S; ++s) aux_ref += c.aux_loss_coeff * E / (K * double(c.seq_len) * c.seq_len) * per_seq[s];
      aux_ref /= S;
    }
    const double z_ref = c.z_loss_coeff * lse2 / valid;
    const double tol = dt == DType::kF64 ? 1e-12 : 1e-5;
    for (DType out : {DType::kF32, DType::kF64}) {
      const double t = out == DType::kF32 ? std::max(tol, 2e-7) : tol;  // fp32 output rounds once more
      const std::vector<double> got = losses_of(c, r.stats(), out);
      EXPECT_NEAR(got[0], aux_ref, t * aux_ref);
      EXPECT_NEAR(got[1], z_ref, t * z_ref);
    }
    EXPECT_GT(aux_ref, 0.0);
  }
}

TEST(RouterLosses, AuxAndZMatchBruteForceGlobal) {
  check_losses_brute_force(AuxLossType::kGlobalBatch, DType::kF64);
  check_losses_brute_force(AuxLossType::kGlobalBatch, DType::kF32);
}

TEST(RouterLosses, AuxAndZMatchBruteForceSequence) {
  check_losses_brute_force(AuxLossType::kSequence, DType::kF64);
  check_losses_brute_force(AuxLossType::kSequence, DType::kBF16);
}

TEST(RouterLosses, ZeroCoefficientsGiveZero) {
  RouterConfig c = basic(4, 2);
  c.aux_loss = AuxLossType::kGlobalBatch;
  Tensor logits = tensor_of({2, 4}, DType::kF32, {1, 2, 3, 0, 0, 0, 1, 1});
  Routed r = forward(c, logits);
  EXPECT_EQ(losses_of(c, r.stats()), (std::vector<double>{0, 0}));
  c.aux_loss_coeff = 1;
  EXPECT_GT(losses_of(c, r.stats())[0], 0.0);
}

// ---- backward against finite differences --------------------------------------------------------

TEST(RouterBackward, MatchesFiniteDifferences) {
  const int T = 8, E = 8, K = 3;
  const double h = 1e-6;
  int config_no = 0;
  for (ScoreFunction f : {ScoreFunction::kSoftmax, ScoreFunction::kSoftmaxAfterTopk, ScoreFunction::kSigmoid})
    for (bool norm : {false, true})
      for (bool grouped : {false, true})
        for (AuxLossType aux : {AuxLossType::kGlobalBatch, AuxLossType::kSequence}) {
          ++config_no;
          RouterConfig c = basic(E, K, f);
          c.normalize_weights = norm;
          c.routed_scaling_factor = 1.5f;
          c.num_groups = grouped ? 4 : 1;
          c.group_topk = grouped ? 2 : 1;
          c.use_expert_bias = config_no % 2 == 1;
          c.aux_loss = aux;
          c.aux_loss_coeff = 0.5f;
          c.seq_len = 4;
          c.z_loss_coeff = 0.0625f;
          SCOPED_TRACE(std::string(score_function_name(f)) + (norm ? " normalized" : "") + (grouped ? " grouped" : "") +
                       (aux == AuxLossType::kSequence ? " sequence" : " global") + (c.use_expert_bias ? " bias" : ""));

          std::mt19937 rng(1000 + config_no);
          std::vector<double> l = separated_logits(rng, T, E, 0.8);
          l[0 * E + 3] = kNaN;
          for (int e = 0; e < E; ++e) l[6 * E + e] = kNaN;  // a fully masked token
          std::uniform_real_distribution<double> u(-1, 1);
          std::vector<double> coef(T * K);
          for (double& v : coef) v = u(rng);
          const double a = u(rng) + 2, b = u(rng) + 2;
          std::vector<double> bias(E);
          for (double& v : bias) v = 0.002 * u(rng);
          Tensor bias_t = c.use_expert_bias ? tensor_of({E}, DType::kF32, bias) : Tensor();

          Tensor logits = tensor_of({T, E}, DType::kF64, l);
          Routed base = forward(c, logits, bias_t);
          Tensor dw = tensor_of({T, K}, DType::kF64, coef);
          Tensor grad = Tensor::full({T, E}, DType::kF64, 99);
          route_backward(c, logits, bias_t, base.idx, dw, base.stats(), a, b, grad);
          const std::vector<double> g = values(grad);

          int selection_changes = 0;
          auto objective = [&](const std::vector<double>& lp) {
            Tensor lt = tensor_of({T, E}, DType::kF64, lp);
            Routed r = alloc(c, T, DType::kF64);
            route_forward(c, lt, bias_t, r.idx, r.w, r.stats());
            if (values(r.idx) != values(base.idx)) ++selection_changes;
            count_routed(c, base.idx, r.stats());  // the fixed routing
            const std::vector<double> loss = losses_of(c, r.stats());
            const std::vector<double> w = values(r.w);
            double L = a * loss[0] + b * loss[1];
            for (int i = 0; i < T * K; ++i) L += coef[i] * w[i];
            return L;
          };
          double max_abs = 0;
          for (int i = 0; i < T * E; ++i) {
            if (std::isnan(l[i])) {
              EXPECT_EQ(g[i], 0.0) << "NaN logit " << i;
              continue;
            }
            std::vector<double> lp = l, lm = l;
            lp[i] += h;
            lm[i] -= h;
            const double fd = (objective(lp) - objective(lm)) / (2 * h);
            EXPECT_NEAR(g[i], fd, 1e-6 * (1 + std::abs(fd))) << "t=" << i / E << " e=" << i % E;
            max_abs = std::max(max_abs, std::abs(g[i]));
          }
          EXPECT_EQ(selection_changes, 0) << "a finite-difference step changed the routing: pick other logits";
          EXPECT_GT(max_abs, 1e-3);
        }
}

TEST(RouterBackward, EachTermAlone) {
  // The three terms are linear in their seeds: the full gradient is the sum of the separate ones.
  RouterConfig c = basic(8, 2);
  c.normalize_weights = true;
  c.aux_loss = AuxLossType::kGlobalBatch;
  c.aux_loss_coeff = 0.5f;
  c.z_loss_coeff = 0.25f;
  std::mt19937 rng(3);
  Tensor logits = tensor_of({4, 8}, DType::kF64, separated_logits(rng, 4, 8, 0.7));
  Routed r = forward(c, logits);
  Tensor dw = tensor_of({4, 2}, DType::kF64, {1, -1, 0.5, 2, -3, 1, 0.25, 0.75});
  auto grad = [&](const TensorRef& d_w, double d_aux, double d_z) {
    Tensor d = Tensor::empty({4, 8}, DType::kF64);
    route_backward(c, logits, Tensor(), r.idx, d_w, r.stats(), d_aux, d_z, d);
    return values(d);
  };
  const std::vector<double> all = grad(dw, 2, 3), w = grad(dw, 0, 0), x = grad(TensorRef(), 2, 0), z = grad(TensorRef(), 0, 3);
  for (int i = 0; i < 32; ++i) {
    EXPECT_NEAR(all[i], w[i] + x[i] + z[i], 1e-12) << i;
    EXPECT_NE(x[i], 0.0) << i;
  }
  // z alone: z_coeff * 2 * lse * softmax / T, by formula.
  const std::vector<double> l = values(logits);
  for (int t = 0; t < 4; ++t) {
    const std::vector<double> p = softmax_of(&l[t * 8], 8);
    for (int e = 0; e < 8; ++e) EXPECT_NEAR(z[t * 8 + e], 3 * 0.25 * 2 * lse_of(&l[t * 8], 8) * p[e] / 4, 1e-12);
  }
}

// ---- several simulated ranks with capacity dropping --------------------------------------------

TEST(RouterMultiRank, GlobalAuxLossMatchesBruteForceWithCapacity) {
  const int E = 8, K = 2;
  RouterConfig c = basic(E, K);
  c.aux_loss = AuxLossType::kGlobalBatch;
  c.aux_loss_coeff = 0.01f;
  c.z_loss_coeff = 0.001f;
  for (int R : {1, 2, 4})
    for (float cf : {0.0f, 1.0f})
      for (DropPolicy policy : {DropPolicy::kByPosition, DropPolicy::kByProbability}) {
        SCOPED_TRACE("R=" + std::to_string(R) + " cf=" + std::to_string(cf) +
                     (policy == DropPolicy::kByPosition ? " by position" : " by probability"));
        GroupConfig gc;
        gc.num_experts = E;
        gc.hidden = 4;
        gc.max_tokens_per_rank = 32;
        gc.max_topk = K;
        std::vector<Group> groups = Group::create_simulated(R, gc);
        // Rank r has 10 + 3r tokens; experts 0 and 1 are popular so that capacity drops pairs.
        std::vector<std::vector<double>> logits(R);
        std::mt19937 rng(11 + R);
        std::normal_distribution<double> normal(0.0, 1.0);
        for (int r = 0; r < R; ++r) {
          logits[r].resize((10 + 3 * r) * E);
          for (size_t i = 0; i < logits[r].size(); ++i)
            logits[r][i] = static_cast<float>(normal(rng) + (i % E < 2 ? 1.5 : 0.0));  // what the fp32 op sees
        }
        std::vector<std::vector<double>> ids(R), losses(R), counts(R);
        std::mutex mu;
        run_ranks(groups, [&](Group& g) {
          const int r = g.rank(), T = static_cast<int>(logits[r].size()) / E;
          Tensor l = tensor_of({T, E}, DType::kF32, logits[r]);
          Routed out = alloc(c, T, DType::kF32);
          route_forward(c, l, Tensor(), out.idx, out.w, out.stats());
          PrepareOptions opt;
          opt.capacity_factor = cf;
          opt.drop_policy = policy;
          Handle h = prepare(g, out.idx, out.w, opt);
          count_routed(c, h.routed_experts(), out.stats());
          all_reduce_sum(g, out.prob_sum);
          all_reduce_sum(g, out.counts);
          all_reduce_sum(g, out.scalars);
          std::vector<double> loss = losses_of(c, out.stats(), DType::kF32);
          std::lock_guard<std::mutex> lk(mu);
          ids[r] = values(out.idx);
          losses[r] = loss;
          counts[r] = values(out.counts);
        });

        // Brute force over every rank's tokens: an independent selection, then the capacity of
        // each rank (ceil(cf * T_r * K / E) pairs per expert). Either drop policy keeps
        // min(capacity, demand) pairs of an expert, and the loss only sees those counts.
        std::vector<double> n(E, 0.0);
        int total_tokens = 0, kept = 0, pairs = 0;
        double lse2 = 0;
        for (int r = 0; r < R; ++r) {
          const int T = static_cast<int>(logits[r].size()) / E;
          total_tokens += T;
          const int cap = cf > 0 ? static_cast<int>(std::ceil(double(cf) * T * K / E)) : T * K;
          std::vector<int> demand(E, 0);
          for (int t = 0; t < T; ++t) {
            const std::vector<int> sel = brute_select(c, &logits[r][t * E], {});
            for (int k = 0; k < K; ++k) {
              EXPECT_EQ(ids[r][t * K + k], sel[k]) << "rank " << r << " t=" << t << " k=" << k;
              ++demand[sel[k]];
              ++pairs;
            }
            lse2 += std::pow(lse_of(&logits[r][t * E], E), 2);
          }
          for (int e = 0; e < E; ++e) {
            n[e] += std::min(cap, demand[e]);
            kept += std::min(cap, demand[e]);
          }
        }
        double sum = 0;
        for (int r = 0; r < R; ++r)
          for (size_t t = 0; t < logits[r].size() / E; ++t) {
            const std::vector<double> p = softmax_of(&logits[r][t * E], E);
            for (int e = 0; e < E; ++e) sum += p[e] * n[e];
          }
        const double aux_ref = c.aux_loss_coeff * E / (K * double(total_tokens) * total_tokens) * sum;
        const double z_ref = c.z_loss_coeff * lse2 / total_tokens;
        if (cf > 0)
          EXPECT_LT(kept, pairs) << "the capacity should drop pairs here";
        else
          EXPECT_EQ(kept, pairs);
        for (int r = 0; r < R; ++r) {
          EXPECT_EQ(counts[r], n) << "rank " << r;
          EXPECT_NEAR(losses[r][0], aux_ref, 1e-5 * aux_ref) << "rank " << r;
          EXPECT_NEAR(losses[r][1], z_ref, 1e-5 * z_ref) << "rank " << r;
        }
      }
}

// ---- argument validation -----------------------------------------------------------------------

struct Args {
  RouterConfig c;
  Tensor logits, bias, idx, w, prob_sum, counts, scalars, d_w, d_logits, losses;
  Args() {
    c = basic(8, 2);
    c.aux_loss = AuxLossType::kGlobalBatch;
    c.aux_loss_coeff = 0.1f;
    c.z_loss_coeff = 0.1f;
    logits = Tensor::zeros({4, 8}, DType::kF32);
    idx = Tensor::zeros({4, 2}, DType::kI32);
    w = Tensor::zeros({4, 2}, DType::kF32);
    prob_sum = Tensor::zeros({1, 8}, DType::kF32);
    counts = Tensor::zeros({1, 8}, DType::kF32);
    scalars = Tensor::zeros({2}, DType::kF32);
    d_w = Tensor::zeros({4, 2}, DType::kF32);
    d_logits = Tensor::zeros({4, 8}, DType::kF32);
    losses = Tensor::zeros({2}, DType::kF32);
  }
  RouterStats stats() const { return RouterStats{prob_sum, counts, scalars}; }
  void fwd() const { route_forward(c, logits, bias, idx, w, stats()); }
  void cnt() const { count_routed(c, idx, stats()); }
  void loss() const { router_losses(c, stats(), losses); }
  void bwd(double d_aux = 1, double d_z = 1) const {
    route_backward(c, logits, bias, idx, d_w, stats(), d_aux, d_z, d_logits);
  }
  void all() const {
    fwd();
    cnt();
    loss();
    bwd();
  }
};

TEST(RouterValidation, TheDefaultArgumentsAreValid) { Args().all(); }

TEST(RouterValidation, ConfigFields) {
  auto bad = [](std::function<void(RouterConfig&)> edit, const std::string& needle) {
    Args a;
    edit(a.c);
    expect_error([&] { a.fwd(); }, "epx::route_forward: " + needle);
    expect_error([&] { a.cnt(); }, "epx::count_routed: " + needle);
    expect_error([&] { a.loss(); }, "epx::router_losses: " + needle);
    expect_error([&] { a.bwd(); }, "epx::route_backward: " + needle);
  };
  bad([](RouterConfig& c) { c.num_experts = 0; }, "config.num_experts is 0, expected >= 1");
  bad([](RouterConfig& c) { c.topk = 0; }, "config.topk is 0, expected 1..8");
  bad([](RouterConfig& c) { c.topk = 9; }, "config.topk is 9, expected 1..8");
  bad([](RouterConfig& c) { c.score_function = static_cast<ScoreFunction>(7); }, "config.score_function is 7");
  bad([](RouterConfig& c) { c.num_groups = 3; }, "config.num_groups is 3, expected a divisor of config.num_experts = 8");
  bad([](RouterConfig& c) { c.num_groups = 0; }, "config.num_groups is 0");
  bad([](RouterConfig& c) { c.num_groups = 4; c.group_topk = 0; }, "config.group_topk is 0, expected 1..4");
  bad([](RouterConfig& c) { c.num_groups = 4; c.group_topk = 5; }, "config.group_topk is 5, expected 1..4");
  bad([](RouterConfig& c) { c.group_topk = 2; }, "config.group_topk is 2, expected 1..1");
  bad([](RouterConfig& c) { c.num_groups = 4; c.group_topk = 1; c.topk = 3; },
      "config.topk is 3, more than the 2 experts in the config.group_topk = 1 kept groups");
  bad([](RouterConfig& c) { c.routed_scaling_factor = 0; }, "config.routed_scaling_factor is 0");
  bad([](RouterConfig& c) { c.routed_scaling_factor = INFINITY; }, "config.routed_scaling_factor is inf");
  bad([](RouterConfig& c) { c.aux_loss = static_cast<AuxLossType>(5); }, "config.aux_loss is 5");
  bad([](RouterConfig& c) { c.aux_loss_coeff = -1; }, "config.aux_loss_coeff is -1, expected a finite value >= 0");
  bad([](RouterConfig& c) { c.aux_loss_coeff = NAN; }, "config.aux_loss_coeff is nan");
  bad([](RouterConfig& c) { c.z_loss_coeff = -0.5f; }, "config.z_loss_coeff is -0.5");
  bad([](RouterConfig& c) { c.z_loss_coeff = INFINITY; }, "config.z_loss_coeff is inf");
  bad([](RouterConfig& c) { c.aux_loss = AuxLossType::kSequence; c.seq_len = 0; },
      "config.seq_len is 0, expected >= 1 (tokens per sequence) with aux_loss = sequence");
  bad([](RouterConfig& c) { c.seq_len = -2; }, "config.seq_len is -2, expected >= 0");
}

TEST(RouterValidation, ForwardShapesAndDtypes) {
  const char* fn = "epx::route_forward: ";
  { Args a; a.logits = Tensor::zeros({4, 7}, DType::kF32);
    expect_error([&] { a.fwd(); }, std::string(fn) + "logits has shape [4, 7], expected [*, 8]"); }
  { Args a; a.logits = Tensor::zeros({4, 8}, DType::kF16);
    expect_error([&] { a.fwd(); }, std::string(fn) + "logits has dtype fp16, expected fp32, bf16 or fp64"); }
  { Args a; a.logits = Tensor();
    expect_error([&] { a.fwd(); }, std::string(fn) + "logits is missing"); }
  { Args a; a.idx = Tensor::zeros({3, 2}, DType::kI32);
    expect_error([&] { a.fwd(); }, std::string(fn) + "topk_idx has shape [3, 2], expected [4, 2]"); }
  { Args a; a.idx = Tensor::zeros({4, 2}, DType::kF32);
    expect_error([&] { a.fwd(); }, std::string(fn) + "topk_idx has dtype fp32, expected int32 or int64"); }
  { Args a; a.w = Tensor::zeros({4, 3}, DType::kF32);
    expect_error([&] { a.fwd(); }, std::string(fn) + "topk_weights has shape [4, 3], expected [4, 2]"); }
  { Args a; a.w = Tensor::zeros({4, 2}, DType::kF64);  // fp64 weights need fp64 logits
    expect_error([&] { a.fwd(); }, std::string(fn) + "topk_weights has dtype fp64, expected fp32"); }
  { Args a; a.prob_sum = Tensor::zeros({2, 8}, DType::kF32);
    expect_error([&] { a.fwd(); }, std::string(fn) + "stats.prob_sum has shape [2, 8], expected [1, 8]"); }
  { Args a; a.prob_sum = Tensor();
    expect_error([&] { a.fwd(); }, std::string(fn) + "stats.prob_sum is missing (aux_loss = global_batch needs it)"); }
  { Args a; a.scalars = Tensor::zeros({2}, DType::kF64);
    expect_error([&] { a.fwd(); }, std::string(fn) + "stats.scalars has dtype fp64, expected fp32"); }
  { Args a; a.c.aux_loss = AuxLossType::kNone; a.scalars = Tensor();
    expect_error([&] { a.fwd(); }, std::string(fn) + "stats.scalars is missing (z_loss_coeff > 0 needs it)"); }
  { Args a; a.c.aux_loss = AuxLossType::kSequence; a.c.seq_len = 3;
    expect_error([&] { a.fwd(); }, std::string(fn) +
                 "logits has 4 rows (tokens), expected a multiple of config.seq_len = 3 (aux_loss = sequence)"); }
  { Args a; a.c.aux_loss = AuxLossType::kSequence; a.c.seq_len = 2;  // prob_sum must be [2, 8] now
    expect_error([&] { a.fwd(); }, std::string(fn) + "stats.prob_sum has shape [1, 8], expected [2, 8]"); }
}

TEST(RouterValidation, PartialBiasSet) {
  for (int op = 0; op < 2; ++op) {
    const std::string fn = op == 0 ? "epx::route_forward: " : "epx::route_backward: ";
    Args a;
    a.bias = Tensor::zeros({8}, DType::kF32);
    auto call = [&] { op == 0 ? a.fwd() : a.bwd(); };
    expect_error(call, fn + "expert_bias is given but config.use_expert_bias is false (partial bias set");
    a.c.use_expert_bias = true;
    a.bias = Tensor();
    expect_error(call, fn + "expert_bias is missing but config.use_expert_bias is true (partial bias set");
    a.bias = Tensor::zeros({7}, DType::kF32);
    expect_error(call, fn + "expert_bias has shape [7], expected [8]");
    a.bias = Tensor::zeros({8}, DType::kBF16);
    expect_error(call, fn + "expert_bias has dtype bf16, expected fp32");
    a.bias = Tensor::zeros({8}, DType::kF32);
    a.fwd();  // a real routing for the backward to read
    call();
  }
}

TEST(RouterValidation, Devices) {
  Args a;
  // Never dereferenced: validation stops first.
  TensorRef cuda_idx(a.w.data(), DType::kI32, {4, 2}, Device::cuda(0));
  expect_error([&] { route_forward(a.c, a.logits, TensorRef(), cuda_idx, a.w, a.stats()); },
               "epx::route_forward: topk_idx is on cuda:0, expected cpu");
  expect_error([&] { count_routed(a.c, cuda_idx, a.stats()); }, "epx::count_routed: stats.counts is on cpu, expected cuda:0");
  TensorRef cuda_losses(a.losses.data(), DType::kF32, {2}, Device::cuda(0));
  expect_error([&] { router_losses(a.c, a.stats(), cuda_losses); },
               "epx::router_losses: stats.prob_sum is on cpu, expected cuda:0");
  TensorRef cuda_d(a.d_logits.data(), DType::kF32, {4, 8}, Device::cuda(0));
  Tensor ids = Tensor::zeros({4, 2}, DType::kI32);
  expect_error([&] { route_backward(a.c, a.logits, TensorRef(), ids, a.d_w, a.stats(), 1, 1, cuda_d); },
               "epx::route_backward: d_logits is on cuda:0, expected cpu");
  Tensor counts = Tensor::zeros({8}, DType::kF32);
  TensorRef cuda_bias(counts.data(), DType::kF32, {8}, Device::cuda(0));
  expect_error([&] { update_expert_bias(cuda_bias, counts, 0.1f); },
               "epx::update_expert_bias: counts is on cpu, expected cuda:0");
}

TEST(RouterValidation, CountRouted) {
  const char* fn = "epx::count_routed: ";
  { Args a; a.idx = Tensor::zeros({4, 3}, DType::kI32);
    expect_error([&] { a.cnt(); }, std::string(fn) + "routed_experts has shape [4, 3], expected [4, 2]"); }
  { Args a; a.idx = Tensor::zeros({4, 2}, DType::kF32);
    expect_error([&] { a.cnt(); }, std::string(fn) + "routed_experts has dtype fp32, expected int32 or int64"); }
  { Args a; a.counts = Tensor::zeros({8}, DType::kF32);
    expect_error([&] { a.cnt(); }, std::string(fn) + "stats.counts has shape [8], expected [1, 8]"); }
  { Args a; a.counts = Tensor();
    expect_error([&] { a.cnt(); }, std::string(fn) + "stats.counts is missing"); }
  { Args a; a.counts = Tensor::zeros({1, 8}, DType::kI32);
    expect_error([&] { a.cnt(); }, std::string(fn) + "stats.counts has dtype int32, expected fp32 or fp64"); }
  { Args a; a.c.aux_loss = AuxLossType::kSequence; a.c.seq_len = 3;
    expect_error([&] { a.cnt(); }, std::string(fn) + "routed_experts has 4 rows (tokens), expected a multiple of config.seq_len = 3"); }
  { Args a; a.idx = tensor_of({4, 2}, DType::kI32, {0, 1, 2, 3, 4, 8, -1, -1});
    expect_error([&] { a.cnt(); }, std::string(fn) + "routed_experts[2, 1] is 8, expected -1 (masked) or an expert id in [0, 8)"); }
  { Args a; a.idx = tensor_of({4, 2}, DType::kI64, {0, 1, -2, 3, 0, 1, -1, -1});
    expect_error([&] { a.cnt(); }, std::string(fn) + "routed_experts[1, 0] is -2"); }
  { Args a; a.idx = tensor_of({4, 2}, DType::kI32, {0, 1, 5, 5, 0, 1, -1, -1});
    expect_error([&] { a.cnt(); }, std::string(fn) + "routed_experts row 1 names expert 5 twice"); }
}

TEST(RouterValidation, Losses) {
  const char* fn = "epx::router_losses: ";
  { Args a; a.losses = Tensor::zeros({3}, DType::kF32);
    expect_error([&] { a.loss(); }, std::string(fn) + "losses has shape [3], expected [2]"); }
  { Args a; a.losses = Tensor::zeros({2}, DType::kBF16);
    expect_error([&] { a.loss(); }, std::string(fn) + "losses has dtype bf16, expected fp32 or fp64"); }
  { Args a; a.counts = Tensor();
    expect_error([&] { a.loss(); }, std::string(fn) + "stats.counts is missing (aux_loss = global_batch needs it)"); }
  { Args a; a.scalars = Tensor();
    expect_error([&] { a.loss(); }, std::string(fn) + "stats.scalars is missing (aux_loss = global_batch needs it)"); }
  { Args a; a.counts = Tensor::zeros({1, 8}, DType::kF64);
    expect_error([&] { a.loss(); }, std::string(fn) + "stats.counts has dtype fp64, expected fp32"); }
  { Args a; a.c.aux_loss = AuxLossType::kSequence; a.c.seq_len = 2; a.prob_sum = Tensor::zeros({2, 8}, DType::kF32);
    expect_error([&] { a.loss(); }, std::string(fn) + "stats.counts has shape [1, 8], expected [2, 8]"); }
  { Args a; a.prob_sum = Tensor::zeros({8}, DType::kF32);
    expect_error([&] { a.loss(); }, std::string(fn) + "stats.prob_sum has shape [8], expected [*, 8]"); }
}

TEST(RouterValidation, Backward) {
  const char* fn = "epx::route_backward: ";
  { Args a; a.d_logits = Tensor::zeros({4, 8}, DType::kBF16);
    expect_error([&] { a.bwd(); }, std::string(fn) + "d_logits has dtype bf16, expected fp32"); }
  { Args a; a.d_logits = Tensor::zeros({5, 8}, DType::kF32);
    expect_error([&] { a.bwd(); }, std::string(fn) + "d_logits has shape [5, 8], expected [4, 8]"); }
  { Args a; a.d_w = Tensor::zeros({4, 1}, DType::kF32);
    expect_error([&] { a.bwd(); }, std::string(fn) + "d_topk_weights has shape [4, 1], expected [4, 2]"); }
  { Args a; a.d_w = Tensor::zeros({4, 2}, DType::kBF16);
    expect_error([&] { a.bwd(); }, std::string(fn) + "d_topk_weights has dtype bf16, expected fp32"); }
  { Args a; expect_error([&] { a.bwd(NAN, 1); }, std::string(fn) + "d_aux is nan, expected a finite number"); }
  { Args a; expect_error([&] { a.bwd(1, INFINITY); }, std::string(fn) + "d_z is inf, expected a finite number"); }
  { Args a; a.counts = Tensor();
    expect_error([&] { a.bwd(); }, std::string(fn) + "stats.counts is missing (aux_loss = global_batch needs it)"); }
  { Args a; a.scalars = Tensor::zeros({3}, DType::kF32);
    expect_error([&] { a.bwd(); }, std::string(fn) + "stats.scalars has shape [3], expected [2]"); }
  { Args a; a.idx = Tensor::zeros({4, 3}, DType::kI32);
    expect_error([&] { a.bwd(); }, std::string(fn) + "topk_idx has shape [4, 3], expected [4, 2]"); }
  { Args a; a.idx = tensor_of({4, 2}, DType::kI32, {0, 1, 0, 9, 0, 1, 0, 1});
    expect_error([&] { a.bwd(); }, std::string(fn) + "topk_idx[1, 1] is 9, expected -1 (masked) or an expert id in [0, 8)"); }
  { Args a; a.idx = tensor_of({4, 2}, DType::kI32, {0, 1, 0, 1, 3, 3, 0, 1});
    expect_error([&] { a.bwd(); }, std::string(fn) + "topk_idx row 2 names expert 3 twice"); }
}

TEST(RouterValidation, UpdateExpertBias) {
  const char* fn = "epx::update_expert_bias: ";
  Tensor bias = Tensor::zeros({8}, DType::kF32), counts = Tensor::zeros({8}, DType::kF32);
  expect_error([&] { update_expert_bias(bias, Tensor::zeros({1, 8}, DType::kF32), 0.1f); },
               std::string(fn) + "counts has shape [1, 8], expected [8]");
  expect_error([&] { update_expert_bias(bias, Tensor::zeros({8}, DType::kI32), 0.1f); },
               std::string(fn) + "counts has dtype int32, expected fp32 or fp64");
  expect_error([&] { update_expert_bias(Tensor::zeros({8}, DType::kBF16), counts, 0.1f); },
               std::string(fn) + "expert_bias has dtype bf16, expected fp32");
  expect_error([&] { update_expert_bias(bias, counts, -0.1f); }, std::string(fn) + "rate is -0.1, expected a finite value >= 0");
  expect_error([&] { update_expert_bias(bias, counts, NAN); }, std::string(fn) + "rate is nan");
  expect_error([&] { update_expert_bias(Tensor::zeros({0}, DType::kF32), Tensor::zeros({0}, DType::kF32), 0.1f); },
               std::string(fn) + "expert_bias has shape [0], expected at least one expert");
}

}  // namespace
}  // namespace epx
