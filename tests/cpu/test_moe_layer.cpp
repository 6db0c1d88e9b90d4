// The MoE layer on the host backend: whole-layer gradients against central finite differences in
// fp64 for every option, R simulated ranks against one rank, pipeline chunks against one chunk,
// interleaved microbatches, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/error_text.h"
#include "core/ep_state.h"
#include "core/random.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/moe.h"
#include "epx/presets.h"

namespace epx {
namespace {

using testing::what_of;

struct Variant {
  std::string name;
  std::function<void(MoEConfig&)> apply;
};

MoEConfig base_config(DType dt) {
  MoEConfig c = moe_config(find_preset("tiny"), dt);
  c.router.aux_loss_coeff = 0.3f;  // large enough that the aux path shows in the gradient
  c.router.z_loss_coeff = 0.2f;
  return c;
}

GroupConfig group_for(const MoEConfig& c, int64_t max_tokens) {
  GroupConfig g;
  g.num_experts = c.router.num_experts;
  g.hidden = c.hidden;
  g.max_tokens_per_rank = static_cast<int>(max_tokens);
  g.max_topk = c.router.topk;
  g.max_dtype = c.dtype;
  g.align = 4;
  g.timeout_s = 30;
  return g;
}

Tensor normal(Shape s, DType dt, uint64_t seed, uint64_t stream, double scale = 1.0) {
  Tensor t = Tensor::empty(s, dt);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, scale * detail::counter_normal(seed, stream, i));
  return t;
}

// The fp32 gradients `which` of a layer, one after the other.
std::vector<float> flat_grads(const MoELayer& L, std::initializer_list<Tensor MoEParams::*> which) {
  std::vector<float> v;
  for (auto w : which) {
    const Tensor& g = L.grads().*w;
    v.insert(v.end(), g.ptr<float>(), g.ptr<float>() + g.numel());
  }
  return v;
}

// Microbatch A's forward and backward (input xa, loss weights ca), then B's, each overwriting the
// gradients; `grads()` reads them after each backward.
template <class Grads>
std::pair<std::vector<float>, std::vector<float>> one_after_the_other(MoELayer& L, const Tensor& xa, const Tensor& ca,
                                                                      const Tensor& xb, const Tensor& cb, Grads&& grads) {
  Tensor out = Tensor::zeros(xa.shape(), xa.dtype()), dx = Tensor::zeros(xa.shape(), xa.dtype());
  MoEContext a = L.forward(xa, out);
  L.backward(a, ca, dx);
  std::vector<float> ga = grads();
  MoEContext b = L.forward(xb, out);
  L.backward(b, cb, dx);
  return {std::move(ga), grads()};
}

// One R-rank layer plus its inputs; loss(L) = sum_r <c_r, out_r> + aux + z.

struct Rig {
  MoEConfig config;
  int ranks;
  int64_t tokens;
  std::vector<Group> groups;
  std::vector<std::unique_ptr<MoELayer>> layers;
  std::vector<Tensor> x, c;

  Rig(const MoEConfig& cfg, int R, int64_t T, uint64_t seed) : config(cfg), ranks(R), tokens(T) {
    groups = Group::create_simulated(R, group_for(cfg, T));
    for (int r = 0; r < R; ++r) {
      layers.push_back(std::make_unique<MoELayer>(groups[r], cfg));
      layers[r]->init_params(seed, 0.5);
      if (cfg.router.use_expert_bias) {
        Tensor& b = layers[r]->params().expert_bias;
        for (int64_t e = 0; e < b.numel(); ++e) b.ptr<float>()[e] = 0.05f * static_cast<float>((e * 7) % 5) - 0.1f;
      }
    }
    x = per_rank(seed, 50);
    c = per_rank(seed, 80);
  }

  // One [T, H] input per rank: rank r's is normal(seed, stream + r).
  std::vector<Tensor> per_rank(uint64_t seed, uint64_t stream) const {
    std::vector<Tensor> v;
    for (int r = 0; r < ranks; ++r) v.push_back(normal({tokens, config.hidden}, config.dtype, seed, stream + r));
    return v;
  }

  // Forward on every rank; returns the loss and, with `backward`, fills d_x.
  double run(bool backward, std::vector<Tensor>* d_x = nullptr, std::vector<std::vector<int32_t>>* routing = nullptr,
             std::vector<Tensor>* outs = nullptr) {
    std::vector<double> partial(ranks), aux(ranks), z(ranks);
    if (d_x) d_x->assign(ranks, Tensor());
    if (routing) routing->assign(ranks, {});
    if (outs) outs->assign(ranks, Tensor());
    run_ranks(groups, [&](Group& g) {
      const int r = g.rank();
      Tensor out = Tensor::zeros({tokens, config.hidden}, config.dtype);
      MoEContext ctx = layers[r]->forward(x[r], out);
      double s = 0;
      for (int64_t i = 0; i < out.numel(); ++i) s += out.item(i) * c[r].item(i);
      partial[r] = s;
      if (outs) (*outs)[r] = out;
      aux[r] = ctx.losses().item(0);
      z[r] = ctx.losses().item(1);
      if (routing)
        for (int k = 0; k < ctx.num_chunks(); ++k) {
          const TensorRef& re = ctx.handle(k).routed_experts();
          (*routing)[r].insert((*routing)[r].end(), re.ptr<int32_t>(), re.ptr<int32_t>() + re.numel());
        }
      if (backward) {
        (*d_x)[r] = Tensor::zeros({tokens, config.hidden}, config.dtype);
        layers[r]->backward(ctx, c[r], (*d_x)[r]);
      }
    });
    // The global-batch aux loss and the z loss are one number for the whole group; the sequence
    // aux loss belongs to each rank's own sequences, so the objective sums it over ranks.
    const bool per_rank_aux = config.router.aux_loss == AuxLossType::kSequence;
    double loss = z[0] + (per_rank_aux ? 0.0 : aux[0]);
    for (int r = 0; r < ranks; ++r) {
      if (per_rank_aux) loss += aux[r];
      else EXPECT_EQ(aux[r], aux[0]) << "every rank must see the same global aux loss";
      EXPECT_EQ(z[r], z[0]);
    }
    for (double p : partial) loss += p;
    return loss;
  }
};

// Parameter tensors of a layer, by name, with their gradients.
std::vector<std::pair<std::string, std::pair<Tensor*, const Tensor*>>> param_list(MoELayer& L) {
  MoEParams& p = L.params();
  const MoEParams& g = L.grads();
  return {{"gate", {&p.gate, &g.gate}},           {"w_in", {&p.w_in, &g.w_in}},
          {"b_in", {&p.b_in, &g.b_in}},           {"w_out", {&p.w_out, &g.w_out}},
          {"b_out", {&p.b_out, &g.b_out}},        {"shared_w_in", {&p.shared_w_in, &g.shared_w_in}},
          {"shared_w_out", {&p.shared_w_out, &g.shared_w_out}}};
}

void check_gradients(const MoEConfig& cfg, int R, int64_t T, uint64_t seed) {
  Rig rig(cfg, R, T, seed);
  std::vector<Tensor> d_x;
  std::vector<std::vector<int32_t>> routing0;
  rig.run(true, &d_x, &routing0);
  const double eps = 1e-6;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  int checked = 0;

  auto central = [&](const std::function<void(double)>& perturb) {
    std::vector<std::vector<int32_t>> routing;
    perturb(+eps);
    const double lp = rig.run(false, nullptr, &routing);
    EXPECT_EQ(routing, routing0) << "the perturbation changed the routing: choose other inputs";
    perturb(-2 * eps);
    const double lm = rig.run(false, nullptr, &routing);
    EXPECT_EQ(routing, routing0) << "the perturbation changed the routing: choose other inputs";
    perturb(+eps);
    return (lp - lm) / (2 * eps);
  };
  auto expect_close = [&](double analytic, double numeric, const std::string& what) {
    EXPECT_NEAR(analytic, numeric, 1e-6 + 1e-5 * std::fabs(numeric)) << what;
    ++checked;
  };

  // Inputs of each rank.
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < 3; ++n) {
      const int64_t i = std::uniform_int_distribution<int64_t>(0, rig.x[r].numel() - 1)(rng);
      double* v = rig.x[r].ptr<double>() + i;
      const double num = central([&](double d) { *v += d; });
      expect_close(d_x[r].ptr<double>()[i], num, "d_x rank " + std::to_string(r) + " element " + std::to_string(i));
    }

  // Parameters: replicated ones (gate, shared) are perturbed on every rank at once and their
  // gradient is the sum over ranks; expert tensors belong to one rank.
  const auto names = param_list(*rig.layers[0]);
  for (size_t k = 0; k < names.size(); ++k) {
    const std::string& name = names[k].first;
    if (!names[k].second.first->defined()) continue;
    const bool replicated = name == "gate" || name.rfind("shared", 0) == 0;
    for (int n = 0; n < 3; ++n) {
      const int owner = std::uniform_int_distribution<int>(0, R - 1)(rng);
      const int64_t i = std::uniform_int_distribution<int64_t>(0, names[k].second.first->numel() - 1)(rng);
      const double num = central([&](double d) {
        for (int r = 0; r < R; ++r)
          if (replicated || r == owner) param_list(*rig.layers[r])[k].second.first->ptr<double>()[i] += d;
      });
      double analytic = 0;
      for (int r = 0; r < R; ++r)
        if (replicated || r == owner) analytic += param_list(*rig.layers[r])[k].second.second->ptr<double>()[i];
      expect_close(analytic, num, name + "[" + std::to_string(i) + "] (rank " + std::to_string(owner) + ")");
    }
  }
  EXPECT_GT(checked, 3 * R + 6) << "the check must cover inputs and parameters";
}

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"deepseek_sigmoid_grouped_bias_shared", [](MoEConfig&) {}},
      {"softmax_plain", [](MoEConfig& c) {
         c.router.score_function = ScoreFunction::kSoftmax;
         c.router.num_groups = 1;
         c.router.group_topk = 1;
         c.router.use_expert_bias = false;
         c.shared_ffn_hidden = 0;
       }},
      {"softmax_after_topk_gelu_biases", [](MoEConfig& c) {
         c.router.score_function = ScoreFunction::kSoftmaxAfterTopk;
         c.activation = Activation::kGelu;
         c.expert_bias_terms = true;
       }},
      {"weight_grads_in_combine", [](MoEConfig& c) { c.weight_grads_in_ffn = false; }},
      {"weights_early_geglu", [](MoEConfig& c) {
         c.apply_weights_early = true;
         c.activation = Activation::kGeGLU;
       }},
      {"relu2_sequence_aux", [](MoEConfig& c) {
         c.activation = Activation::kRelu2;
         c.router.aux_loss = AuxLossType::kSequence;
         c.router.seq_len = 4;
       }},
      {"capacity_by_position", [](MoEConfig& c) {
         c.capacity.capacity_factor = 1.0f;
         c.capacity.drop_policy = DropPolicy::kByPosition;
       }},
      {"capacity_by_probability_early", [](MoEConfig& c) {
         c.capacity.capacity_factor = 1.0f;
         c.capacity.drop_policy = DropPolicy::kByProbability;
         c.apply_weights_early = true;
       }},
  };
  return v;
}

TEST(MoELayerGrad, FiniteDifferencesFp64EveryOption) {
  for (const Variant& v : variants())
    for (int R : {1, 2}) {
      SCOPED_TRACE(v.name + " R=" + std::to_string(R));
      MoEConfig c = base_config(DType::kF64);
      v.apply(c);
      check_gradients(c, R, 8, 11 + R);
    }
}

// R simulated ranks (4, and 8: one expert per rank) against one rank holding every expert and
// every token (fp32).
TEST(MoELayer, RanksMatchSingleRank) {
  for (const Variant& v : variants())
    for (int R : {4, 8}) {
      if (v.name == "relu2_sequence_aux") continue;  // sequence statistics are rank-local by design
      if (v.name.rfind("capacity", 0) == 0) continue;  // capacity is per source rank: T differs
      SCOPED_TRACE(v.name + " R=" + std::to_string(R));
      MoEConfig c = base_config(DType::kF32);
      v.apply(c);
      const int64_t T = 6;
      Rig many(c, R, T, 5);
      Rig one(c, 1, T * R, 5);
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < T * c.hidden; ++i) {
          one.x[0].ptr<float>()[r * T * c.hidden + i] = many.x[r].ptr<float>()[i];
          one.c[0].ptr<float>()[r * T * c.hidden + i] = many.c[r].ptr<float>()[i];
        }
      if (c.router.use_expert_bias)
        for (int r = 0; r < R; ++r) copy(one.layers[0]->params().expert_bias, many.layers[r]->params().expert_bias);
      std::vector<Tensor> dx_many, dx_one;
      const double l_many = many.run(true, &dx_many), l_one = one.run(true, &dx_one);
      EXPECT_NEAR(l_many, l_one, 1e-4 * (1 + std::fabs(l_one)));
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < T * c.hidden; ++i)
          ASSERT_NEAR(dx_many[r].ptr<float>()[i], dx_one[0].ptr<float>()[r * T * c.hidden + i], 1e-5)
              << "d_x rank " << r;
      // Expert gradients: rank r's local experts are the slice of the single rank's.
      const int64_t Le = c.router.num_experts / R;
      for (int r = 0; r < R; ++r)
        for (auto which : {&MoEParams::w_in, &MoEParams::w_out, &MoEParams::b_in}) {
          const Tensor& gm = many.layers[r]->grads().*which;
          if (!gm.defined()) continue;
          const Tensor& g1 = one.layers[0]->grads().*which;
          const int64_t per = gm.numel() / Le;
          for (int64_t i = 0; i < gm.numel(); ++i)
            ASSERT_NEAR(gm.ptr<float>()[i], g1.ptr<float>()[r * Le * per + i], 1e-5) << "expert grad rank " << r;
        }
      // Replicated parameters: the single rank's gradient is the sum over ranks.
      for (auto which : {&MoEParams::gate, &MoEParams::shared_w_in, &MoEParams::shared_w_out}) {
        const Tensor& g1 = one.layers[0]->grads().*which;
        if (!g1.defined()) continue;
        for (int64_t i = 0; i < g1.numel(); ++i) {
          double s = 0;
          for (int r = 0; r < R; ++r) s += (many.layers[r]->grads().*which).ptr<float>()[i];
          ASSERT_NEAR(s, g1.ptr<float>()[i], 1e-5);
        }
      }
    }
}

// Two microbatches in flight on one layer (forward A, forward B, backward B, backward A) give the
// same gradients as running them one after the other: each context owns its routing.
TEST(MoELayer, InterleavedMicrobatchesKeepTheirOwnRouting) {
  MoEConfig c = base_config(DType::kF32);
  const int R = 2;
  const int64_t T = 6;
  Rig rig(c, R, T, 9);
  const std::vector<Tensor> xb = rig.per_rank(123, 0), cb = rig.per_rank(321, 0);
  auto grads_of = [&](int r) {
    return flat_grads(*rig.layers[r], {&MoEParams::w_in, &MoEParams::w_out, &MoEParams::gate});
  };
  std::vector<std::vector<float>> seq_a(R), seq_b(R), inter_a(R), inter_b(R);
  run_ranks(rig.groups, [&](Group& g) {
    const int r = g.rank();
    MoELayer& L = *rig.layers[r];
    std::tie(seq_a[r], seq_b[r]) = one_after_the_other(L, rig.x[r], rig.c[r], xb[r], cb[r], [&] { return grads_of(r); });
    Tensor out = Tensor::zeros({T, c.hidden}, c.dtype), dx = Tensor::zeros({T, c.hidden}, c.dtype);
    MoEContext a2 = L.forward(rig.x[r], out);
    MoEContext b2 = L.forward(xb[r], out);
    L.backward(b2, cb[r], dx);
    inter_b[r] = grads_of(r);
    L.backward(a2, rig.c[r], dx);
    inter_a[r] = grads_of(r);
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(seq_a[r], inter_a[r]) << "rank " << r;
    EXPECT_EQ(seq_b[r], inter_b[r]) << "rank " << r;
    EXPECT_NE(seq_a[r], seq_b[r]) << "the two microbatches must differ for the test to mean anything";
  }
}

// Gradient accumulation: backward(..., accumulate_grads) adds to grads(). After microbatch A's
// backward (overwrite) and B's (accumulate), every gradient is exactly fl(G_A + G_B): the
// accumulated sum is rounded once, as each overwritten gradient was. A bf16 layer with bf16 expert
// gradients refuses before doing anything.
TEST(MoELayer, AccumulatedGradientsAreTheSumOfTheMicrobatches) {
  MoEConfig c = base_config(DType::kF32);
  ASSERT_GT(c.shared_ffn_hidden, 0) << "the shared experts' gradients take part too";
  const int R = 2;
  const int64_t T = 6;
  Rig rig(c, R, T, 13);
  const std::vector<Tensor> xb = rig.per_rank(456, 0), cb = rig.per_rank(654, 0);
  auto grads_of = [&](int r) {
    return flat_grads(*rig.layers[r], {&MoEParams::w_in, &MoEParams::w_out, &MoEParams::gate,
                                       &MoEParams::shared_w_in, &MoEParams::shared_w_out});
  };
  std::vector<std::vector<float>> ga(R), gb(R), acc(R);
  run_ranks(rig.groups, [&](Group& g) {
    const int r = g.rank();
    MoELayer& L = *rig.layers[r];
    std::tie(ga[r], gb[r]) = one_after_the_other(L, rig.x[r], rig.c[r], xb[r], cb[r], [&] { return grads_of(r); });
    Tensor out = Tensor::zeros({T, c.hidden}, c.dtype), dx = Tensor::zeros({T, c.hidden}, c.dtype);
    MoEContext a2 = L.forward(rig.x[r], out);
    L.backward(a2, rig.c[r], dx);
    MoEContext b2 = L.forward(xb[r], out);
    L.backward(b2, cb[r], dx, 1.0, 1.0, {}, /*accumulate_grads=*/true);
    acc[r] = grads_of(r);
  });
  for (int r = 0; r < R; ++r) {
    ASSERT_EQ(acc[r].size(), ga[r].size());
    int64_t differ = 0;
    for (size_t i = 0; i < acc[r].size(); ++i) {
      EXPECT_EQ(acc[r][i], ga[r][i] + gb[r][i]) << "rank " << r << ", gradient element " << i;
      differ += ga[r][i] != gb[r][i];
    }
    EXPECT_GT(differ, 0) << "the two microbatches must differ for the test to mean anything";
  }

  MoEConfig cb16 = base_config(DType::kBF16);
  cb16.expert_grads_in_dtype = true;
  Rig bf(cb16, 1, T, 3);
  MoELayer& L = *bf.layers[0];
  Tensor out = Tensor::zeros({T, cb16.hidden}, cb16.dtype), dx = Tensor::zeros({T, cb16.hidden}, cb16.dtype);
  MoEContext ctx = L.forward(bf.x[0], out);
  std::string msg;
  try {
    L.backward(ctx, bf.c[0], dx, 1.0, 1.0, {}, true);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("accumulate_grads needs fp32 expert gradients; they are bf16"), std::string::npos) << msg;
}

// FP8 forward: tokens travel quantized, the expert GEMMs see FP8 operands; outputs stay within FP8
// error of the high-precision layer, backward runs and stays close too, and R ranks still match one.
TEST(MoELayer, Fp8ForwardPrecisions) {
  for (MlpPrecision prec : {MlpPrecision::kFp8Block, MlpPrecision::kMxfp8}) {
    SCOPED_TRACE(mlp_precision_name(prec));
    MoEConfig hi = base_config(DType::kF32);
    hi.hidden = 256;  // two 128-blocks and eight 32-blocks per row
    MoEConfig lo = hi;
    lo.precision = prec;
    const int R = 2;
    const int64_t T = 6;
    Rig a(hi, R, T, 3), b(lo, R, T, 3), one(lo, 1, T * R, 3);
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < T * hi.hidden; ++i) {
        one.x[0].ptr<float>()[r * T * hi.hidden + i] = b.x[r].ptr<float>()[i];
        one.c[0].ptr<float>()[r * T * hi.hidden + i] = b.c[r].ptr<float>()[i];
      }
    std::vector<Tensor> dxa, dxb, dx1, oa, ob;
    const double la = a.run(true, &dxa, nullptr, &oa), lb = b.run(true, &dxb, nullptr, &ob), l1 = one.run(true, &dx1);
    EXPECT_NE(la, lb) << "the FP8 forward must actually quantize";
    EXPECT_NEAR(lb, l1, 1e-4 * (1 + std::fabs(l1))) << "R ranks vs one rank";
    double onum = 0, oden = 0;
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < T * hi.hidden; ++i) {
        const double d = ob[r].ptr<float>()[i] - oa[r].ptr<float>()[i];
        onum += d * d;
        oden += double(oa[r].ptr<float>()[i]) * oa[r].ptr<float>()[i];
      }
    // e4m3 keeps 3 mantissa bits (about 3.6% rms per operand); four quantized operands through two
    // GEMMs and the activation give 7-10% here (measured 7.5% fp8_block, 9.5% mxfp8).
    EXPECT_LT(std::sqrt(onum / oden), 0.12) << "FP8 forward output too far from the high-precision one";
    EXPECT_GT(onum, 0.0);
    double num = 0, den = 0;
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < T * hi.hidden; ++i) {
        const double d = dxb[r].ptr<float>()[i] - dxa[r].ptr<float>()[i];
        num += d * d;
        den += double(dxa[r].ptr<float>()[i]) * dxa[r].ptr<float>()[i];
        ASSERT_NEAR(dxb[r].ptr<float>()[i], dx1[0].ptr<float>()[r * T * hi.hidden + i], 1e-5);
      }
    EXPECT_LT(std::sqrt(num / den), 0.1) << "backward of the FP8 forward drifted too far";
    EXPECT_GT(num, 0.0);
  }
}

TEST(MoELayerErrors, BadInputs) {
  MoEConfig c = base_config(DType::kF32);
  auto groups = Group::create_simulated(1, group_for(c, 8));
  auto what = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  MoEConfig wrong = c;
  wrong.hidden = c.hidden + 1;
  EXPECT_NE(what([&] { MoELayer L(groups[0], wrong); }).find("config.hidden is 9, the group was created for hidden = 8"),
            std::string::npos);
  wrong = c;
  wrong.router.num_experts = 16;
  EXPECT_NE(what([&] { MoELayer L(groups[0], wrong); }).find("the group was created for 8 experts"), std::string::npos);
  MoELayer L(groups[0], c);
  L.init_params(1);
  Tensor x = Tensor::zeros({9, c.hidden}, c.dtype), out = Tensor::zeros({9, c.hidden}, c.dtype);
  EXPECT_NE(what([&] { L.forward(x, out); })
                .find("epx::MoELayer::forward: x has 9 tokens, the group was created for at most max_tokens_per_rank = 8"),
            std::string::npos);
  Tensor xb = Tensor::zeros({4, c.hidden}, DType::kBF16), o4 = Tensor::zeros({4, c.hidden}, c.dtype);
  EXPECT_NE(what([&] { L.forward(xb, o4); }).find("x has dtype bf16, expected fp32"), std::string::npos);
  MoEContext empty;
  EXPECT_NE(what([&] { L.backward(empty, o4, o4); }).find("used before MoELayer::forward()"), std::string::npos);
  Tensor x4 = normal({4, c.hidden}, c.dtype, 1, 1);
  MoEContext ctx = L.forward(x4, o4);
  Tensor d3 = Tensor::zeros({3, c.hidden}, c.dtype);
  EXPECT_NE(what([&] { L.backward(ctx, d3, o4); }).find("d_out has shape [3, 8], expected [4, 8]"), std::string::npos);
  Tensor d4 = Tensor::zeros({4, c.hidden}, c.dtype), dx4 = Tensor::zeros({4, c.hidden}, c.dtype);
  L.backward(ctx, d4, dx4);
  EXPECT_NE(what([&] { L.backward(ctx, d4, dx4); }).find("backward was already called on this context"),
            std::string::npos);
  MoEConfig biased = c;
  biased.expert_bias_terms = true;
  MoELayer B(groups[0], biased);
  B.params().b_out = Tensor();  // a partial bias set must fail early and clearly
  EXPECT_NE(what([&] { B.forward(x4, o4); }).find("b_out"), std::string::npos);
}

// MoEConfig::pipeline_chunks and overlap_communication: chunked layers (uneven chunks, and more
// chunks than tokens, so some are empty) give the one-chunk layer's outputs, losses, input
// gradients and replicated-parameter gradients bit for bit; the expert weight gradients sum the
// chunks', so they match within fp32 rounding. A second step on the same contexts matches too.
TEST(MoELayer, PipelineChunksMatchOneChunk) {
  struct Run {
    std::vector<Tensor> out, dx;
    std::vector<std::vector<double>> losses;
    std::vector<std::vector<float>> replicated, expert;
  };
  auto run = [](const MoEConfig& c, int R, int64_t T, uint64_t seed) {
    Rig rig(c, R, T, seed);
    const std::vector<Tensor> x2 = rig.per_rank(seed + 1, 7), c2 = rig.per_rank(seed + 2, 9);
    Run res;
    res.out.resize(R);
    res.dx.resize(R);
    res.losses.resize(R);
    res.replicated.resize(R);
    res.expert.resize(R);
    run_ranks(rig.groups, [&](Group& g) {
      const int r = g.rank();
      MoELayer& L = *rig.layers[r];
      MoEContext ctx;
      for (int step = 0; step < 2; ++step) {
        res.out[r] = Tensor::zeros({T, c.hidden}, c.dtype);
        res.dx[r] = Tensor::zeros({T, c.hidden}, c.dtype);
        L.forward(step ? x2[r] : rig.x[r], res.out[r], ctx);
        L.backward(ctx, step ? c2[r] : rig.c[r], res.dx[r]);
      }
      EXPECT_EQ(ctx.num_chunks(), c.pipeline_chunks);
      res.losses[r] = {ctx.losses().item(0), ctx.losses().item(1)};
      res.replicated[r] = flat_grads(L, {&MoEParams::gate, &MoEParams::shared_w_in, &MoEParams::shared_w_out});
      res.expert[r] = flat_grads(L, {&MoEParams::w_in, &MoEParams::w_out, &MoEParams::b_in, &MoEParams::b_out});
    });
    return res;
  };
  for (const Variant& v : variants()) {
    if (v.name.rfind("capacity", 0) == 0) continue;  // chunks need dropless routing (an error, below)
    for (int R : {1, 2, 4})
      for (auto [chunks, T] : {std::pair<int, int64_t>{2, 7}, {3, 8}, {5, 3}}) {
        SCOPED_TRACE(v.name + " R=" + std::to_string(R) + " chunks=" + std::to_string(chunks) +
                     " T=" + std::to_string(T));
        MoEConfig one = base_config(DType::kF32);
        v.apply(one);
        if (one.router.aux_loss == AuxLossType::kSequence) one.router.seq_len = 1;  // any T
        MoEConfig many = one;
        many.pipeline_chunks = chunks;
        many.overlap_communication = true;
        const Run a = run(one, R, T, 21), b = run(many, R, T, 21);
        for (int r = 0; r < R; ++r) {
          for (int64_t i = 0; i < a.out[r].numel(); ++i) {
            ASSERT_EQ(a.out[r].item(i), b.out[r].item(i)) << "rank " << r << " out element " << i;
            ASSERT_EQ(a.dx[r].item(i), b.dx[r].item(i)) << "rank " << r << " d_x element " << i;
          }
          EXPECT_EQ(a.losses[r], b.losses[r]) << "rank " << r;
          EXPECT_EQ(a.replicated[r], b.replicated[r]) << "rank " << r;
          ASSERT_EQ(a.expert[r].size(), b.expert[r].size());
          int64_t nonzero = 0;
          for (size_t i = 0; i < a.expert[r].size(); ++i) {
            ASSERT_NEAR(a.expert[r][i], b.expert[r][i], 1e-5 * (1 + std::fabs(a.expert[r][i])))
                << "rank " << r << " expert gradient element " << i;
            nonzero += a.expert[r][i] != 0;
          }
          EXPECT_GT(nonzero, 0) << "rank " << r << ": the expert gradients must not all be zero";
        }
      }
  }
}

// Ranks with different token counts (one with none) run the same number of chunks, each with its
// own boundaries: the chunked layer still gives the one-chunk outputs and input gradients.
TEST(MoELayer, PipelineChunksWithUnequalTokensPerRank) {
  MoEConfig one = base_config(DType::kF32);
  MoEConfig many = one;
  many.pipeline_chunks = 3;
  many.overlap_communication = true;
  const int R = 4;
  const std::vector<int64_t> tokens = {0, 7, 2, 5};
  std::vector<Tensor> x, c;
  for (int r = 0; r < R; ++r) {
    x.push_back(normal({tokens[r], one.hidden}, one.dtype, 51, r));
    c.push_back(normal({tokens[r], one.hidden}, one.dtype, 52, r));
  }
  std::vector<Tensor> out[2], dx[2];
  std::vector<std::vector<float>> grads[2];
  for (int v = 0; v < 2; ++v) {
    const MoEConfig& cfg = v ? many : one;
    auto groups = Group::create_simulated(R, group_for(cfg, 8));
    out[v].resize(R);
    dx[v].resize(R);
    grads[v].resize(R);
    run_ranks(groups, [&](Group& g) {
      const int r = g.rank();
      MoELayer L(g, cfg);
      L.init_params(53, 0.5);
      out[v][r] = Tensor::zeros({tokens[r], cfg.hidden}, cfg.dtype);
      dx[v][r] = Tensor::zeros({tokens[r], cfg.hidden}, cfg.dtype);
      MoEContext ctx = L.forward(x[r], out[v][r]);
      EXPECT_EQ(ctx.num_chunks(), cfg.pipeline_chunks);
      // a chunk's buffers hold its own worst case (3 of the group's 8 tokens a rank), not the group's
      for (int k = 0; k < ctx.num_chunks(); ++k) {
        GroupConfig chunk_cfg = g.config();
        chunk_cfg.max_tokens_per_rank = v ? 3 : 8;
        EXPECT_EQ(ctx.handle(k).recv_capacity_rows(), worst_case_recv_rows(chunk_cfg, R)) << "chunk " << k;
      }
      L.backward(ctx, c[r], dx[v][r]);
      grads[v][r] = flat_grads(L, {&MoEParams::w_in, &MoEParams::w_out, &MoEParams::gate});
    });
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < out[0][r].numel(); ++i) {
      ASSERT_EQ(out[0][r].item(i), out[1][r].item(i)) << "rank " << r << " out element " << i;
      ASSERT_EQ(dx[0][r].item(i), dx[1][r].item(i)) << "rank " << r << " d_x element " << i;
    }
    ASSERT_EQ(grads[0][r].size(), grads[1][r].size());
    for (size_t i = 0; i < grads[0][r].size(); ++i)
      ASSERT_NEAR(grads[0][r][i], grads[1][r][i], 1e-5 * (1 + std::fabs(grads[0][r][i]))) << "rank " << r;
  }
}

// The chunked layer's gradients against central finite differences (fp64).
TEST(MoELayerGrad, FiniteDifferencesFp64PipelineChunks) {
  for (const Variant& v : variants()) {
    if (v.name.rfind("capacity", 0) == 0) continue;
    SCOPED_TRACE(v.name);
    MoEConfig c = base_config(DType::kF64);
    v.apply(c);
    c.pipeline_chunks = 3;
    c.overlap_communication = true;
    check_gradients(c, 2, 8, 31);
  }
}

// A bf16 layer with bf16 expert gradients: chunks after the first add to the gradient with one
// more bf16 rounding each, so the gradients stay within a few bf16 roundings of one chunk's; the
// outputs and input gradients stay bit for bit.
TEST(MoELayer, PipelineChunksWithBf16ExpertGrads) {
  MoEConfig one = base_config(DType::kBF16);
  one.expert_grads_in_dtype = true;
  MoEConfig many = one;
  many.pipeline_chunks = 3;
  const int R = 2;
  const int64_t T = 8;
  std::vector<std::vector<float>> grads[2];
  std::vector<Tensor> out[2], dx[2];
  int which = 0;
  for (const MoEConfig* c : {&one, &many}) {
    Rig rig(*c, R, T, 41);
    grads[which].resize(R);
    out[which].resize(R);
    dx[which].resize(R);
    run_ranks(rig.groups, [&](Group& g) {
      const int r = g.rank();
      MoELayer& L = *rig.layers[r];
      out[which][r] = Tensor::zeros({T, c->hidden}, c->dtype);
      dx[which][r] = Tensor::zeros({T, c->hidden}, c->dtype);
      MoEContext ctx = L.forward(rig.x[r], out[which][r]);
      L.backward(ctx, rig.c[r], dx[which][r]);
      for (auto w : {&MoEParams::w_in, &MoEParams::w_out}) {
        const Tensor& t = L.grads().*w;
        ASSERT_EQ(t.dtype(), DType::kBF16);
        for (int64_t i = 0; i < t.numel(); ++i) grads[which][r].push_back(static_cast<float>(t.item(i)));
      }
    });
    ++which;
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < out[0][r].numel(); ++i) {
      ASSERT_EQ(out[0][r].item(i), out[1][r].item(i)) << "rank " << r << " out element " << i;
      ASSERT_EQ(dx[0][r].item(i), dx[1][r].item(i)) << "rank " << r << " d_x element " << i;
    }
    float top = 0;
    for (float v : grads[0][r]) top = std::max(top, std::fabs(v));
    ASSERT_GT(top, 0.0f);
    int64_t differ = 0;
    for (size_t i = 0; i < grads[0][r].size(); ++i) {
      const float a = grads[0][r][i], b = grads[1][r][i];
      ASSERT_LE(std::fabs(a - b), 0x1p-6f * (std::fabs(a) + 0.05f * top)) << "rank " << r << " expert gradient " << i;
      differ += a != b;
    }
    EXPECT_GT(differ, 0) << "rank " << r << ": three chunks must round the bf16 gradients more than one does";
  }
}

TEST(MoELayerErrors, PipelineChunksNeedDroplessRouting) {
  MoEConfig c = base_config(DType::kF32);
  auto groups = Group::create_simulated(1, group_for(c, 8));
  for (int bad : {0, MoEConfig::kMaxPipelineChunks + 1}) {
    MoEConfig w = c;
    w.pipeline_chunks = bad;
    EXPECT_NE(what_of([&] { MoELayer L(groups[0], w); })
                  .find("config.pipeline_chunks is " + std::to_string(bad) + ", expected 1..16"),
              std::string::npos);
  }
  MoEConfig cap = c;
  cap.pipeline_chunks = 2;
  cap.capacity.capacity_factor = 1.5f;
  EXPECT_NE(what_of([&] { MoELayer L(groups[0], cap); })
                .find("needs dropless routing (capacity.capacity_factor 0, not 1.5)"),
            std::string::npos);
  MoEContext ctx;
  EXPECT_NE(what_of([&] { ctx.handle(); }).find("used before MoELayer::forward()"), std::string::npos);
  cap.capacity.capacity_factor = 0;
  MoELayer L(groups[0], cap);
  L.init_params(1);
  Tensor x = normal({4, c.hidden}, c.dtype, 1, 1), out = Tensor::zeros({4, c.hidden}, c.dtype);
  L.forward(x, out, ctx);
  EXPECT_NE(what_of([&] { ctx.handle(2); }).find("epx::MoEContext::handle: chunk is 2, expected 0..1"),
            std::string::npos);
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// A context reused step after step gives exactly what a fresh context gives, and keeps its buffers
// (the addresses a captured CUDA graph relies on).
TEST(MoELayer, ReusedContextMatchesFreshContext) {
  MoEConfig c = base_config(DType::kF32);
  const int R = 2;
  const int64_t T = 6;
  Rig rig(c, R, T, 17);
  const std::vector<Tensor> xb = rig.per_rank(555, 0), cb = rig.per_rank(556, 0);
  run_ranks(rig.groups, [&](Group& g) {
    const int r = g.rank();
    MoELayer& L = *rig.layers[r];
    Tensor out_fresh = Tensor::zeros({T, c.hidden}, c.dtype), dx_fresh = Tensor::zeros({T, c.hidden}, c.dtype);
    Tensor out_reused = Tensor::zeros({T, c.hidden}, c.dtype), dx_reused = Tensor::zeros({T, c.hidden}, c.dtype);
    MoEContext reused;
    // step 1 on batch a, step 2 on batch b: the reused context must not leak anything of step 1
    L.forward(rig.x[r], out_reused, reused);
    L.backward(reused, rig.c[r], dx_reused);
    const void* logits_before = reused.topk_weights().data();
    L.forward(xb[r], out_reused, reused);
    L.backward(reused, cb[r], dx_reused);
    const Tensor w_in_reused = L.grads().w_in.to(Device::cpu());
    EXPECT_EQ(reused.topk_weights().data(), logits_before) << "a reused context must keep its buffers";
    MoEContext fresh = L.forward(xb[r], out_fresh);
    L.backward(fresh, cb[r], dx_fresh);
    for (int64_t i = 0; i < out_fresh.numel(); ++i) {
      ASSERT_EQ(out_reused.item(i), out_fresh.item(i)) << "rank " << r << " out element " << i;
      ASSERT_EQ(dx_reused.item(i), dx_fresh.item(i)) << "rank " << r << " d_x element " << i;
    }
    for (int64_t i = 0; i < w_in_reused.numel(); ++i)
      ASSERT_EQ(w_in_reused.item(i), L.grads().w_in.item(i)) << "rank " << r << " d_w_in element " << i;
  });
}

// Expert weight gradients in the layer dtype are the fp32 gradients rounded once.
TEST(MoELayer, ExpertGradsInLayerDtypeAreRoundedFp32Grads) {
  MoEConfig c = base_config(DType::kBF16);
  MoEConfig cb = c;
  cb.expert_grads_in_dtype = true;
  GroupConfig gc = group_for(c, 8);
  auto g32 = Group::create_simulated(1, gc);
  auto g16 = Group::create_simulated(1, gc);
  MoELayer l32(g32[0], c), l16(g16[0], cb);
  l32.init_params(4, 0.5);
  l16.init_params(4, 0.5);
  EXPECT_EQ(l32.grads().w_in.dtype(), DType::kF32);
  EXPECT_EQ(l16.grads().w_in.dtype(), DType::kBF16);
  EXPECT_EQ(l16.grads().gate.dtype(), DType::kF32) << "replicated parameters keep fp32 gradients";
  Tensor x = normal({8, c.hidden}, c.dtype, 4, 1), d = normal({8, c.hidden}, c.dtype, 4, 2);
  for (auto* L : {&l32, &l16}) {
    Tensor out = Tensor::zeros({8, c.hidden}, c.dtype), dx = Tensor::zeros({8, c.hidden}, c.dtype);
    std::vector<Group>& gs = L == &l32 ? g32 : g16;
    run_ranks(gs, [&](Group&) {
      MoEContext ctx = L->forward(x, out);
      L->backward(ctx, d, dx);
    });
  }
  int nonzero = 0;
  for (auto which : {&MoEParams::w_in, &MoEParams::w_out}) {
    const Tensor& a = l32.grads().*which;
    const Tensor& b = l16.grads().*which;
    for (int64_t i = 0; i < a.numel(); ++i) {
      ASSERT_EQ(b.item(i), round_to_dtype(a.item(i), DType::kBF16)) << "element " << i;
      nonzero += a.item(i) != 0;
    }
  }
  EXPECT_GT(nonzero, 0);
}


// A layer over parameters and gradients held elsewhere (a framework's tensors) computes exactly what
// the layer owning them does, and names any parameter left unbound or bound with the wrong shape.
TEST(MoELayer, ExternalParamStorageMatchesOwned) {
  MoEConfig c = base_config(DType::kF32);
  c.expert_bias_terms = true;
  GroupConfig gc = group_for(c, 8);
  auto go = Group::create_simulated(1, gc);
  auto ge = Group::create_simulated(1, gc);
  MoELayer owned(go[0], c), ext(ge[0], c, ParamStorage::kExternal);
  owned.init_params(9, 0.5);
  ASSERT_EQ(ext.param_specs().size(), owned.param_specs().size());
  std::vector<Tensor> held;  // the "framework's" storage
  for (const ParamSpec& p : ext.param_specs()) {
    EXPECT_FALSE((ext.params().*p.field).defined()) << p.name << ": an external layer allocates nothing";
    Tensor v = (owned.params().*p.field).clone();
    Tensor g = Tensor::full(p.shape, p.grad_dtype, 123.0);  // backward must overwrite it
    held.push_back(v);
    held.push_back(g);
    ext.params().*p.field = Tensor::wrap(v.ref(), nullptr);
    if (p.trained) ext.grads().*p.field = Tensor::wrap(g.ref(), nullptr);
  }
  Tensor x = normal({8, c.hidden}, c.dtype, 9, 1), d = normal({8, c.hidden}, c.dtype, 9, 2);
  Tensor out_o = Tensor::zeros({8, c.hidden}, c.dtype), dx_o = Tensor::zeros({8, c.hidden}, c.dtype);
  Tensor out_e = Tensor::zeros({8, c.hidden}, c.dtype), dx_e = Tensor::zeros({8, c.hidden}, c.dtype);
  run_ranks(go, [&](Group&) {
    MoEContext ctx = owned.forward(x, out_o);
    owned.backward(ctx, d, dx_o);
  });
  run_ranks(ge, [&](Group&) {
    MoEContext ctx = ext.forward(x, out_e);
    ext.backward(ctx, d, dx_e);
  });
  for (int64_t i = 0; i < out_o.numel(); ++i) {
    ASSERT_EQ(out_e.item(i), out_o.item(i)) << "out element " << i;
    ASSERT_EQ(dx_e.item(i), dx_o.item(i)) << "d_x element " << i;
  }
  for (const ParamSpec& p : ext.param_specs()) {
    if (!p.trained) continue;
    const Tensor& a = owned.grads().*p.field;
    const Tensor& b = ext.grads().*p.field;
    for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(b.item(i), a.item(i)) << p.name << " gradient element " << i;
  }

  // Unbound and mis-shaped bindings are named.
  MoELayer bare(ge[0], c, ParamStorage::kExternal);
  run_ranks(ge, [&](Group&) {
    try {
      bare.forward(x, out_e);
      ADD_FAILURE() << "forward with unbound parameters must throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("params().gate is not bound"), std::string::npos) << e.what();
    }
  });
  for (const ParamSpec& p : ext.param_specs()) bare.params().*p.field = ext.params().*p.field;
  bare.params().w_out = Tensor::zeros({1, 2, 3}, c.dtype);
  run_ranks(ge, [&](Group&) {
    try {
      bare.forward(x, out_e);
      ADD_FAILURE() << "forward with a mis-shaped w_out must throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("params().w_out is fp32[1, 2, 3]"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace epx
