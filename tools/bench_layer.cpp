// `epx bench layer`: the MoE layer's forward and forward+backward time on every local GPU (one
// process per GPU), with the tensor-core floor of its expert GEMMs measured in the same run (dense
// bf16 GEMM FLOP/s on this GPU) and the GPU memory in use, as JSON lines (rank 0 prints).
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "core/version.h"
#include "epx/grouped_gemm.h"
#include "epx/moe.h"
#include "epx/presets.h"
#include "moe/elementwise.h"
#include "tools/args.h"
#include "tools/commands.h"
#include "tools/launch.h"
#include "tools/layer_run.h"

namespace epx::tools {
namespace {

using Clock = std::chrono::steady_clock;

// Mean time of fn over iters calls, after one warm-up call, synchronising only at the ends.
template <class F>
double time_us(int device, int iters, F&& fn) {
  fn();
  detail::device_synchronize(device);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  detail::device_synchronize(device);
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
}

// Dense bf16 GEMM FLOP/s at a large square shape: the tensor-core rate the floor is measured against.
double dense_bf16_flops(Device dev) {
  const int64_t n = 8192;
  Tensor a = Tensor::empty({n, n}, DType::kBF16, dev), b = Tensor::empty({n, n}, DType::kBF16, dev);
  Tensor c = Tensor::empty({n, n}, DType::kBF16, dev);
  detail::fill_normal(a, 5, 1, 1.0);
  detail::fill_normal(b, 5, 2, 1.0);
  const double us = time_us(dev.index, 20, [&] { gemm(a, b, c); });
  return 2.0 * n * n * n / (us * 1e-6);
}

struct LayerBenchOptions {
  MlpPrecision precision = MlpPrecision::kHigh;
  bool fp8_weight_cache = false;
  int sms = 0;  // GroupConfig::num_sms
  int align = 16;  // GroupConfig::align: 128 lets the expert GEMMs run over contiguous 128-row blocks
  int chunks = 1;  // MoEConfig::pipeline_chunks
  bool overlap = false;  // MoEConfig::overlap_communication
  bool fp32_expert_grads = false;
  bool weight_grads_in_ffn = true;  // MoEConfig::weight_grads_in_ffn
};

int bench_layer_rank(const std::vector<std::string>& presets, long long tokens, int iters, const LayerBenchOptions& o) {
  const MlpPrecision precision = o.precision;
  const bool fp8_weight_cache = o.fp8_weight_cache;
  const bool talk = launcher_rank() == 0;
  for (const std::string& name : presets) {
    const ShapePreset& p = find_preset(name);
    const int64_t T = tokens > 0 ? tokens : p.tokens;
    MoEConfig c = moe_config(p, DType::kBF16);
    c.expert_grads_in_dtype = !o.fp32_expert_grads;  // bf16 weight gradients, as a bf16 PyTorch model keeps them
    c.pipeline_chunks = o.chunks;
    c.overlap_communication = o.overlap;
    c.precision = precision;
    c.fp8_weight_cache = fp8_weight_cache;
    c.weight_grads_in_ffn = o.weight_grads_in_ffn;
    GroupConfig gc = layer_group_config(c, T);
    gc.num_sms = o.sms;
    gc.align = o.align;
    Group group = make_gpu_group(gc);
    const int dev = group.device().index;
    const size_t used_before_layer = detail::device_memory_used(dev);
    const double dense = dense_bf16_flops(group.device());
    LayerRun run(group, c, T, 1);
    run.forward_backward();  // allocations and kernel initialisation
    const double fwd = time_us(dev, iters, [&] { run.forward(); });
    const double fwd_bwd = time_us(dev, iters, [&] { run.forward_backward(); });
    group.check();
    std::string phases = "{}";
    if (detail::profiling_enabled()) {  // a separate pass: the events must not disturb the timings above
      detail::phase_report();
      for (int i = 0; i < iters; ++i) run.forward_backward();
      phases = detail::phase_report();
    }
    const double mem = static_cast<double>(detail::device_memory_used(dev));
    const double flops = 3.0 * run.forward_gemm_flops();  // forward + dgrad + wgrad
    const double floor_us = flops / dense * 1e6;
    if (talk)
      std::printf("{\"bench\":\"layer\",\"impl\":\"epx\",\"preset\":\"%s\",\"precision\":\"%s\","
                  "\"fp8_weight_cache\":%s,\"sm_budget\":%d,\"align\":%d,\"chunks\":%d,\"overlap\":%s,"
                  "\"expert_grads\":\"%s\",\"weight_grads\":\"%s\",\"ranks\":%d,\"tokens\":%lld,\"hidden\":%lld,"
                  "\"ffn\":%lld,\"shared_ffn\":%lld,\"experts\":%d,\"topk\":%d,\"transport\":\"%s\",\"fwd_us\":%.1f,"
                  "\"fwd_bwd_us\":%.1f,\"expert_gemm_tflop_fwd_bwd\":%.3f,\"dense_bf16_tflops\":%.1f,"
                  "\"tensor_core_floor_us\":%.1f,\"fwd_bwd_over_floor\":%.3f,\"achieved_tflops_fwd_bwd\":%.1f,"
                  "\"gpu_mem_used_gb\":%.2f,\"gpu_mem_layer_gb\":%.2f,\"registered_gb\":%.3f,\"iters\":%d,"
                  "\"phases_ms_total\":%s}\n",
                  p.name.c_str(), mlp_precision_name(precision), fp8_weight_cache ? "true" : "false", o.sms, o.align,
                  o.chunks, o.overlap ? "true" : "false", dtype_name(run.layer().grads().w_in.dtype()),
                  o.weight_grads_in_ffn ? "ffn" : "combine", group.size(),
                  static_cast<long long>(T), static_cast<long long>(c.hidden),
                  static_cast<long long>(c.ffn_hidden), static_cast<long long>(c.shared_ffn_hidden),
                  c.router.num_experts, c.router.topk, transport_name(group.transport()), fwd, fwd_bwd, flops / 1e12,
                  dense / 1e12, floor_us, fwd_bwd / floor_us, flops / (fwd_bwd * 1e-6) / 1e12, mem / 1e9,
                  (mem - static_cast<double>(used_before_layer)) / 1e9, group.registered_bytes() / 1e9, iters,
                  phases.c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int run_bench(const std::vector<std::string>& argv) {
  const std::string what = argv.empty() ? "help" : argv[0];
  const std::vector<std::string> rest(argv.begin() + (argv.empty() ? 0 : 1), argv.end());
  if (what != "layer") {
    std::printf("usage: epx bench layer [--preset deepseek-v3,mixtral] [--tokens T] [--iters N] [--ranks N]\n"
                "                       [--precision high|fp8_block|mxfp8] [--fp8-weight-cache 0|1]\n"
                "                       [--sms N] [--align 16|128] [--chunks N] [--overlap 0|1]\n"
                "                       [--fp32-expert-grads 0|1] [--weight-grads ffn|combine]\n"
                "  the MoE layer forward and forward+backward on every local GPU (one process per GPU), with\n"
                "  the tensor-core floor of its expert GEMMs and the GPU memory in use; JSON lines. fp8_block\n"
                "  runs the expert GEMMs' forward in FP8 (DeepSeek-V3 block scales; backward in bf16); with the\n"
                "  weight cache the FP8 weights are made once (as between two optimizer steps), not per forward;\n"
                "  --sms N gives the EP kernels a budget of N SMs (GroupConfig::num_sms; default 0: none);\n"
                "  --align pads each expert's rows to a multiple (default 16; 128 runs the expert GEMMs over\n"
                "  contiguous 128-row blocks, at the price of more padding rows); --chunks N pipelines N token\n"
                "  chunks through dispatch, expert FFNs and combine, and --overlap 1 runs the collectives on a\n"
                "  stream of their own beside the FFNs (with --sms, the GEMMs keep SMs); expert weight gradients\n"
                "  are bf16 unless --fp32-expert-grads 1; --weight-grads combine takes the row weights' gradient\n"
                "  in combine_backward against y instead of through FC2 (MoEConfig::weight_grads_in_ffn)\n");
    return what == "help" || what == "--help" ? 0 : 2;
  }
  Args args("epx bench layer", rest,
            {"preset", "tokens", "iters", "ranks", "precision", "fp8-weight-cache", "sms", "align", "chunks", "overlap",
             "fp32-expert-grads", "weight-grads"},
            {});
  const BuildInfo build = build_info();
  const int gpus = detail::cuda_device_count();
  require_status(build.cuda_backend && build.gpu_grouped_gemm && gpus > 0, Status::kNotSupported, "epx bench layer",
                 "needs a GPU and a build with the CUDA backend and the CUTLASS grouped GEMMs (",
                 gpus, " GPU(s) visible, CUDA backend ", build.cuda_backend ? "on" : "off", ", grouped GEMMs ",
                 build.gpu_grouped_gemm ? "on" : "off", ")");
  const std::vector<std::string> presets = split_list(args.str("preset", "deepseek-v3,mixtral"));
  const long long tokens = args.integer("tokens", 0);
  const int iters = static_cast<int>(args.integer("iters", 10));
  require(iters >= 1 && tokens >= 0, "epx bench layer", "--iters must be >= 1 and --tokens >= 0");
  const std::string prec = args.str("precision", "high");
  require(prec == "high" || prec == "fp8_block" || prec == "mxfp8", "epx bench layer", "--precision is \"", prec,
          "\", expected high, fp8_block or mxfp8");
  LayerBenchOptions o;
  o.precision = prec == "high"        ? MlpPrecision::kHigh
                : prec == "fp8_block" ? MlpPrecision::kFp8Block
                                      : MlpPrecision::kMxfp8;
  o.fp8_weight_cache = args.integer("fp8-weight-cache", 0) != 0;
  o.sms = static_cast<int>(args.integer("sms", 0));
  require(o.sms >= 0, "epx bench layer", "--sms is ", o.sms, ", expected >= 0 (0 = no budget)");
  o.align = static_cast<int>(args.integer("align", 16));
  require(o.align == 16 || o.align == 128, "epx bench layer", "--align is ", o.align, ", expected 16 or 128");
  o.chunks = static_cast<int>(args.integer("chunks", 1));
  require(o.chunks >= 1 && o.chunks <= MoEConfig::kMaxPipelineChunks, "epx bench layer", "--chunks is ", o.chunks,
          ", expected 1..", MoEConfig::kMaxPipelineChunks);
  o.overlap = args.integer("overlap", 0) != 0;
  o.fp32_expert_grads = args.integer("fp32-expert-grads", 0) != 0;
  const std::string wg = args.str("weight-grads", "ffn");
  require(wg == "ffn" || wg == "combine", "epx bench layer", "--weight-grads is \"", wg, "\", expected ffn or combine");
  o.weight_grads_in_ffn = wg == "ffn";
  return run_on_local_gpus("bench", static_cast<int>(args.integer("ranks", gpus)), gpus, argv,
                           [&] { return bench_layer_rank(presets, tokens, iters, o); });
}

}  // namespace epx::tools
