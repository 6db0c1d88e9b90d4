// The MoE layer over one process per GPU against R simulated ranks of the CPU reference (the same
// check `epx demo` runs before training), and a few training steps whose loss must go down.
#include <gtest/gtest.h>

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

TEST(MoELayerMultiProcess, TrainingStepsLowerTheLoss) {
  EPX_REQUIRE_LAYER_LAUNCH();
  MoEConfig c = moe_config(find_preset("small"), DType::kBF16);
  c.hidden = 256;
  c.ffn_hidden = 128;
  c.shared_ffn_hidden = 128;
  c.router.num_experts = 32;
  c.expert_grads_in_dtype = true;
  Group g = tools::make_gpu_group(tools::layer_group_config(c, 512));
  tools::LayerRun run(g, c, 512, 3);
  const double first = run.train_step(0.5);
  double last = first;
  for (int i = 0; i < 4; ++i) last = run.train_step(0.5);
  g.check();
  EXPECT_LT(last, first) << "loss did not decrease over 5 SGD steps: " << first << " -> " << last;
}

}  // namespace
}  // namespace epx
