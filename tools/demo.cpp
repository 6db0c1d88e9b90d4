// `epx demo`: a few training steps of one MoE layer (forward, backward, SGD on a synthetic
// regression target) over an EP group, printing a line per step and, last, one JSON object.
//
// With GPUs (and the CUDA backend with its grouped GEMMs) the demo runs one process per GPU, see
// demo_gpu.cpp. Without, the group is R simulated ranks of the CPU reference (threads sharing host
// windows).
// Before training, the same layer on ONE rank, fed the concatenation of every rank's tokens, must
// give the same outputs: the demo reports that difference as ranks_vs_single_max_err.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "epx/comm.h"
#include "epx/moe.h"
#include "epx/presets.h"
#include "moe/elementwise.h"
#include "core/version.h"
#include "tools/args.h"
#include "tools/commands.h"
#include "tools/launch.h"
#include "tools/layer_run.h"

namespace epx::tools {
namespace {

Tensor host_normal(int64_t rows, int64_t cols, DType dt, uint64_t seed, uint64_t stream, double scale) {
  Tensor t = Tensor::empty({rows, cols}, dt);
  detail::fill_normal(t, seed, stream, scale);
  return t;
}

double sum_squares(const Tensor& t) {
  if (!t.defined()) return 0;
  Tensor h = t.to(Device::cpu());
  double s = 0;
  for (int64_t i = 0; i < h.numel(); ++i) s += h.item(i) * h.item(i);
  return s;
}

// p -= lr * g, through the host (a demo needs no optimizer kernel).
void sgd(const Tensor& p, const Tensor& g, double lr) {
  if (!p.defined()) return;
  Tensor ph = p.to(Device::cpu()), gh = g.to(Device::cpu());
  for (int64_t i = 0; i < ph.numel(); ++i) store_from_double(ph.data(), ph.dtype(), i, ph.item(i) - lr * gh.item(i));
  copy(ph, p);
}

}  // namespace

int run_demo(const std::vector<std::string>& argv) {
  Args args("epx demo", argv, {"ranks", "preset", "tokens", "steps", "seed", "lr"}, {"help", "cpu"});
  if (args.flag("help")) {
    std::printf("usage: epx demo [--ranks N] [--preset NAME] [--tokens T] [--steps S] [--seed N] [--lr X] [--cpu]\n"
                "  with GPUs: one process per GPU (N = every visible GPU), preset 'deepseek-v3', 4096 tokens\n"
                "    per GPU, 5 training steps, after one step of a reduced layer is checked against the CPU\n"
                "    reference (exit code 3 if it disagrees)\n"
                "  without a GPU (or with --cpu): N simulated ranks (default 4) of the CPU reference, preset 'small'\n");
    return 0;
  }
  const BuildInfo build = build_info();
  const int gpus = detail::cuda_device_count();
  const bool gpu = !args.flag("cpu") && build.cuda_backend && build.gpu_grouped_gemm && gpus > 0;
  if (gpu) {
    DemoOptions o;
    o.preset = args.str("preset", "");
    o.tokens = args.integer("tokens", 0);
    o.steps = static_cast<int>(args.integer("steps", 5));
    o.seed = static_cast<uint64_t>(args.integer("seed", 1));
    o.lr = std::stod(args.str("lr", "0.02"));
    require(o.steps >= 1 && o.tokens >= 0, "epx demo", "--steps must be >= 1 and --tokens >= 1");
    return run_on_local_gpus("demo", static_cast<int>(args.integer("ranks", gpus)), gpus, argv,
                             [&] { return run_demo_gpu(o); });
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int R = static_cast<int>(args.integer("ranks", 4));
  const ShapePreset& preset = find_preset(args.str("preset", "small"));
  const int64_t T = args.integer("tokens", preset.tokens);
  const int steps = static_cast<int>(args.integer("steps", 3));
  const uint64_t seed = static_cast<uint64_t>(args.integer("seed", 1));
  const double lr = std::stod(args.str("lr", "0.5"));
  require(R >= 1 && T >= 1 && steps >= 1, "epx demo", "--ranks, --tokens and --steps must be >= 1");
  const DType dt = DType::kF32;
  const MoEConfig mc = moe_config(preset, dt);
  const int64_t H = mc.hidden;

  const char* why = args.flag("cpu")           ? "--cpu"
                    : !build.cuda_backend       ? "built without CUDA"
                    : gpus == 0                 ? "no GPU visible"
                                                : "built without the CUTLASS grouped GEMMs";
  std::printf("epx demo: backend cpu-reference (%s), %d simulated ranks, preset %s (%s)\n", why, R, preset.name.c_str(),
              preset.description.c_str());
  std::printf("  tokens/rank %lld, hidden %lld, ffn %lld, experts %d, top-%d, groups %d keep %d, shared ffn %lld, %s\n",
              static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(mc.ffn_hidden), preset.experts,
              preset.topk, preset.groups, preset.group_topk, static_cast<long long>(mc.shared_ffn_hidden), dtype_name(dt));

  std::vector<Group> groups = Group::create_simulated(R, layer_group_config(mc, T));
  std::vector<std::unique_ptr<MoELayer>> layers(R);
  std::vector<Tensor> x(R), target(R), out(R);
  for (int r = 0; r < R; ++r) {
    layers[r] = std::make_unique<MoELayer>(groups[r], mc);
    layers[r]->init_params(seed, 0.1);
    x[r] = host_normal(T, H, dt, seed, 10 + r, 1.0);
    target[r] = host_normal(T, H, dt, seed, 100 + r, 0.1);
    out[r] = Tensor::zeros({T, H}, dt);
  }

  // Consistency: the R-rank layer against one rank holding every expert and every token.
  double single_err = 0;
  {
    std::vector<Group> one = Group::create_simulated(1, layer_group_config(mc, T * R));
    MoELayer single(one[0], mc);
    single.init_params(seed, 0.1);
    Tensor xa = Tensor::empty({T * R, H}, dt), oa = Tensor::zeros({T * R, H}, dt);
    for (int r = 0; r < R; ++r) copy(x[r], xa.ref().slice_rows(r * T, (r + 1) * T));
    run_ranks(one, [&](Group&) { single.forward(xa, oa); });
    run_ranks(groups, [&](Group& g) { layers[g.rank()]->forward(x[g.rank()], out[g.rank()]); });
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < T * H; ++i)
        single_err = std::max(single_err, std::fabs(out[r].item(i) - oa.item(r * T * H + i)));
    std::printf("  %d ranks vs 1 rank on the same tokens: max |out difference| = %.3g\n", R, single_err);
  }

  double first_loss = 0, last_loss = 0, aux = 0, z = 0, step_ms = 0;
  double gn_gate = 0, gn_in = 0, gn_out = 0;
  for (int step = 1; step <= steps; ++step) {
    const auto s0 = std::chrono::steady_clock::now();
    std::vector<double> mse(R);
    std::vector<Tensor> losses(R);
    gn_gate = gn_in = gn_out = 0;
    std::mutex mu;
    run_ranks(groups, [&](Group& g) {
      const int r = g.rank();
      MoELayer& L = *layers[r];
      MoEContext ctx = L.forward(x[r], out[r]);
      Tensor d_out = Tensor::empty({T, H}, dt);
      double local = 0;
      const double n = static_cast<double>(T * H * R);
      for (int64_t i = 0; i < T * H; ++i) {
        const double d = out[r].item(i) - target[r].item(i);
        local += 0.5 * d * d / n;
        store_from_double(d_out.data(), dt, i, d / n);
      }
      Tensor x_grad = Tensor::empty({T, H}, dt);
      L.backward(ctx, d_out, x_grad);
      // Replicated parameters: sum their gradients over the ranks, as data parallelism would.
      all_reduce_sum(g, L.grads().gate.ref().view({L.grads().gate.numel()}));
      if (L.grads().shared_w_in.defined()) {
        all_reduce_sum(g, L.grads().shared_w_in.ref().view({L.grads().shared_w_in.numel()}));
        all_reduce_sum(g, L.grads().shared_w_out.ref().view({L.grads().shared_w_out.numel()}));
      }
      const double gi = sum_squares(L.grads().w_in), go = sum_squares(L.grads().w_out);
      {
        std::lock_guard<std::mutex> lk(mu);
        gn_in += gi;
        gn_out += go;
        if (r == 0) gn_gate = sum_squares(L.grads().gate);
      }
      mse[r] = local;
      losses[r] = ctx.losses().to(Device::cpu());
      MoEParams& p = L.params();
      const MoEParams& gr = L.grads();
      sgd(p.gate, gr.gate, lr);
      sgd(p.w_in, gr.w_in, lr);
      sgd(p.w_out, gr.w_out, lr);
      sgd(p.shared_w_in, gr.shared_w_in, lr);
      sgd(p.shared_w_out, gr.shared_w_out, lr);
    });
    double total_mse = 0;
    for (double m : mse) total_mse += m;
    aux = losses[0].item(0);
    z = losses[0].item(1);
    const double loss = total_mse + aux + z;
    if (step == 1) first_loss = loss;
    last_loss = loss;
    step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
    std::printf("  step %d/%d: loss %.6f (mse %.6f, aux %.6f, z %.6f), grad norms gate %.4g w_in %.4g w_out %.4g, %.1f ms\n",
                step, steps, loss, total_mse, aux, z, std::sqrt(gn_gate), std::sqrt(gn_in), std::sqrt(gn_out), step_ms);
  }
  // fp32 layer: only the order of the combine's sum may differ between R ranks and one rank
  const bool check_ok = single_err <= 1e-5;
  const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"backend\":\"cpu-reference\",\"ranks\":%d,\"preset\":\"%s\",\"tokens\":%lld,\"hidden\":%lld,"
              "\"ffn_hidden\":%lld,\"experts\":%d,\"topk\":%d,\"dtype\":\"%s\",\"steps\":%d,\"loss_first\":%.6g,"
              "\"loss_last\":%.6g,\"aux_loss\":%.6g,\"z_loss\":%.6g,\"grad_norm_gate\":%.6g,\"grad_norm_w_in\":%.6g,"
              "\"grad_norm_w_out\":%.6g,\"ranks_vs_single_max_err\":%.3g,\"check_ok\":%s,\"step_ms\":%.2f,"
              "\"wall_ms\":%.1f}\n",
              R, preset.name.c_str(), static_cast<long long>(T), static_cast<long long>(H),
              static_cast<long long>(mc.ffn_hidden), preset.experts, preset.topk, dtype_name(dt), steps, first_loss,
              last_loss, aux, z, std::sqrt(gn_gate), std::sqrt(gn_in), std::sqrt(gn_out), single_err, check_ok ? "true" : "false", step_ms,
              wall);
  return check_ok ? 0 : 3;
}

}  // namespace epx::tools
