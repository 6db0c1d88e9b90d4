// Router benchmark: route_forward for the two target routers at T = 16384, E = 256, K = 8 --
// (a) softmax + top-8 and (b) DeepSeek-V3's sigmoid + bias + 8 groups keep 4 + top-8 + normalise
// + scale 2.5 -- with their statistics (prob_sum, scalars) in the same pass and without, in fp32
// and bf16, then E = 64 / 512, sequence-level statistics, route_backward and the two small ops.
//
// One JSON line per measurement: the shape, the median time per call in microseconds from
// epx::bench::time_us with the inputs rotated (rotation_for) so that L2 does not serve them,
// the bytes counted (logits read + outputs written; the backward also reads ids and weight
// gradients), the achieved GB/s and its fraction of the HBM bandwidth measured in the same run.
// "us" times a CUDA graph of one call per rotated input (launch gaps removed), "us_stream" the
// same calls launched one by one on a stream. Runs in a few seconds.
//
// Options select forward cases (for a profiler, or a quick A/B): --case NAME (e.g. softmax_top8),
// --dtype fp32|bf16, --stats 0|1|2, --kernel auto|split|lean|wide|fast|fast1|legacy, --rows random|separated. With
// any of them given, only the matching route_forward lines run (no backward, no small ops). "separated"
// rows (host_separated) leave the kernels' exact fallback nothing to do; the line says "rows".
//
// route_forward is timed with each kernel, so one GPU run can choose on evidence (the default,
// "auto", picks split, lean or wide from these lines, and is timed too): "split" = a token over E / 64
// lanes, top-8 by sorting networks, fp32 logits with E in {128, 256, 512}, K <= 8; "wide" = two tokens
// per warp with fast exponentials, where the shape allows, else fast1; "lean" = one token per warp, no
// max subtraction, fp32 logits with E in {128, 256, 512} only; "fast1" = the bit-exact fast kernel
// with one token per warp; "fast" = two tokens per warp where the shape allows; "legacy" = the earlier
// kernel.
//
// Prediction for "lean" (2026-11-24, before any GPU run; from SASS of the token loop, fast path):
// ~283 warp instructions per token at softmax top-8 with statistics (wide: 428 under ncu) and
// ~480 at DeepSeek-V3 (wide: 710), with 24 resident warps per SM instead of 14-16 and rows staged
// four deep in shared memory. Same issue efficiency as wide would give ~13 / ~19 us; the 10 us
// target needs ~60% of the issue slots busy at softmax (wide: 37-44%) and is not expected at
// DeepSeek-V3.
//
// Prediction for "wide" (2026-11-22, before any GPU run; from an Nsight Compute profile of fast1:
// 689 warp instructions per token at softmax top-8, 44% issue utilisation, 168K local-memory spill
// requests, 24.8 us): ~19 instructions per element (ex2.approx exponentials, composite-key top-3)
// and ~130 per token pair of half-warp steps, ~220 per token, so ~4-5 us of issue at 65% utilisation
// plus ~3 us of statistics tail and launch: 8-10 us for softmax top-8, 11-14 us for DeepSeek-V3
// (sigmoid, z-loss exponentials, groups).
//
// Prediction for the fast kernels (written before any run, from SASS instruction counts of the
// hot path, no GPU where this was written): ~400 warp instructions per token for softmax top-8
// with statistics and ~450 for DeepSeek-V3 with two tokens per warp (~520 / ~600 with one), against
// ~800+ for the legacy kernel; issue-bound at 132 SMs x 4 schedulers that is ~6-7 us plus ~1 us of
// launch and tail, so ~8-10 us for both targets (legacy measured 31.4 / 50.8 us).
//
// Prediction written before any run (no GPU where this was written). Floor: 16.8 MB of fp32
// logits + 1 MB of outputs at ~4.3 TB/s = ~4.2 us. The kernel is issue-bound, not memory-bound:
// ~400 warp instructions per token for softmax top-8 and ~550 for the DeepSeek-V3 router with its
// statistics (exp for the logsumexp, sigmoid, groups), 124 tokens per SM, so ~7-9 us and ~9-12 us
// on an H200 (40-55% / 35-45% of HBM); bf16 about the same (same arithmetic, half the bytes);
// E = 64 latency-bound at a few us, E = 512 about twice E = 256. Backward ~1.5x the forward bytes.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/device_memory.h"
#include "cuda/router/router.h"
#include "epx/error.h"
#include "epx/router.h"
#include "epx/tensor.h"

namespace {

using epx::DType;
using epx::Device;
using epx::RouterConfig;
using epx::RouterStats;
using epx::ScoreFunction;
using epx::Stream;
using epx::Tensor;
using epx::TensorRef;

struct Case {
  std::string name;
  int E = 256, K = 8;
  ScoreFunction f = ScoreFunction::kSoftmax;
  int G = 1, gk = 1;
  bool bias = false, normalize = false;
  float scale = 1.0f;
  DType dt = DType::kF32;
  int stats = 1;  // 0: none, 1: global aux + z, 2: sequence aux (seq_len 4096) + z
  int64_t T = 16384;
  double target_us = 0;  // 0: no target
  bool separated = false;  // rows whose top 16 sit in distinct lanes, well apart (see host_separated)
};

RouterConfig config_of(const Case& k) {
  RouterConfig c;
  c.num_experts = k.E;
  c.topk = k.K;
  c.score_function = k.f;
  c.num_groups = k.G;
  c.group_topk = k.gk;
  c.use_expert_bias = k.bias;
  c.normalize_weights = k.normalize;
  c.routed_scaling_factor = k.scale;
  if (k.stats == 1) c.aux_loss = epx::AuxLossType::kGlobalBatch;
  if (k.stats == 2) {
    c.aux_loss = epx::AuxLossType::kSequence;
    c.seq_len = 4096;
  }
  c.aux_loss_coeff = k.stats ? 1e-3f : 0.0f;
  c.z_loss_coeff = k.stats ? 1e-3f : 0.0f;
  return c;
}

// A host tensor copied to a device (the tests' to_gpu lives with GoogleTest).
Tensor to_device(const Tensor& h, Device dev) {
  Tensor t = Tensor::empty(h.shape(), h.dtype(), dev);
  epx::copy(h, t);
  return t;
}

const char* stats_name(int s) { return s == 0 ? "none" : s == 1 ? "global+z" : "sequence+z"; }

Tensor host_random(epx::Shape shape, DType dt, uint64_t seed, double lo, double hi, bool normal) {
  Tensor h = Tensor::empty(shape, dt);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::uniform_real_distribution<float> ud(static_cast<float>(lo), static_cast<float>(hi));
  std::vector<float> v(static_cast<size_t>(h.numel()));
  for (float& x : v) x = normal ? nd(rng) : ud(rng);
  epx::store_row(h.data(), dt, 0, h.numel(), v.data());
  return h;
}

// Logits [T, E] whose 16 largest values per row sit in 16 distinct lanes of the one-token-per-warp
// layout (lane l holds experts [E / 32 l, E / 32 (l + 1))), 0.1 apart from 4.0 down, over normal(0, 1)
// values clipped below 2 (with a zero expert bias): rows that no fast kernel sends to its exact
// fallback (no near ties, no lane holding more than one of the top picks), to time the kernels
// without the fallback's rows.
Tensor host_separated(int64_t T, int E, DType dt, uint64_t seed) {
  Tensor h = Tensor::empty({T, E}, dt);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int V = std::max(1, E / 32), lanes = E / V;
  std::vector<float> v(static_cast<size_t>(E));
  std::vector<int> order(static_cast<size_t>(lanes));
  for (int64_t t = 0; t < T; ++t) {
    for (float& x : v) x = std::min(nd(rng), 1.9f);
    for (int l = 0; l < lanes; ++l) order[static_cast<size_t>(l)] = l;
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < std::min(16, lanes); ++k) {
      const int e = order[static_cast<size_t>(k)] * V + static_cast<int>(rng() % static_cast<uint64_t>(V));
      v[static_cast<size_t>(e)] = 4.0f - 0.1f * static_cast<float>(k);
    }
    epx::store_row(h.data(), dt, t * E, E, v.data());
  }
  return h;
}

// Times fn(i) for i over the rotation: as a graph of one call per input, and call by call.
struct Timing {
  double graph_us, stream_us;
};

Timing time_rotated(int nrot, const std::function<void(int, Stream)>& fn) {
  cudaStream_t s = nullptr;
  EPX_CUDA_CHECK(cudaStreamCreate(&s));  // blocking: ordered with time_us's events on stream 0
  for (int i = 0; i < nrot; ++i) fn(i, Stream{s});  // warm-up, and the stream's scratch outside capture
  EPX_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPX_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < nrot; ++i) fn(i, Stream{s});
  EPX_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  EPX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double g = epx::bench::time_us([&](int) { EPX_CUDA_CHECK(cudaGraphLaunch(exec, s)); }, 5, 7, 2) / nrot;
  const double st = epx::bench::time_us([&](int i) { fn(i % nrot, Stream{s}); });
  EPX_CUDA_CHECK(cudaStreamSynchronize(s));
  EPX_CUDA_CHECK(cudaGraphExecDestroy(exec));
  EPX_CUDA_CHECK(cudaGraphDestroy(graph));
  EPX_CUDA_CHECK(cudaStreamDestroy(s));
  return {g, st};
}

void report(const char* op, const Case& k, const Timing& tm, double bytes, double hbm, const char* kernel = nullptr) {
  const double gbps = bytes / (tm.graph_us * 1e-6) / 1e9;
  epx::bench::JsonLine j;
  j.add("bench", "router").add("op", op).add("case", k.name).add("score", epx::score_function_name(k.f));
  if (kernel != nullptr) j.add("kernel", kernel);
  j.add("dtype", epx::dtype_name(k.dt)).add("T", static_cast<long long>(k.T)).add("E", k.E).add("K", k.K);
  j.add("groups", k.G).add("group_topk", k.gk).add("bias", k.bias).add("normalize", k.normalize);
  j.add("scale", static_cast<double>(k.scale)).add("stats", stats_name(k.stats));
  j.add("rows", k.separated ? "separated" : "random");
  j.add("us", tm.graph_us).add("us_stream", tm.stream_us).add("bytes", bytes).add("gbps", gbps);
  j.add("hbm_gbps", hbm / 1e9).add("hbm_fraction", gbps * 1e9 / hbm);
  if (k.target_us > 0) j.add("target_us", k.target_us).add("meets_target", tm.graph_us <= k.target_us);
  j.print();
}

struct Inputs {
  RouterConfig c;
  std::vector<Tensor> logits;
  Tensor bias, idx, w, prob, counts, scal;
  RouterStats stats() const { return RouterStats{prob.ref(), counts.ref(), scal.ref()}; }
};

Inputs make_inputs(const Case& k, uint64_t seed) {
  Inputs in;
  in.c = config_of(k);
  const Device dev = Device::cuda(0);
  const Tensor h = k.separated ? host_separated(k.T, k.E, k.dt, seed) : host_random({k.T, k.E}, k.dt, seed, 0, 0, true);
  // Capped: a decode-sized input would need hundreds of copies; it is latency-bound anyway.
  const int nrot = std::min(epx::bench::rotation_for(h.nbytes()), 64);
  for (int i = 0; i < nrot; ++i) in.logits.push_back(to_device(h, dev));
  // Separated rows keep a zero bias: a random one of +-0.05 would bring the sigmoid scores near 1 to near ties.
  const double bias_span = k.separated ? 0.0 : 0.05;
  if (k.bias) in.bias = to_device(host_random({k.E}, DType::kF32, seed + 1, -bias_span, bias_span, false), dev);
  const int64_t S = k.stats == 2 ? k.T / 4096 : 1;
  in.idx = Tensor::empty({k.T, k.K}, DType::kI32, dev);
  in.w = Tensor::empty({k.T, k.K}, DType::kF32, dev);
  if (k.stats) {
    in.prob = Tensor::empty({S, k.E}, DType::kF32, dev);
    in.counts = Tensor::empty({S, k.E}, DType::kF32, dev);
    in.scal = Tensor::empty({2}, DType::kF32, dev);
  }
  return in;
}

void bench_forward(const Case& k, double hbm, epx::cuda::RouterKernel kernel) {
  epx::cuda::set_router_kernel(kernel);
  Inputs in = make_inputs(k, 17);
  const int nrot = static_cast<int>(in.logits.size());
  const Timing tm = time_rotated(nrot, [&](int i, Stream s) {
    epx::route_forward(in.c, in.logits[i], in.bias, in.idx, in.w, in.stats(), s);
  });
  const double elem = static_cast<double>(epx::dtype_size(k.dt));
  double bytes = k.T * (k.E * elem + k.K * 8.0);
  if (k.stats) bytes += in.prob.nbytes() + in.scal.nbytes();
  report("route_forward", k, tm, bytes, hbm, epx::cuda::router_kernel_name(kernel));
}

void bench_backward(const Case& k, double hbm) {
  Inputs in = make_inputs(k, 23);
  const int nrot = static_cast<int>(in.logits.size());
  epx::route_forward(in.c, in.logits[0], in.bias, in.idx, in.w, in.stats());
  epx::count_routed(in.c, in.idx, in.stats());
  const Tensor dw = to_device(host_random({k.T, k.K}, DType::kF32, 5, -1, 1, false), Device::cuda(0));
  std::vector<Tensor> d;
  for (int i = 0; i < nrot; ++i) d.push_back(Tensor::empty({k.T, k.E}, k.dt, Device::cuda(0)));
  const Timing tm = time_rotated(nrot, [&](int i, Stream s) {
    epx::route_backward(in.c, in.logits[i], in.bias, in.idx, dw, in.stats(), 1.0, 1.0, d[i], s);
  });
  const double elem = static_cast<double>(epx::dtype_size(k.dt));
  const double bytes = k.T * (2.0 * k.E * elem + k.K * 8.0) + (k.stats ? in.counts.nbytes() : 0);
  report("route_backward", k, tm, bytes, hbm);
}

void bench_small_ops(const Case& k, double hbm) {
  Inputs in = make_inputs(k, 29);
  epx::route_forward(in.c, in.logits[0], in.bias, in.idx, in.w, in.stats());
  const Timing cnt = time_rotated(1, [&](int, Stream s) { epx::count_routed(in.c, in.idx, in.stats(), s); });
  report("count_routed", k, cnt, static_cast<double>(in.idx.nbytes() + in.counts.nbytes()), hbm);
  const Tensor losses = Tensor::empty({2}, DType::kF32, Device::cuda(0));
  const Timing los = time_rotated(1, [&](int, Stream s) { epx::router_losses(in.c, in.stats(), losses, s); });
  report("router_losses", k, los, static_cast<double>(in.prob.nbytes() + in.counts.nbytes() + 16), hbm);
}

// The forward cases a run is limited to (empty: every case).
struct Filter {
  std::string name, dtype, kernel, rows;
  int stats = -1;
  bool any() const { return !name.empty() || !dtype.empty() || !kernel.empty() || !rows.empty() || stats >= 0; }
  bool keeps(const Case& k, epx::cuda::RouterKernel kern) const {
    return (name.empty() || name == k.name) && (dtype.empty() || dtype == epx::dtype_name(k.dt)) &&
           (rows.empty() || rows == (k.separated ? "separated" : "random")) &&
           (stats < 0 || stats == k.stats) && (kernel.empty() || kernel == epx::cuda::router_kernel_name(kern));
  }
};

// Whether option opt's value v is one of `allowed`; else false after a message naming both.
bool one_of(const char* opt, const std::string& v, std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return true;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  std::fprintf(stderr, "bench_router: %s must be one of %s, got \"%s\"\n", opt, list.c_str(), v.c_str());
  return false;
}

// Parses the options above; false (after a message naming the option) on anything else.
bool parse_filter(int argc, char** argv, Filter& f) {
  for (int i = 1; i < argc; i += 2) {
    const char* opt = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_router: option %s needs a value\n", opt);
      return false;
    }
    const std::string v = argv[i + 1];
    if (!std::strcmp(opt, "--case")) {
      f.name = v;
    } else if (!std::strcmp(opt, "--dtype")) {
      if (!one_of(opt, v, {"fp32", "bf16"})) return false;
      f.dtype = v;
    } else if (!std::strcmp(opt, "--stats")) {
      if (!one_of(opt, v, {"0", "1", "2"})) return false;
      f.stats = v[0] - '0';
    } else if (!std::strcmp(opt, "--kernel")) {
      if (!one_of(opt, v, {"auto", "split", "lean", "wide", "fast", "fast1", "legacy"})) return false;
      f.kernel = v;
    } else if (!std::strcmp(opt, "--rows")) {
      if (!one_of(opt, v, {"random", "separated"})) return false;
      f.rows = v;
    } else {
      std::fprintf(stderr, "bench_router: unknown option \"%s\" (--case, --dtype, --stats, --kernel, --rows)\n", opt);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Filter filter;
  if (!parse_filter(argc, argv, filter)) return 2;
  try {
    epx::bench::BenchDevice dev;
    if (!epx::bench::open_bench_device("router", dev)) return 0;
    const double hbm = dev.hbm;
    const epx::cuda::RouterKernel initial = epx::cuda::router_kernel_in_use();
    epx::bench::device_line("router", dev).add("l2_bytes", dev.prop.l2CacheSize)
        .add("default_kernel", epx::cuda::router_kernel_name(initial)).print();

    Case softmax;
    softmax.name = "softmax_top8";
    softmax.target_us = 10;
    Case ds;
    ds.name = "deepseek_v3";
    ds.f = ScoreFunction::kSigmoid;
    ds.G = 8;
    ds.gk = 4;
    ds.bias = true;
    ds.normalize = true;
    ds.scale = 2.5f;
    ds.target_us = 10;

    std::vector<Case> fwd;
    for (const Case& base : {softmax, ds})
      for (DType dt : {DType::kF32, DType::kBF16})
        for (int st : {1, 0}) {
          Case k = base;
          k.dt = dt;
          k.stats = st;
          if (dt != DType::kF32 || st != 1) k.target_us = 0;  // the targets are for fp32 with statistics
          fwd.push_back(k);
        }
    for (const Case& base : {softmax, ds}) {  // the same rows with none for the exact fallback
      Case k = base;
      k.separated = true;
      k.target_us = 0;
      fwd.push_back(k);
    }
    {
      Case k = ds;
      k.stats = 2;
      k.target_us = 0;
      fwd.push_back(k);
    }
    for (int E : {64, 128, 512}) {
      Case k = softmax;
      k.E = E;
      k.target_us = 0;
      k.name = "softmax_top8_E" + std::to_string(E);
      fwd.push_back(k);
      Case d = ds;
      d.E = E;
      d.target_us = 0;
      d.name = "deepseek_v3_E" + std::to_string(E);
      fwd.push_back(d);
    }
    {
      Case k = softmax;
      k.f = ScoreFunction::kSoftmaxAfterTopk;
      k.name = "softmax_after_top8";
      k.target_us = 0;
      fwd.push_back(k);
      for (const Case& base : {softmax, ds}) {  // the per-rank batch of the layer's benchmark
        Case m = base;
        m.T = 4096;
        m.target_us = 0;
        m.name += "_T4096";
        fwd.push_back(m);
      }
      Case dec = ds;
      dec.T = 128;
      dec.name = "deepseek_v3_decode";
      dec.target_us = 0;
      fwd.push_back(dec);
    }
    for (const Case& k : fwd)
      for (epx::cuda::RouterKernel kern :
           {epx::cuda::RouterKernel::kAuto, epx::cuda::RouterKernel::kSplit, epx::cuda::RouterKernel::kLean,
            epx::cuda::RouterKernel::kWide,
            epx::cuda::RouterKernel::kFast, epx::cuda::RouterKernel::kFastOneTokenPerWarp,
            epx::cuda::RouterKernel::kLegacy}) {
        // Only where split / lean serve the shape (elsewhere another kernel would run under their name);
        // the benchmark's logits are fresh allocations, 16-byte aligned like the null address asked about.
        const TensorRef shape(nullptr, k.dt, {k.T, k.E}, Device::cuda(0));
        if (kern == epx::cuda::RouterKernel::kLean && !epx::cuda::lean_router_serves(config_of(k), shape))
          continue;
        if (kern == epx::cuda::RouterKernel::kSplit && !epx::cuda::split_router_serves(config_of(k), shape))
          continue;
        if (!filter.keeps(k, kern)) continue;
        bench_forward(k, hbm, kern);
      }
    epx::cuda::set_router_kernel(initial);
    if (filter.any()) return 0;

    for (const Case& base : {softmax, ds})
      for (DType dt : {DType::kF32, DType::kBF16}) {
        Case k = base;
        k.dt = dt;
        k.target_us = 0;
        bench_backward(k, hbm);
      }
    bench_small_ops(ds, hbm);
    return 0;
  } catch (const epx::Error& e) {
    std::fprintf(stderr, "bench_router: %s\n", e.what());
    return 1;
  }
}
