// Grouped GEMMs on the expert-major layout (device-side group sizes, no host sync) against a dense
// cuBLASLt GEMM of the same total FLOPs in the same run. JSON lines: shape, time, TFLOP/s, the
// fraction of the dense GEMM's rate; decode also the weight-read floor at the measured HBM speed.
// Built with -DEPX_GEMM_TRIALS=ON it also times the candidate kernels (src/cuda/gemm/cutlass/trials)
// beside the shipped ones and counts the output elements where they differ.
// usage: bench_grouped_gemm [--fp8 | --forward] [--cases NAME,NAME...]
//        bench_grouped_gemm --wgrad fc1|fc2|32x1024|fc1_r128|fc2_r128|fc1_routed|fc2_routed|fc1_routed_r1
//                           SCHEDULE:OUT|SCHEDULE:OUT,SCHEDULE:OUT...|trials
// --cases runs only the cases of those names (a name no case has is an error that lists them).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/gemm_sm_limit.h"
#include "core/scoped_env.h"
#include "cuda/common/cuda_check.h"
#include "cuda/gemm/grouped_gemm_cuda.h"
#include "epx/error.h"
#include "epx/grouped_gemm.h"
#include "epx/quant.h"
#ifdef EPX_GEMM_TRIALS
#include "cuda/gemm/cutlass/trials/forward_trials.h"
#include "cuda/gemm/cutlass/trials/wgrad_trials.h"
#endif
#include "moe/elementwise.h"
#include "tools/args.h"

using namespace epx;
using bench::JsonLine;

namespace {

// Filled on the device: the DeepSeek-V3 shapes hold gigabytes of weights.
Tensor device_random(Shape s, DType dt, uint32_t seed, double scale) {
  Tensor t = Tensor::empty(s, dt, Device::cuda(0));
  detail::fill_normal(t, seed, 0, scale);
  return t;
}

struct LayoutD {
  Tensor offsets, rows;
  int64_t total = 0;
  int64_t row_align = 1;  // every offset is a multiple of it (128 when groups start on 128-row blocks)
};

// The tile orders of the persistent scheduler (EPX_GEMM_RASTER, EPX_GEMM_SWIZZLE) a trials build times
// the kernels under; null: each kernel's own.
struct TileOrderSetting {
  const char* raster;
  const char* swizzle;
};
#ifdef EPX_GEMM_TRIALS
const std::vector<TileOrderSetting> kTileOrders = {{"m", "1"}, {"n", "1"}, {"m", "4"}, {"n", "4"}};
#else
const std::vector<TileOrderSetting> kTileOrders = {{nullptr, nullptr}};
#endif

// The orders a contest runs the kernels under: every one, or only the first (the --fp8 and --forward
// modes).
std::vector<TileOrderSetting> contest_tile_orders(bool first_only) {
  return first_only ? std::vector<TileOrderSetting>{kTileOrders.front()} : kTileOrders;
}

// A null setting leaves the environment alone: each kernel's own order, or the caller's override.
struct ScopedTileOrder {
  explicit ScopedTileOrder(const TileOrderSetting& o) {
    if (o.raster == nullptr) return;
    raster.emplace("EPX_GEMM_RASTER", o.raster);
    swizzle.emplace("EPX_GEMM_SWIZZLE", o.swizzle);
  }
  std::optional<detail::ScopedEnv> raster, swizzle;
};

JsonLine& add_tile_order(JsonLine& j, const TileOrderSetting& o) {
  if (o.raster) j.add("raster", o.raster).add("swizzle", std::atoi(o.swizzle));
  return j;
}

// Groups of the given sizes, each padded to a multiple of `align` rows.
LayoutD layout(const std::vector<int>& sizes, int align = 1) {
  LayoutD L;
  const int G = static_cast<int>(sizes.size());
  Tensor o = Tensor::empty({G + 1}, DType::kI32), r = Tensor::empty({G}, DType::kI32);
  int64_t at = 0;
  bool blocks = true;
  for (int g = 0; g < G; ++g) {
    o.ptr<int32_t>()[g] = static_cast<int32_t>(at);
    r.ptr<int32_t>()[g] = sizes[g];
    blocks = blocks && at % 128 == 0;
    at += (sizes[g] + align - 1) / align * align;
  }
  L.row_align = blocks ? 128 : 1;
  o.ptr<int32_t>()[G] = static_cast<int32_t>(at);
  L.offsets = o.to(Device::cuda(0));
  L.rows = r.to(Device::cuda(0));
  L.total = at;
  return L;
}

std::vector<int> zipf_sizes(int G, int total, double s) {
  std::vector<double> w(G);
  double sum = 0;
  for (int g = 0; g < G; ++g) sum += (w[g] = 1.0 / std::pow(g + 1.0, s));
  std::vector<int> out(G);
  int used = 0;
  for (int g = 0; g < G; ++g) used += (out[g] = static_cast<int>(total * w[g] / sum) / 8 * 8);
  out[0] += total - used;
  return out;
}

// The rows each local expert of rank 0 gets in a layer of `ranks` ranks, each routing `tokens` tokens
// to K distinct experts of E drawn uniformly: what the layer's grouped GEMMs see (256 +- 16 rows an
// expert on 2 ranks at DeepSeek-V3's shapes), unlike a benchmark's equal groups.
std::vector<int> routed_sizes(int ranks, int tokens, int E, int K, uint32_t seed) {
  const Tensor ids = bench::random_expert_ids(ranks * tokens, E, K, seed, Device::cpu());
  std::vector<int> count(E / ranks, 0);
  for (int64_t i = 0; i < ids.numel(); ++i)
    if (const int32_t e = ids.ptr<int32_t>()[i]; e < E / ranks) ++count[e];
  return count;
}

const char* forward_schedule_name(cuda::ForwardGemmSchedule s) {
  switch (s) {
    case cuda::ForwardGemmSchedule::kPingpong: return "pingpong";
    case cuda::ForwardGemmSchedule::kContiguous: return "contiguous";
    default: return "cooperative";
  }
}

// --fp8: only the FP8 contests (the bf16 forward, the FP8 schedules and candidates); --forward: only the
// contests of the bf16 forward and dgrad against their candidates (trials build). Both in the default
// tile order.
bool g_fp8_only = false;
bool g_forward_only = false;

// The FP8 forward (DeepSeek-V3 block scales) on the same operands: the weights quantized and
// transposed once (outside the timing, as once per weight update), x's 1x128 quantization timed
// apart (the layer would fuse it into dispatch), the GEMM op timed as a caller sees it (the scale
// regrouping and the padding fill included).
void run_fp8(const char* name, const LayoutD& L, const Tensor& x, const Tensor& w, const Tensor& y_bf16, int64_t K,
             int64_t N, double flops, double hbm) {
  if (K % 128 != 0 || N % 128 != 0) return;
  const int G = static_cast<int>(L.rows.size(0));
  Tensor x_q = Tensor::empty({L.total, K}, DType::kF8E4M3, Device::cuda(0));
  Tensor x_s = Tensor::empty({L.total, K / 128}, DType::kF32, Device::cuda(0));
  Tensor w_q = Tensor::empty({G, N, K}, DType::kF8E4M3, Device::cuda(0));
  Tensor w_s = Tensor::empty({G, K / 128, N / 128}, DType::kF32, Device::cuda(0));
  Tensor y = Tensor::empty({L.total, N}, DType::kBF16, Device::cuda(0));
  const double tw = bench::time_us([&](int) { quantize_grouped_weights_fp8(w, w_q, w_s); }, 3, 1, 1);
  const double tq = bench::time_us([&](int) { quantize(QuantRecipe::kFp8Block1x128, x, x_q, x_s); }, 10, 5, 2);
  // The bf16 forward and every schedule of the FP8 kernel (EPX_FP8_GEMM_KERNEL is read at every call;
  // a trials build adds the candidates and the tile orders) in one interleaved contest, so the
  // speedup compares them at the same sustained clock.
  const std::vector<const char*> schedules = cuda::fp8_gemm_schedule_names();
  struct Entry {
    size_t schedule;  // index into schedules
    TileOrderSetting order;
    const char* epilogue;  // EPX_CONTIGUOUS_EPILOGUE (the other schedules have their own: auto)
  };
  std::vector<Entry> entries;
  std::vector<std::function<void()>> fns = {
      [&] { grouped_gemm_forward(x, w, L.offsets, L.rows, y_bf16, {}, L.row_align); }};
  for (const TileOrderSetting& order : contest_tile_orders(g_fp8_only))
    for (size_t si = 0; si < schedules.size(); ++si) {
      const char* schedule = schedules[si];
      try {  // one schedule failing must not hide the other lines
        const ScopedTileOrder scoped_order(order);
        const detail::ScopedEnv scoped_schedule("EPX_FP8_GEMM_KERNEL", schedule);
        grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets, L.rows, y, {}, L.row_align);
        EPX_CUDA_CHECK(cudaDeviceSynchronize());
      } catch (const Error& e) {
        JsonLine j;
        j.add("impl", "epx").add("op", "grouped_gemm_forward_fp8").add("schedule", schedule).add("case", name);
        add_tile_order(j, order).add("error", e.what()).print();
        continue;
      }
      // The contiguous schedule with each of its epilogues; the others with their own.
      const bool contiguous = std::strcmp(schedule, "contiguous") == 0;
      for (const char* epilogue : contiguous ? std::vector<const char*>{"staged", "cutlass"}
                                             : std::vector<const char*>{"auto"}) {
        entries.push_back({si, order, epilogue});
        fns.push_back([&, schedule, order, epilogue] {
          const ScopedTileOrder scoped_order(order);
          const detail::ScopedEnv scoped_schedule("EPX_FP8_GEMM_KERNEL", schedule);
          const detail::ScopedEnv scoped_epilogue("EPX_CONTIGUOUS_EPILOGUE", epilogue);
          grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets, L.rows, y, {}, L.row_align);
        });
      }
    }
  const std::vector<double> t = bench::time_interleaved(fns);
  // Each schedule's output (default tile order) against the cooperative kernel's, element by element.
  std::vector<long long> differ(schedules.size(), -1);
  {
    auto output_of = [&](const char* schedule) {
      const detail::ScopedEnv scoped_schedule("EPX_FP8_GEMM_KERNEL", schedule);
      grouped_gemm_forward_fp8(x_q, x_s, w_q, w_s, L.offsets, L.rows, y, {}, L.row_align);
      return y.to(Device::cpu());
    };
    const Tensor want = output_of("cooperative");
    const uint16_t* wv = static_cast<const uint16_t*>(want.data());
    for (size_t i = 0; i < schedules.size(); ++i) {
      try {
        const Tensor got = output_of(schedules[i]);
        const uint16_t* gv = static_cast<const uint16_t*>(got.data());
        differ[i] = 0;
        for (int64_t k = 0; k < want.numel(); ++k) differ[i] += gv[k] != wv[k];
      } catch (const Error&) {  // reported with the timings
      }
    }
  }
  for (size_t e = 0; e < entries.size(); ++e) {
    JsonLine j;
    j.add("impl", "epx").add("op", "grouped_gemm_forward_fp8").add("recipe", "fp8_block_1x128_128x128")
        .add("elements_differing_from_cooperative", differ[entries[e].schedule])
        .add("schedule", schedules[entries[e].schedule]).add("epilogue", entries[e].epilogue)
        .add("case", name).add("groups", G)
        .add("row_align", static_cast<long long>(L.row_align))
        .add("rows", static_cast<long long>(L.total)).add("K", static_cast<long long>(K))
        .add("N", static_cast<long long>(N)).add("time_us", t[e + 1]).add("tflops", flops / t[e + 1] * 1e-6)
        .add("bf16_time_us", t[0]).add("speedup_vs_bf16", t[0] / t[e + 1]).add("target_speedup", 1.6)
        .add("quantize_x_us", tq).add("quantize_weights_us", tw)
        .add("weight_read_floor_us", static_cast<double>(G) * K * N / hbm * 1e6);
    add_tile_order(j, entries[e].order).print();
  }
}

#ifdef EPX_GEMM_TRIALS
// The shipped forward / dgrad kernel beside each candidate of its mode (-DEPX_GEMM_TRIALS=ON), on
// the same operands: times, and how many output elements differ from the shipped kernel's.
void run_forward_trials(const char* name, bool dgrad, const cuda::GroupedOperand& a, const cuda::GroupedOperand& b,
                        int64_t ld_out, int64_t Kc, int64_t Nout, const LayoutD& L, int G, double flops) {
  const int64_t R = L.total;
  Tensor want = Tensor::zeros({R, Nout}, DType::kBF16, Device::cuda(0));
  Tensor got = Tensor::zeros({R, Nout}, DType::kBF16, Device::cuda(0));
  const int32_t* off = L.offsets.ptr<int32_t>();
  const int32_t* rows = L.rows.ptr<int32_t>();
  auto shipped = [&](void* out) {
    if (dgrad) cuda::grouped_dgrad_bf16(a, b, out, ld_out, Kc, Nout, off, rows, G, R, {});
    else cuda::grouped_forward_bf16(a, b, out, ld_out, Kc, Nout, off, rows, G, R, {});
  };
  const char* op = dgrad ? "grouped_gemm_dgrad_kernel" : "grouped_gemm_forward_kernel";
  shipped(want.data());
  const Tensor wh = want.to(Device::cpu());
  int count = 0;
  const cuda::ForwardTrial* trials = cuda::forward_trials(count);
  // Each candidate's output against the shipped kernel's, once (in the kernel's own tile order).
  std::vector<long long> differ(count, 0);
  for (int i = 0; i < count; ++i) {
    if (trials[i].dgrad != dgrad) continue;
    cudaMemset(got.data(), 0, static_cast<size_t>(R * Nout * 2));
    trials[i].run(a, b, got.data(), ld_out, Kc, Nout, off, rows, G, {});
    const Tensor gh = got.to(Device::cpu());
    const uint16_t* gv = static_cast<const uint16_t*>(gh.data());
    const uint16_t* wv = static_cast<const uint16_t*>(wh.data());
    for (int64_t j = 0; j < R * Nout; ++j) differ[i] += gv[j] != wv[j];
  }
  // The shipped kernel and the candidates under every tile order, interleaved (time_interleaved).
  struct Entry {
    int trial;  // -1: the shipped kernel
    TileOrderSetting order;
  };
  std::vector<Entry> entries;
  std::vector<std::function<void()>> fns;
  for (const TileOrderSetting& order : contest_tile_orders(g_forward_only)) {
    entries.push_back({-1, order});
    fns.push_back([&, order] {
      const ScopedTileOrder scoped_order(order);
      shipped(want.data());
    });
    for (int i = 0; i < count; ++i) {
      if (trials[i].dgrad != dgrad) continue;
      entries.push_back({i, order});
      fns.push_back([&, order, fn = trials[i].run] {
        const ScopedTileOrder scoped_order(order);
        fn(a, b, got.data(), ld_out, Kc, Nout, off, rows, G, {});
      });
    }
  }
  const std::vector<double> t = bench::time_interleaved(fns);
  for (size_t e = 0; e < entries.size(); ++e) {
    const int trial = entries[e].trial;
    JsonLine j;
    j.add("impl", "epx").add("op", op).add("case", name).add("schedule", trial < 0 ? "shipped" : trials[trial].name)
        .add("time_us", t[e]).add("tflops", flops / t[e] * 1e-6).add("shipped_over_trial_time", t[0] / t[e]);
    if (trial >= 0) j.add("elements_differing_from_shipped", differ[trial]);
    add_tile_order(j, entries[e].order).print();
  }
}
#endif

// --cases a,b: only the cases of those names (every case without it). Every case name run() meets is
// kept, so that a name of the list that none has can be reported with the ones there are.
std::vector<std::string> g_cases;
std::vector<std::string> g_case_names;

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

bool case_selected(const char* name) {
  g_case_names.push_back(name);
  return g_cases.empty() || contains(g_cases, name);
}

// The names of --cases that no case run() met, with the names there are; empty when all were found.
std::string unknown_cases() {
  std::string unknown, known;
  for (const std::string& name : g_cases)
    if (!contains(g_case_names, name)) unknown += (unknown.empty() ? "" : ", ") + name;
  if (unknown.empty()) return {};
  for (const std::string& n : g_case_names) known += (known.empty() ? "" : ", ") + n;
  return "--cases names " + unknown + ", which no case of this mode has; the cases: " + known;
}

// One shape: the grouped forward and the dense cuBLASLt GEMM of the same FLOPs, and for a backward
// shape dgrad and wgrad (fp32 and bf16 gradients), timed in one interleaved contest
// (time_interleaved) so every ratio compares them at the same sustained clock; then the candidates
// (trials build) and the FP8 forward.
void run(const char* name, const std::vector<int>& sizes, int64_t K, int64_t N, double hbm, bool backward,
         int align = 1) {
  if (!case_selected(name)) return;
  const LayoutD L = layout(sizes, align);
  const int G = static_cast<int>(sizes.size());
  Tensor x = device_random({L.total, K}, DType::kBF16, 1, 1.0), w = device_random({G, K, N}, DType::kBF16, 2, 0.02);
  Tensor y = Tensor::empty({L.total, N}, DType::kBF16, Device::cuda(0));
  int64_t real_rows = 0;  // padding rows are computed, not counted
  for (int n : sizes) real_rows += n;
  const double flops = 2.0 * real_rows * K * N;
  if (g_fp8_only) return run_fp8(name, L, x, w, y, K, N, flops, hbm);
#ifdef EPX_GEMM_TRIALS
  if (g_forward_only) {
    run_forward_trials(name, false, {x.data(), K, 0}, {w.data(), N, K * N}, N, K, N, L, G, flops);
    if (backward) {
      Tensor dy = device_random({L.total, N}, DType::kBF16, 4, 1.0);
      run_forward_trials(name, true, {dy.data(), N, 0}, {w.data(), N, K * N}, K, N, K, L, G, flops);
    }
    return;
  }
#endif
  Tensor wd = device_random({K, N}, DType::kBF16, 3, 0.02);
  Tensor yd = Tensor::empty({L.total, N}, DType::kBF16, Device::cuda(0));
  std::vector<std::function<void()>> fns = {[&] { grouped_gemm_forward(x, w, L.offsets, L.rows, y, {}, L.row_align); },
                                            [&] { gemm(x, wd, yd); }};
  // Both pointer-array schedules join the contest (last), forward and dgrad, so the lines compare them
  // with auto's pick (which may be the contiguous kernel where groups start on 128-row blocks) at the
  // same clock.
  const std::vector<const char*> pointer_array = {"cooperative", "pingpong"};
  Tensor dy, dx, dw32, dw16;
  if (backward) {
    dy = device_random({L.total, N}, DType::kBF16, 4, 1.0);
    dx = Tensor::empty({L.total, K}, DType::kBF16, Device::cuda(0));
    dw32 = Tensor::empty({G, K, N}, DType::kF32, Device::cuda(0));
    dw16 = Tensor::empty({G, K, N}, DType::kBF16, Device::cuda(0));
    fns.push_back([&] { grouped_gemm_dgrad(dy, w, L.offsets, L.rows, dx, {}, L.row_align); });
    fns.push_back([&] { grouped_gemm_wgrad(x, dy, L.offsets, L.rows, dw32); });
    fns.push_back([&] { grouped_gemm_wgrad(x, dy, L.offsets, L.rows, dw16); });
  }
  for (const char* schedule : pointer_array)
    fns.push_back([&, schedule] {
      const detail::ScopedEnv scoped("EPX_GEMM_FORWARD_KERNEL", schedule);
      grouped_gemm_forward(x, w, L.offsets, L.rows, y, {}, L.row_align);
    });
  if (backward)
    for (const char* schedule : pointer_array)
      fns.push_back([&, schedule] {
        const detail::ScopedEnv scoped("EPX_GEMM_FORWARD_KERNEL", schedule);
        grouped_gemm_dgrad(dy, w, L.offsets, L.rows, dx, {}, L.row_align);
      });
  // Where groups start on 128-row blocks, the contiguous kernels with each epilogue (forward, then dgrad).
  const std::vector<const char*> epilogues = L.row_align % 128 == 0 ? std::vector<const char*>{"staged", "cutlass"}
                                                                    : std::vector<const char*>{};
  for (int d = 0; d < (backward ? 2 : 1); ++d)
    for (const char* epilogue : epilogues)
      fns.push_back([&, d, epilogue] {
        const detail::ScopedEnv scoped("EPX_GEMM_FORWARD_KERNEL", "contiguous");
        const detail::ScopedEnv scoped_epilogue("EPX_CONTIGUOUS_EPILOGUE", epilogue);
        if (d == 0)
          grouped_gemm_forward(x, w, L.offsets, L.rows, y, {}, L.row_align);
        else
          grouped_gemm_dgrad(dy, w, L.offsets, L.rows, dx, {}, L.row_align);
      });
  // The forward on fewer SMs, as an overlapped MoE layer runs it beside its collectives (their
  // budget of 16 or 32 SMs left free): what that budget costs the GEMM.
  const int sms = cuda::sm_count();
  const std::vector<int> sm_limits = {sms - 16, sms - 32};
  for (int limit : sm_limits)
    fns.push_back([&, limit] {
      const detail::GemmSmLimit fewer(limit);
      grouped_gemm_forward(x, w, L.offsets, L.rows, y, {}, L.row_align);
    });
  const std::vector<double> t = bench::time_interleaved(fns);
  const double tf = t[0], td = t[1];
  JsonLine j;
  j.add("impl", "epx").add("op", "grouped_gemm_forward").add("case", name).add("groups", G)
      .add("rows", static_cast<long long>(L.total)).add("K", static_cast<long long>(K)).add("N", static_cast<long long>(N))
      .add("row_align", static_cast<long long>(L.row_align))
      .add("schedule", forward_schedule_name(cuda::forward_gemm_schedule(K, L.total, G, L.row_align)))
      .add("time_us", tf).add("tflops", flops / tf * 1e-6).add("dense_cublas_us", td)
      .add("dense_tflops", flops / td * 1e-6)
      .add("fraction_of_dense", td / tf);
  const double weight_bytes = 2.0 * G * K * N;
  j.add("weight_read_floor_us", weight_bytes / hbm * 1e6);
  j.print();
  if (backward) {
    JsonLine().add("impl", "epx").add("op", "grouped_gemm_dgrad").add("case", name).add("time_us", t[2])
        .add("tflops", flops / t[2] * 1e-6).add("fraction_of_forward", tf / t[2]).print();
    for (int b = 0; b < 2; ++b)
      JsonLine().add("impl", "epx").add("op", "grouped_gemm_wgrad").add("case", name).add("grads", b ? "bf16" : "fp32")
          .add("time_us", t[3 + b]).add("tflops", flops / t[3 + b] * 1e-6).add("fraction_of_forward", tf / t[3 + b])
          .print();
  }
  const size_t first_limit = t.size() - sm_limits.size();
  const size_t first_epilogue = first_limit - epilogues.size() * (backward ? 2 : 1);
  const size_t first_schedule = first_epilogue - pointer_array.size() * (backward ? 2 : 1);
  for (size_t i = 0; i < epilogues.size() * (backward ? 2 : 1); ++i) {
    const bool dgrad = i >= epilogues.size();
    const double ti = t[first_epilogue + i], t_auto = dgrad ? t[2] : tf;
    JsonLine().add("impl", "epx").add("op", dgrad ? "grouped_gemm_dgrad" : "grouped_gemm_forward").add("case", name)
        .add("schedule", "contiguous").add("epilogue", epilogues[i % epilogues.size()]).add("time_us", ti)
        .add("tflops", flops / ti * 1e-6).add("auto_speedup", ti / t_auto).print();
  }
  for (size_t i = 0; i < sm_limits.size(); ++i) {
    const double ti = t[first_limit + i];
    JsonLine().add("impl", "epx").add("op", "grouped_gemm_forward").add("case", name).add("sm_limit", sm_limits[i])
        .add("sms", sms).add("time_us", ti).add("tflops", flops / ti * 1e-6).add("fraction_of_all_sms", tf / ti)
        .print();
  }
  for (size_t i = 0; i < pointer_array.size() * (backward ? 2 : 1); ++i) {
    const bool dgrad = i >= pointer_array.size();
    const double ti = t[first_schedule + i], t_auto = dgrad ? t[2] : tf;
    JsonLine().add("impl", "epx").add("op", dgrad ? "grouped_gemm_dgrad" : "grouped_gemm_forward").add("case", name)
        .add("schedule", pointer_array[i % pointer_array.size()]).add("time_us", ti).add("tflops", flops / ti * 1e-6)
        .add("auto_speedup", ti / t_auto).print();
  }
#ifdef EPX_GEMM_TRIALS
  run_forward_trials(name, false, {x.data(), K, 0}, {w.data(), N, K * N}, N, K, N, L, G, flops);
  if (backward) run_forward_trials(name, true, {dy.data(), N, 0}, {w.data(), N, K * N}, K, N, K, L, G, flops);
#endif
  run_fp8(name, L, x, w, y, K, N, flops, hbm);
}

// Every wgrad kernel on one shape: both schedules, fp32 and bf16 gradients (the layer's choice).
// only: "schedule:out" (e.g. "pingpong:bf16") runs that variant alone (for a profiler), a comma list of
// them those in one interleaved contest, "trials" them all and the candidate kernels under every tile
// order; empty runs the shipped ones.
void run_wgrad_variants(const char* name, const std::vector<int>& sizes, int64_t K, int64_t N,
                        const std::string& only = {}) {
  if (!case_selected(name)) return;
  const LayoutD L = layout(sizes);
  const int G = static_cast<int>(sizes.size());
  Tensor x = device_random({L.total, K}, DType::kBF16, 5, 1.0), dy = device_random({L.total, N}, DType::kBF16, 6, 1.0);
  Tensor dw32 = Tensor::empty({G, K, N}, DType::kF32, Device::cuda(0));
  Tensor dw16 = Tensor::empty({G, K, N}, DType::kBF16, Device::cuda(0));
  const double flops = 2.0 * L.total * K * N;
  const int32_t* off = L.offsets.ptr<int32_t>();
  const int32_t* rows = L.rows.ptr<int32_t>();
  const cuda::GroupedOperand a{x.data(), K, 0}, d{dy.data(), N, 0};
  struct Variant {
    const char* schedule;
    const char* out;
    std::function<void()> fn;
  };
  const std::vector<Variant> variants = {
      {"cooperative", "fp32", [&] { cuda::grouped_wgrad_bf16(a, d, dw32.ptr<float>(), K * N, K, N, off, rows, G, {}); }},
      {"pingpong", "fp32", [&] { cuda::grouped_wgrad_bf16_pingpong(a, d, dw32.ptr<float>(), K * N, K, N, off, rows, G, {}); }},
      {"cooperative", "bf16", [&] { cuda::grouped_wgrad_bf16_out(a, d, dw16.data(), K * N, K, N, off, rows, G, {}); }},
      {"pingpong", "bf16", [&] { cuda::grouped_wgrad_bf16_out_pingpong(a, d, dw16.data(), K * N, K, N, off, rows, G, {}); }},
      {"cluster2x1", "bf16", [&] { cuda::grouped_wgrad_bf16_out_cluster(a, d, dw16.data(), K * N, K, N, off, rows, G, {}); }},
      {"nosource", "bf16", [&] { cuda::grouped_wgrad_bf16_out_nosource(a, d, dw16.data(), K * N, K, N, off, rows, G, {}); }},
      {"pingpong_nosource", "bf16",
       [&] { cuda::grouped_wgrad_bf16_out_pingpong_nosource(a, d, dw16.data(), K * N, K, N, off, rows, G, {}); }},
      {"coop_tma", "bf16",
       [&] { cuda::grouped_wgrad_bf16_out_coop_tma(a, d, dw16.data(), K * N, K, N, off, rows, G, {}); }},
      // the same kernel with every MMA of a group's last K block (EPX_WGRAD_K_TAIL=full)
      {"coop_tma_full_k", "bf16",
       [&] {
         const detail::ScopedEnv full("EPX_WGRAD_K_TAIL", "full");
         cuda::grouped_wgrad_bf16_out_coop_tma(a, d, dw16.data(), K * N, K, N, off, rows, G, {});
       }},
      {"pingpong_nosource", "fp32",
       [&] { cuda::grouped_wgrad_f32_pingpong_nosource(a, d, dw32.ptr<float>(), K * N, K, N, off, rows, G, {}); }},
      {"pingpong_nosource_full_k", "bf16",
       [&] {
         const detail::ScopedEnv full("EPX_WGRAD_K_TAIL", "full");
         cuda::grouped_wgrad_bf16_out_pingpong_nosource(a, d, dw16.data(), K * N, K, N, off, rows, G, {});
       }},
      {"pingpong_nosource_full_k", "fp32",
       [&] {
         const detail::ScopedEnv full("EPX_WGRAD_K_TAIL", "full");
         cuda::grouped_wgrad_f32_pingpong_nosource(a, d, dw32.ptr<float>(), K * N, K, N, off, rows, G, {});
       }},
  };
#ifdef EPX_GEMM_TRIALS
  int trial_count = 0;
  const cuda::WgradTrial* trials = cuda::wgrad_trials(trial_count);
  std::vector<Variant> all = variants;
  for (int i = 0; i < trial_count; ++i) {
    const cuda::WgradTrial& tr = trials[i];
    void* out = tr.fp32_out ? dw32.data() : dw16.data();
    all.push_back({tr.name, tr.fp32_out ? "fp32" : "bf16",
                   [&, run = tr.run, out] { run(a, d, out, K * N, K, N, off, rows, G, {}); }});
  }
#else
  const std::vector<Variant>& all = variants;
#endif
  // Every variant's gradient against the cooperative kernel's of the same dtype, on the first and
  // last 4M elements (the whole gradient is gigabytes): the same sums, so any difference is reported.
  const size_t total = static_cast<size_t>(G) * K * N, probe = std::min<size_t>(size_t{1} << 22, total);
  auto fetch = [&](bool fp32, bool tail) {
    const size_t es = fp32 ? 4 : 2;
    std::vector<unsigned char> h(probe * es);
    const unsigned char* base = static_cast<const unsigned char*>(fp32 ? dw32.data() : dw16.data());
    const size_t at = tail ? (total - probe) * es : 0;
    if (cudaMemcpy(h.data(), base + at, h.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("bench_grouped_gemm: copy of the wgrad probe failed");
    return h;
  };
  std::vector<unsigned char> want[2][2];  // [fp32][tail]
  for (int f = 0; f < 2; ++f) {
    variants[f ? 0 : 2].fn();  // cooperative fp32 / bf16
    cudaDeviceSynchronize();
    want[f][0] = fetch(f, false);
    want[f][1] = fetch(f, true);
  }
  // Which variants run, and each one's probe mismatches.
  // only = "a:bf16,b:bf16": those variants in one interleaved contest (default tile order)
  const bool listed = only.find(',') != std::string::npos;
  auto in_list = [&](const std::string& id) { return ("," + only + ",").find("," + id + ",") != std::string::npos; };
  std::vector<size_t> picked;
  std::vector<long long> mismatches;
  for (size_t vi = 0; vi < all.size(); ++vi) {
    const Variant& v = all[vi];
    const std::string id = std::string(v.schedule) + ":" + v.out;
    if (only.empty() && vi >= variants.size()) continue;  // candidates only when asked for
    if (listed ? !in_list(id) : !only.empty() && only != "trials" && only != id) continue;
    const bool fp32 = std::string(v.out) == "fp32";
    const size_t es = fp32 ? 4 : 2;
    unsigned char* out = static_cast<unsigned char*>(fp32 ? dw32.data() : dw16.data());
    cudaMemset(out, 0xff, probe * es);  // a kernel that skips the probed elements cannot pass
    cudaMemset(out + (total - probe) * es, 0xff, probe * es);
    v.fn();
    cudaDeviceSynchronize();
    long long m = 0;
    for (int tail = 0; tail < 2; ++tail) {
      const std::vector<unsigned char> got = fetch(fp32, tail);
      for (size_t i = 0; i < probe; ++i) m += std::memcmp(&got[i * es], &want[fp32][tail][i * es], es) != 0;
    }
    picked.push_back(vi);
    mismatches.push_back(m);
  }
  // Trials: every variant under every tile order in one interleaved contest; otherwise each alone.
  const bool contest = only == "trials" || listed;
  const std::vector<TileOrderSetting> orders =
      only == "trials" ? kTileOrders : std::vector<TileOrderSetting>{{nullptr, nullptr}};
  std::vector<std::function<void()>> fns;
  for (const TileOrderSetting& order : orders)
    for (size_t p : picked)
      fns.push_back([&, order, p] {
        const ScopedTileOrder scoped_order(order);
        all[p].fn();
      });
  std::vector<double> times;
  if (contest) times = bench::time_interleaved(fns);
  else
    for (const auto& fn : fns) times.push_back(bench::time_us([&](int) { fn(); }, 10, 5, 2));
  for (size_t o = 0; o < orders.size(); ++o)
    for (size_t k = 0; k < picked.size(); ++k) {
      const Variant& v = all[picked[k]];
      const double t = times[o * picked.size() + k];
      const double out_bytes = static_cast<double>(G) * K * N * (std::string(v.out) == "fp32" ? 4 : 2);
      JsonLine j;
      j.add("impl", "epx").add("op", "grouped_gemm_wgrad_kernel").add("case", name).add("schedule", v.schedule)
          .add("out", v.out).add("groups", G).add("rows", static_cast<long long>(L.total))
          .add("K", static_cast<long long>(K)).add("N", static_cast<long long>(N)).add("time_us", t)
          .add("tflops", flops / t * 1e-6).add("gradient_write_gb_per_s", out_bytes / t * 1e-3)
          .add("probe_mismatches_vs_cooperative", mismatches[k]);
      add_tile_order(j, orders[o]).print();
    }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // The arguments first, so that a wrong one gets the usage wherever it runs.
    const bool wgrad_only = argc == 4 && std::string(argv[1]) == "--wgrad";
    std::vector<std::string> args(argv + 1, argv + argc);
    for (size_t i = 0; !wgrad_only && i + 1 < args.size(); ++i)
      if (args[i] == "--cases") {
        g_cases = tools::split_list(args[i + 1]);
        args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
        break;
      }
    g_fp8_only = args.size() == 1 && args[0] == "--fp8";
    g_forward_only = args.size() == 1 && args[0] == "--forward";
    if (!wgrad_only && !args.empty() && !g_fp8_only && !g_forward_only) {
      std::fprintf(stderr, "usage: bench_grouped_gemm [--fp8 | --forward] [--cases NAME,NAME...]\n"
                           "       bench_grouped_gemm --wgrad fc1|fc2|32x1024|fc1_r128|fc2_r128 SCHEDULE:OUT|trials\n");
      return 2;
    }
    if (!cuda::grouped_gemm_available()) {
      std::fprintf(stderr, "bench_grouped_gemm: built without CUTLASS: skipped\n");
      return 0;
    }
    bench::BenchDevice dev;
    if (!bench::open_bench_device("grouped_gemm", dev)) return 0;
    bench::device_line("grouped_gemm", dev).print();
    // --wgrad CASE SCHEDULE:OUT: one wgrad kernel on one shape, nothing else (profiling); a comma list:
    // those kernels in one interleaved contest; --wgrad CASE trials: every shipped wgrad kernel and the
    // candidates (-DEPX_GEMM_TRIALS=ON).
    if (wgrad_only) {
      struct WgradCase {
        const char* arg;
        const char* name;
        int groups, rows;
        int64_t K, N;
      };
      // fc1 / fc2: the DeepSeek-V3 layer on 2 GPUs (128 local experts, ~256 rows each); the _r128
      // ones: on one GPU (all 256 experts, ~128 rows each).
      // fc1_routed / fc2_routed: the 2-GPU layer's experts as routing fills them (routed_sizes); _r1: one GPU.
      const WgradCase cases[] = {{"fc1", "dsv3_fc1_128x256_k7168_n4096", 128, 256, 7168, 4096},
                                 {"fc2", "dsv3_fc2_128x256_k2048_n7168", 128, 256, 2048, 7168},
                                 {"32x1024", "32x1024_k7168_n2048", 32, 1024, 7168, 2048},
                                 {"fc1_r128", "dsv3_fc1_256x128_k7168_n4096", 256, 128, 7168, 4096},
                                 {"fc2_r128", "dsv3_fc2_256x128_k2048_n7168", 256, 128, 2048, 7168},
                                 {"fc1_routed", "dsv3_fc1_routed_2ranks_k7168_n4096", 0, 2, 7168, 4096},
                                 {"fc2_routed", "dsv3_fc2_routed_2ranks_k2048_n7168", 0, 2, 2048, 7168},
                                 {"fc1_routed_r1", "dsv3_fc1_routed_1rank_k7168_n4096", 0, 1, 7168, 4096}};
      const std::string c = argv[2];
      const WgradCase* found = nullptr;
      for (const WgradCase& w : cases)
        if (c == w.arg) found = &w;
      if (found == nullptr)
        throw std::runtime_error("bench_grouped_gemm: --wgrad takes fc1, fc2, 32x1024, fc1_r128, fc2_r128, fc1_routed, "
                                 "fc2_routed or fc1_routed_r1, not " + c);
      // groups = 0: routed sizes over `rows` ranks
      const std::vector<int> sizes = found->groups > 0 ? std::vector<int>(found->groups, found->rows)
                                                       : routed_sizes(found->rows, 4096, 256, 8, 19 - found->rows);
      run_wgrad_variants(found->name, sizes, found->K, found->N, argv[3]);
      return 0;
    }
    const double hbm = dev.hbm;
    // Every shape of the forward targets also times its dgrad and wgrad in the same contest (the
    // backward targets are "within 15% of the forward" at the same shapes).
    run("32x1024_k7168_n2048", std::vector<int>(32, 1024), 7168, 2048, hbm, true);
    run("zipf_32_k7168_n2048", zipf_sizes(32, 32768, 1.2), 7168, 2048, hbm, true);
    // The same groups padded to 128-row blocks (a dispatch with align = 128): the contiguous FP8 kernel.
    if (g_fp8_only) run("zipf_32_align128_k7168_n2048", zipf_sizes(32, 32768, 1.2), 7168, 2048, hbm, false, 128);
    run("32x1024_k2048_n7168", std::vector<int>(32, 1024), 2048, 7168, hbm, true);
    run("8x4096_k4096_n14336", std::vector<int>(8, 4096), 4096, 14336, hbm, true);
    run("decode_32x16_k7168_n2048", std::vector<int>(32, 16), 7168, 2048, hbm, true);
    // The DeepSeek-V3 layer on 2 GPUs: 128 local experts, ~256 rows each; stacked FC1 (N = 2F) and FC2.
    run("dsv3_fc1_128x256_k7168_n4096", std::vector<int>(128, 256), 7168, 4096, hbm, true);
    run("dsv3_fc2_128x256_k2048_n7168", std::vector<int>(128, 256), 2048, 7168, hbm, true);
    // The same layers' experts as routing fills them (uniform top-8 of 256, 4096 tokens a rank; groups
    // padded to 16 rows, the layer's default align): 2 ranks (~256 rows an expert) and one GPU (~128).
    const std::vector<int> routed2 = routed_sizes(2, 4096, 256, 8, 17), routed1 = routed_sizes(1, 4096, 256, 8, 18);
    run("dsv3_fc1_routed_2ranks_k7168_n4096", routed2, 7168, 4096, hbm, true, 16);
    run("dsv3_fc2_routed_2ranks_k2048_n7168", routed2, 2048, 7168, hbm, true, 16);
    run("dsv3_fc1_routed_1rank_k7168_n4096", routed1, 7168, 4096, hbm, false, 16);
    if (g_forward_only || g_fp8_only) {  // the one-GPU DeepSeek-V3 layer's shapes too: 256 experts, ~128 rows each
      run("dsv3_fc1_256x128_k7168_n4096", std::vector<int>(256, 128), 7168, 4096, hbm, true);
      run("dsv3_fc2_256x128_k2048_n7168", std::vector<int>(256, 128), 2048, 7168, hbm, true);
    }
    if (const std::string unknown = unknown_cases(); !unknown.empty()) throw std::runtime_error(unknown);
    if (g_fp8_only || g_forward_only) return 0;
    run_wgrad_variants("dsv3_fc1_128x256_k7168_n4096", std::vector<int>(128, 256), 7168, 4096);
    run_wgrad_variants("dsv3_fc2_128x256_k2048_n7168", std::vector<int>(128, 256), 2048, 7168);
    run_wgrad_variants("32x1024_k7168_n2048", std::vector<int>(32, 1024), 7168, 2048);
    run_wgrad_variants("dsv3_fc1_routed_2ranks_k7168_n4096", routed2, 7168, 4096);
    run_wgrad_variants("dsv3_fc2_routed_2ranks_k2048_n7168", routed2, 2048, 7168);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_grouped_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
