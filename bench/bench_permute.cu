// One-GPU layout and row movement: prepare (device-side routing layout), dispatch (permute into
// the expert-major layout), combine (weighted unpermute), and both backwards, on a one-rank group.
// JSON lines: shape, median time, bytes moved (each input read once, each output written once),
// GB/s and the fraction of the HBM bandwidth measured in the same run.
//
// Dispatch kernels alone (op "permute", on a prepared handle, no prepare in the timing): the warp
// kernel (register copy, the kernel of the earlier measurements) and the bulk kernel (shared-memory
// stages, bulk copies), each for bf16 rows and for pre-quantized fp8 rows with their scales; then
// quantize-while-permuting (op "quantize_permute", fused, with bulk or lane stores) beside
// quantize followed by the fp8 permute (op "quantize_then_permute", unfused). overhead_vs_permute is
// the fused time over the fastest fp8 permute of the same recipe, minus 1: what quantizing on the
// way costs beyond moving the quantized bytes. The fused kernel also reads x in bf16 (2H bytes a
// token instead of H + scales), so at K = 8 its byte floor (byte_floor_overhead) is already ~10%;
// vs_bf16_permute compares with the bf16 permute it replaces.
//
// usage: bench_permute [--tokens T] [--hidden H] [--experts E] [--topk K] [--align A]
//        (default: the sweep; with --tokens only that shape)
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/ep_state.h"
#include "cuda/permute/permute.h"
#include "cuda/quant/quant.h"
#include "epx/comm.h"
#include "epx/layout.h"
#include "epx/quant.h"

using namespace epx;
using bench::JsonLine;

namespace {

Tensor device_fill(Shape s, DType dt, float v) { return Tensor::full(s, dt, v).to(Device::cuda(0)); }

void run_shape(int T, int H, int E, int K, double hbm) {
  GroupConfig cfg;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.max_tokens_per_rank = T;
  cfg.max_topk = K;
  cfg.align = 1;
  Group g = Group::create_local(cfg, 0);
  const int64_t cap = g.recv_capacity_rows();
  Tensor idx = bench::random_expert_ids(T, E, K, 7, Device::cuda(0));
  Tensor w = device_fill({T, K}, DType::kF32, 0.125f);
  Tensor x = device_fill({T, H}, DType::kBF16, 1.5f);
  Tensor recv = Tensor::empty({cap, H}, DType::kBF16, Device::cuda(0));
  Tensor rw = Tensor::empty({cap}, DType::kF32, Device::cuda(0));
  Tensor out = Tensor::empty({T, H}, DType::kBF16, Device::cuda(0));
  Tensor d_y = Tensor::empty({cap, H}, DType::kBF16, Device::cuda(0));
  Tensor d_rw = Tensor::empty({cap}, DType::kF32, Device::cuda(0));
  Tensor d_x = Tensor::empty({T, H}, DType::kBF16, Device::cuda(0));
  Tensor d_tw = Tensor::empty({T, K}, DType::kF32, Device::cuda(0));
  const double row = 2.0 * H, pairs = static_cast<double>(T) * K;

  auto report = [&](const char* op, double us, double bytes) {
    JsonLine()
        .add("impl", "epx")
        .add("op", op)
        .add("tokens", T)
        .add("hidden", H)
        .add("experts", E)
        .add("topk", K)
        .add("dtype", "bf16")
        .add("time_us", us)
        .add("bytes", bytes)
        .add("gb_per_s", bytes / us * 1e-3)
        .add("hbm_fraction", bytes / (us * 1e-6) / hbm)
        .print();
  };

  const double t_prepare = bench::time_us([&](int) { Handle h = prepare(g, idx, w); });
  report("prepare", t_prepare, pairs * 4 * 4 + static_cast<double>(T) * 4 * 2);

  Handle h = prepare(g, idx, w);
  // dispatch needs a fresh handle per call (a handle is dispatched once): prepare is inside, and
  // reported separately above; the row copy alone is dispatch - prepare.
  const double t_both = bench::time_us([&](int) {
    Handle hh = prepare(g, idx, w);
    dispatch_forward(g, hh, x, w, recv, rw);
  });
  report("dispatch_local", t_both - t_prepare, row * T + row * pairs + pairs * 8);
  dispatch_forward(g, h, x, w, recv, rw);
  report("combine_local", bench::time_us([&](int) { combine_forward(g, h, recv, rw, out); }),
         row * pairs + pairs * 4 + row * T);
  report("combine_backward_local",
         bench::time_us([&](int) { combine_backward(g, h, out, recv, rw, d_y, d_rw); }),
         row * T + 2 * row * pairs + pairs * 8);
  report("dispatch_backward_local", bench::time_us([&](int) { dispatch_backward(g, h, d_y, d_rw, d_x, d_tw); }),
         row * pairs + pairs * 4 + row * T + pairs * 4);
  g.check();
}

// Dispatch kernels alone, and quantize-while-permuting against its two alternatives.
void run_kernels(int T, int H, int E, int K, int align, double hbm) {
  using cuda::PermuteKernel;
  GroupConfig cfg;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.max_tokens_per_rank = T;
  cfg.max_topk = K;
  cfg.align = align;
  Group g = Group::create_local(cfg, 0);
  const int64_t cap = g.recv_capacity_rows();
  const Device dev = Device::cuda(0);
  Tensor idx = bench::random_expert_ids(T, E, K, 7, dev);
  Tensor w = device_fill({T, K}, DType::kF32, 0.125f);
  // Random bf16 rows (a constant row would make every block's amax the same): random sign and
  // mantissa, exponents 2^-7 .. 2^8, straight from a xorshift (fast for 117M elements).
  Tensor xh = Tensor::empty({T, H}, DType::kBF16);
  {
    uint64_t r = 0x9E3779B97F4A7C15ull;
    uint16_t* b = xh.ptr<uint16_t>();
    for (int64_t i = 0; i < xh.numel(); ++i) {
      r ^= r << 13;
      r ^= r >> 7;
      r ^= r << 17;
      b[i] = static_cast<uint16_t>(((r >> 20) & 0x8000u) | ((120u + (r >> 40) % 16u) << 7) | ((r >> 8) & 0x7Fu));
    }
  }
  Tensor x = xh.to(dev);
  Tensor recv = Tensor::empty({cap, H}, DType::kBF16, dev);
  Tensor rq = Tensor::empty({cap, H}, DType::kF8E4M3, dev);
  Tensor rw = Tensor::empty({cap}, DType::kF32, dev);
  Handle h = prepare(g, idx, w);
  g.check();
  HandleState& hs = h.state();
  const double pairs = static_cast<double>(T) * K;
  const double meta = pairs * 8;  // recv_row and recv_weights written (routing reads are L2 hits)

  auto line = [&](const char* op, const char* kernel, const char* payload, double us, double bytes) {
    JsonLine l;
    l.add("impl", "epx")
        .add("op", op)
        .add("kernel", kernel)
        .add("payload", payload)
        .add("tokens", T)
        .add("hidden", H)
        .add("experts", E)
        .add("topk", K)
        .add("align", align)
        .add("time_us", us)
        .add("bytes", bytes)
        .add("gb_per_s", bytes / us * 1e-3)
        .add("hbm_fraction", bytes / (us * 1e-6) / hbm);
    return l;
  };
  auto tuning_of = [](PermuteKernel k) {
    cuda::PermuteTuning t;
    t.kernel = k;
    return t;
  };

  // bf16 permute: warp (the previous kernel's design) and bulk.
  const double bf16_bytes = 2.0 * H * T + 2.0 * H * pairs + meta;
  double t_bf16[2] = {0, 0};
  for (PermuteKernel k : {PermuteKernel::kWarp, PermuteKernel::kBulk}) {
    const cuda::PermuteTuning tu = tuning_of(k);
    const double us = bench::time_us(
        [&](int) { cuda::permute_forward(hs, x, {}, w, recv, {}, rw, cap, align, Stream{}, tu); });
    t_bf16[k == PermuteKernel::kBulk] = us;
    line("permute", cuda::permute_kernel_name(k), "bf16", us, bf16_bytes).print();
  }
  JsonLine()
      .add("impl", "epx")
      .add("op", "permute_bulk_vs_warp")
      .add("tokens", T)
      .add("hidden", H)
      .add("speedup", t_bf16[0] / t_bf16[1])
      .print();

  for (QuantRecipe r : {QuantRecipe::kFp8Block1x128, QuantRecipe::kMxfp8Rowwise}) {
    const char* rn = quant_recipe_name(r);
    const Shape ss = quant_scale_shape(r, T, H), rss = quant_scale_shape(r, cap, H);
    const DType sdt = quant_scale_dtype(r);
    const double sb = static_cast<double>(ss[1]) * dtype_size(sdt);
    Tensor q = Tensor::empty({T, H}, DType::kF8E4M3, dev), qs = Tensor::empty(ss, sdt, dev);
    Tensor rs = Tensor::empty(rss, sdt, dev);
    quantize(r, x, q, qs);
    // fp8 rows + scales already quantized: the permute the fused kernel is measured against.
    const double fp8_bytes = (H + sb) * T + (H + sb) * pairs + meta;
    double t_fp8 = 1e30;
    for (PermuteKernel k : {PermuteKernel::kWarp, PermuteKernel::kBulk}) {
      const cuda::PermuteTuning tu = tuning_of(k);
      const double us = bench::time_us(
          [&](int) { cuda::permute_forward(hs, q, qs, w, rq, rs, rw, cap, align, Stream{}, tu); });
      t_fp8 = std::min(t_fp8, us);
      line("permute", cuda::permute_kernel_name(k), rn, us, fp8_bytes).print();
    }
    // Unfused: quantize, then the fp8 permute (default kernel).
    const double quant_bytes = 2.0 * H * T + (H + sb) * T;
    const double t_quant = bench::time_us([&](int) { cuda::quantize(r, x, q, qs, E8M0Rounding::kFloor, Stream{}); });
    line("quantize", "quant_rowwise", rn, t_quant, quant_bytes).print();
    const double t_unfused = bench::time_us([&](int) {
      cuda::quantize(r, x, q, qs, E8M0Rounding::kFloor, Stream{});
      cuda::permute_forward(hs, q, qs, w, rq, rs, rw, cap, align, Stream{});
    });
    line("quantize_then_permute", "unfused", rn, t_unfused, quant_bytes + fp8_bytes).print();
    // Fused.
    const double fused_bytes = 2.0 * H * T + (H + sb) * pairs + meta;
    for (PermuteKernel k : {PermuteKernel::kBulk, PermuteKernel::kWarp})
      for (cuda::QuantizeSchedule sched : {cuda::QuantizeSchedule::kBatched, cuda::QuantizeSchedule::kPipelined,
                                           cuda::QuantizeSchedule::kPipelinedOneStage}) {
        cuda::PermuteTuning tu = tuning_of(k);
        tu.quantize_schedule = sched;
        const double us = bench::time_us([&](int) {
          cuda::permute_quantize_forward(hs, r, E8M0Rounding::kFloor, x, w, rq, rs, rw, cap, align, Stream{}, tu);
        });
        line("quantize_permute", k == PermuteKernel::kBulk ? "fused_bulk_stores" : "fused_lane_stores", rn, us,
             fused_bytes)
            .add("schedule", cuda::quantize_schedule_name(sched))
            .add("overhead_vs_permute", us / t_fp8 - 1.0)
            .add("byte_floor_overhead", fused_bytes / fp8_bytes - 1.0)
            .add("vs_bf16_permute", us / std::min(t_bf16[0], t_bf16[1]))
            .add("speedup_vs_unfused", t_unfused / us)
            .print();
      }
  }
  g.check();
}

}  // namespace

int main(int argc, char** argv) {
  int T = 0, H = 0, E = 0, K = 0, align = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--tokens")) T = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--hidden")) H = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--experts")) E = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--topk")) K = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--align")) align = std::atoi(argv[i + 1]);
  }
  try {
    bench::BenchDevice dev;
    if (!bench::open_bench_device("permute", dev)) return 0;
    const double hbm = dev.hbm;
    JsonLine().add("impl", "epx").add("op", "hbm_copy").add("gb_per_s", hbm * 1e-9).print();
    if (T) {
      run_shape(T, H ? H : 7168, E ? E : 256, K ? K : 8, hbm);
      run_kernels(T, H ? H : 7168, E ? E : 256, K ? K : 8, align, hbm);
    } else {
      run_shape(4096, 7168, 256, 8, hbm);
      run_shape(16384, 7168, 256, 8, hbm);
      run_shape(4096, 4096, 64, 8, hbm);
      run_shape(128, 7168, 256, 8, hbm);
      run_kernels(4096, 7168, 256, 8, align, hbm);
      run_kernels(16384, 7168, 256, 8, align, hbm);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_permute: %s\n", e.what());
    return 1;
  }
  return 0;
}
