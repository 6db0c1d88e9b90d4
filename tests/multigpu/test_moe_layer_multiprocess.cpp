// The MoE layer over one process per GPU against R simulated ranks of the CPU reference (the same
// check `epx demo` runs before training), and a few training steps whose loss must go down.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/version.h"
#include "epx/presets.h"
#include "tools/launch.h"
#include "tools/layer_check.h"
#include "tools/layer_run.h"

namespace epx {
namespace {

#define EPX_REQUIRE_LAYER_LAUNCH()                                                                      \
  do {                                                                                                  \
    if (!tools::started_by_launcher()) GTEST_SKIP() << "not started by a launcher (RANK/WORLD_SIZE unset): use scripts/run_ranks.sh"; \
    if (!build_info().gpu_grouped_gemm) GTEST_SKIP() << "built without the CUTLASS grouped GEMMs";      \
  } while (0)

TEST(MoELayerMultiProcess, MatchesReference) {
  EPX_REQUIRE_LAYER_LAUNCH();
  for (const char* preset : {"deepseek-v3", "mixtral"}) {
    const tools::LayerCheck c = tools::check_layer_against_reference(find_preset(preset), 7);
    EXPECT_TRUE(c.ok) << preset << ": rel. error out " << c.out.rel << ", d_x " << c.d_x.rel << ", d_w_in "
                      << c.w_in.rel << ", d_gate " << c.gate.rel << ", routing agreement " << c.routing_agreement;
    EXPECT_GE(c.routing_agreement, 0.9) << preset;
    EXPECT_LT(c.out.rel, 5e-2) << preset;
  }
}

// The FP8 forwards across ranks (DeepSeek-V3 blocks, MXFP8): tokens quantized at the source,
// dispatched as fp8 with their scales, FP8 expert GEMMs, and the backward from the dequantized rows.
TEST(MoELayerMultiProcess, Fp8ForwardMatchesReference) {
  EPX_REQUIRE_LAYER_LAUNCH();
  for (MlpPrecision prec : {MlpPrecision::kFp8Block, MlpPrecision::kMxfp8})
    for (const char* preset : {"deepseek-v3", "mixtral"}) {
      const tools::LayerCheck c = tools::check_layer_against_reference(find_preset(preset), 7, prec);
      EXPECT_TRUE(c.ok) << preset << ", " << mlp_precision_name(prec) << ": rel. error out " << c.out.rel << ", d_x "
                        << c.d_x.rel << ", d_w_in " << c.w_in.rel << ", d_gate " << c.gate.rel
                        << ", routing agreement " << c.routing_agreement;
    }
}

// A layer small enough to train a few steps in a test: bf16, 32 experts, a shared expert.
MoEConfig small_test_layer() {
  MoEConfig c = moe_config(find_preset("small"), DType::kBF16);
  c.hidden = 256;
  c.ffn_hidden = 128;
  c.shared_ffn_hidden = 128;
  c.router.num_experts = 32;
  return c;
}

TEST(MoELayerMultiProcess, TrainingStepsLowerTheLoss) {
  EPX_REQUIRE_LAYER_LAUNCH();
  MoEConfig c = small_test_layer();
  c.expert_grads_in_dtype = true;
  Group g = tools::make_gpu_group(tools::layer_group_config(c, 512));
  tools::LayerRun run(g, c, 512, 3);
  const double first = run.train_step(0.5);
  double last = first;
  for (int i = 0; i < 4; ++i) last = run.train_step(0.5);
  g.check();
  EXPECT_LT(last, first) << "loss did not decrease over 5 SGD steps: " << first << " -> " << last;
}

// The pipelined layer across ranks (3 uneven chunks, collectives on the layer's own stream with an
// SM budget) against the plain one on the same group: outputs and input gradients bit for bit,
// expert weight gradients within the rounding of fp32 sums taken in another order (the bound of
// MoELayerGpu.PipelineChunksMatchOneChunk: 2^-12 of the value plus a twentieth of the largest).
TEST(MoELayerMultiProcess, PipelineChunksMatchOneChunk) {
  EPX_REQUIRE_LAYER_LAUNCH();
  const MoEConfig one = small_test_layer();
  ASSERT_FALSE(one.expert_grads_in_dtype) << "the tolerance below is for fp32 expert gradients";
  MoEConfig many = one;
  many.pipeline_chunks = 3;
  many.overlap_communication = true;
  const int64_t T = 500;
  GroupConfig gc = tools::layer_group_config(one, T);
  gc.num_sms = 24;
  Group g = tools::make_gpu_group(gc);
  tools::LayerRun a(g, one, T, 5), b(g, many, T, 5);
  a.forward_backward();
  b.forward_backward();
  g.check();
  auto same_bits = [](const Tensor& x, const Tensor& y) {
    const Tensor hx = x.to(Device::cpu()), hy = y.to(Device::cpu());
    return hx.nbytes() == hy.nbytes() && std::memcmp(hx.data(), hy.data(), hx.nbytes()) == 0;
  };
  EXPECT_TRUE(same_bits(a.out(), b.out())) << "out, rank " << g.rank();
  EXPECT_TRUE(same_bits(a.d_x(), b.d_x())) << "d_x, rank " << g.rank();
  EXPECT_EQ(b.context().num_chunks(), 3);
  for (auto which : {&MoEParams::w_in, &MoEParams::w_out}) {
    const Tensor ga = (a.layer().grads().*which).to(Device::cpu()), gb = (b.layer().grads().*which).to(Device::cpu());
    ASSERT_EQ(ga.numel(), gb.numel());
    int64_t bad = 0, nonzero = 0;
    double top = 0;
    for (int64_t i = 0; i < ga.numel(); ++i) top = std::max(top, std::abs(ga.item(i)));
    for (int64_t i = 0; i < ga.numel(); ++i) {
      const double want = ga.item(i), have = gb.item(i);
      bad += std::abs(have - want) > 0x1p-12 * (std::abs(want) + 0.05 * top);  // fp32 gradients
      nonzero += want != 0;
    }
    EXPECT_EQ(bad, 0) << "expert gradient, rank " << g.rank();
    EXPECT_GT(nonzero, 0) << "rank " << g.rank();
  }
}

}  // namespace
}  // namespace epx
