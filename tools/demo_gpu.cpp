// `epx demo` on GPUs: a DeepSeek-V3-like layer (by default) trained for a few steps on every local
// GPU, one process per GPU, after one step of a reduced layer was checked against the CPU reference
// (the same parameters, tokens and gradients seeds on both sides).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/moe.h"
#include "epx/presets.h"
#include "moe/elementwise.h"
#include "tools/commands.h"
#include "tools/launch.h"
#include "tools/layer_check.h"
#include "tools/layer_run.h"

namespace epx::tools {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

}  // namespace

int run_demo_gpu(const DemoOptions& o) {
  const auto t0 = Clock::now();
  const bool talk = launcher_rank() == 0;
  const ShapePreset& preset = find_preset(o.preset.empty() ? "deepseek-v3" : o.preset);
  const int64_t T = o.tokens > 0 ? o.tokens : preset.tokens;

  const LayerCheck chk = check_layer_against_reference(preset, o.seed);
  if (talk)
    std::printf("epx demo: reference check (H=256, F=64, E=32, T=64 per rank, one forward+backward): %s\n"
                "  rel. error out %.3g, d_x %.3g, d_w_in %.3g, d_gate %.3g; max |out diff| %.3g; routing agrees on %.0f%% of tokens\n",
                chk.ok ? "ok" : "FAILED", chk.out.rel, chk.d_x.rel, chk.w_in.rel, chk.gate.rel, chk.out.max_abs,
                100 * chk.routing_agreement);

  MoEConfig c = moe_config(preset, DType::kBF16);
  c.expert_grads_in_dtype = true;
  Group group = make_gpu_group(layer_group_config(c, T));
  const int dev = group.device().index;
  LayerRun run(group, c, T, o.seed);
  if (talk)
    std::printf("epx demo: %s on %d GPU%s (%s transport), %lld tokens per rank, hidden %lld, ffn %lld, %d experts "
                "(%d per GPU), top-%d, %d groups keep %d, shared ffn %lld, bf16; %.2f GB registered per rank\n",
                preset.name.c_str(), group.size(), group.size() > 1 ? "s" : "", transport_name(group.transport()),
                static_cast<long long>(T), static_cast<long long>(c.hidden), static_cast<long long>(c.ffn_hidden),
                c.router.num_experts, group.local_experts(), c.router.topk, c.router.num_groups, c.router.group_topk,
                static_cast<long long>(c.shared_ffn_hidden), group.registered_bytes() / 1e9);

  std::vector<double> step_ms, loss;
  std::pair<double, double> aux{0, 0};
  for (int s = 1; s <= o.steps; ++s) {
    const auto s0 = Clock::now();
    loss.push_back(run.train_step(o.lr));
    step_ms.push_back(ms_since(s0));
    aux = run.losses();
    if (talk)
      std::printf("  step %d/%d: loss %.6f (aux %.4g, z %.4g), %.1f ms%s\n", s, o.steps, loss.back(), aux.first,
                  aux.second, step_ms.back(), s == 1 ? " (first step allocates and initialises kernels)" : "");
    std::fflush(stdout);
  }
  group.check();
  std::vector<double> steady(step_ms.begin() + (step_ms.size() > 1 ? 1 : 0), step_ms.end());
  std::sort(steady.begin(), steady.end());
  const double median = steady[steady.size() / 2];
  const double mem = static_cast<double>(detail::device_memory_used(dev));
  if (talk)
    std::printf("{\"backend\":\"cuda\",\"ranks\":%d,\"preset\":\"%s\",\"tokens\":%lld,\"hidden\":%lld,\"ffn_hidden\":%lld,"
                "\"experts\":%d,\"topk\":%d,\"dtype\":\"bf16\",\"steps\":%d,\"loss_first\":%.6g,\"loss_last\":%.6g,"
                "\"aux_loss\":%.6g,\"z_loss\":%.6g,\"step_ms\":%.2f,\"first_step_ms\":%.1f,\"check_ok\":%s,"
                "\"max_abs_err\":%.3g,\"check_rel_err_out\":%.3g,\"check_rel_err_dx\":%.3g,\"check_rel_err_dw_in\":%.3g,"
                "\"check_routing_agreement\":%.3f,\"gpu_mem_used_gb\":%.2f,\"registered_gb\":%.3f,\"wall_ms\":%.0f}\n",
                group.size(), preset.name.c_str(), static_cast<long long>(T), static_cast<long long>(c.hidden),
                static_cast<long long>(c.ffn_hidden), c.router.num_experts, c.router.topk, o.steps, loss.front(),
                loss.back(), aux.first, aux.second, median, step_ms.front(), chk.ok ? "true" : "false",
                chk.out.max_abs, chk.out.rel, chk.d_x.rel, chk.w_in.rel, chk.routing_agreement, mem / 1e9,
                group.registered_bytes() / 1e9, ms_since(t0));
  return chk.ok ? 0 : 3;
}

}  // namespace epx::tools
