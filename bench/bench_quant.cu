// Benchmark of the quantization kernels through the public API (epx::quantize / dequantize on
// device tensors): time per call (median, inputs rotated past the L2), bytes moved = bytes read +
// bytes written (x, q and scales; q, scales and x_out for dequantize), and that figure as a
// fraction of the device-to-device copy bandwidth measured in the same run. The target is >= 75%
// of it for the activation recipes (fp8_block_1x128 and mxfp8_rowwise, bf16 input) at
// [32768, 7168] (4096 tokens x top-8) and [4096, 7168]. Each case also checks its first rows bit
// for bit against the CPU reference ("check" field), so a fast wrong kernel cannot pass unnoticed.
// Output: one JSON line per case, then a table.
//   bench_quant [--quick] [--sweep]
//     --quick: only [4096, 7168]
//     --sweep: also time the row-recipe and dequantize kernels with each rows_per_thread setting
//              (epx::cuda launchers called directly with QuantTuning), marked "variant" in the output
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/device_memory.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_cuda.cuh"
#include "cuda/quant/quant.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace {

using namespace epx;

__device__ __forceinline__ uint32_t mix(uint64_t v) {
  v ^= v >> 33;
  v *= 0xff51afd7ed558ccdull;
  v ^= v >> 33;
  v *= 0xc4ceb9fe1a85ec53ull;
  v ^= v >> 33;
  return static_cast<uint32_t>(v);
}

// Roughly normal values (sum of four uniforms) with an exponent per 5 x 40 region in [-20, 20]
// and one exact zero in 17: real data, not zeros (which could run faster).
template <class T>
__global__ void fill_kernel(T* x, int64_t M, int64_t N, uint32_t seed) {
  const int64_t total = M * N;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / N, j = k % N;
    const uint32_t h = mix(static_cast<uint64_t>(k) * 2654435761ull + seed);
    const uint32_t h2 = mix(static_cast<uint64_t>(k) ^ (static_cast<uint64_t>(seed) << 32));
    const float u = ((h & 0xffff) + (h >> 16) + (h2 & 0xffff) + (h2 >> 16)) * (1.0f / 65536.0f) - 2.0f;
    const int e = static_cast<int>(mix(static_cast<uint64_t>(i / 5) * 1000003ull + j / 40 + seed) % 41) - 20;
    const float v = (h % 17 == 0) ? 0.0f : ldexpf(u, e);
    x[k] = epx::cuda::from_float<T>(v);
  }
}

void fill(const TensorRef& x, uint32_t seed) {
  const int64_t M = x.size(0), N = x.size(1);
  const int blocks = 132 * 8;
  switch (x.dtype()) {
    case DType::kF32: fill_kernel<float><<<blocks, 256>>>(x.ptr<float>(), M, N, seed); break;
    case DType::kBF16: fill_kernel<__nv_bfloat16><<<blocks, 256>>>(x.ptr<__nv_bfloat16>(), M, N, seed); break;
    case DType::kF16: fill_kernel<__half><<<blocks, 256>>>(x.ptr<__half>(), M, N, seed); break;
    default: break;
  }
  EPX_CHECK_LAUNCH("fill_kernel");
}

// Device-to-device copy bandwidth of a 1 GiB buffer of random bits (bytes read + written per
// second): bench_util's ceiling copies memset bytes; this shows whether the data's entropy moves it.
double measure_random_copy_bytes_per_s() {
  const int64_t n = (int64_t(1) << 30) / 4;
  Tensor src = Tensor::empty({n / 7168, 7168}, DType::kF32, Device::cuda(0));
  Tensor dst = Tensor::empty({n / 7168, 7168}, DType::kF32, Device::cuda(0));
  fill(src, 4242u);
  const double us = bench::time_us(
      [&](int) { EPX_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice)); }, 5, 5, 2);
  return 2.0 * static_cast<double>(src.nbytes()) / (us * 1e-6);
}

struct Row {
  std::string op, recipe, dtype;
  int64_t M, N;
  double us, gbps, frac;
  bool ok;
};

// Rows of the leading dimension that form whole scale blocks for every recipe (128x128 and colwise
// need multiples of 128 / 32) and are therefore quantized independently of the rest.
int64_t check_rows(int64_t M) { return std::min<int64_t>(M, 256); }

bool same_bytes(const TensorRef& a_dev, const Tensor& b_host) {
  Tensor a = Tensor::empty(a_dev.shape(), a_dev.dtype());
  copy(a_dev, a);
  return a.nbytes() == b_host.nbytes() && std::memcmp(a.data(), b_host.data(), a.nbytes()) == 0;
}

int64_t scale_rows_for(QuantRecipe r, int64_t rows) {
  return quant_scale_shape(r, rows, 1)[0];
}

Row bench_quantize(QuantRecipe r, E8M0Rounding mode, DType t, int64_t M, int64_t N, double hbm,
                  const cuda::QuantTuning* tuning = nullptr) {
  const Shape ss = quant_scale_shape(r, M, N);
  const size_t set_bytes = static_cast<size_t>(M * N) * (dtype_size(t) + 1) + ss.numel() * dtype_size(quant_scale_dtype(r));
  const int rot = bench::rotation_for(set_bytes);
  std::vector<Tensor> X, Q, S;
  for (int k = 0; k < rot; ++k) {
    X.push_back(Tensor::empty({M, N}, t, Device::cuda(0)));
    Q.push_back(Tensor::empty({M, N}, DType::kF8E4M3, Device::cuda(0)));
    S.push_back(Tensor::empty(ss, quant_scale_dtype(r), Device::cuda(0)));
    fill(X.back(), 1234u + 77u * k);
  }
  QuantOptions opt;
  opt.mx_rounding = mode;
  const double us = bench::time_us([&](int i) {
    if (tuning) cuda::quantize(r, X[i % rot], Q[i % rot], S[i % rot], mode, Stream{}, *tuning);
    else quantize(r, X[i % rot], Q[i % rot], S[i % rot], opt);
  });

  // Correctness of the timed kernel on its first rows (set 0, last written by the timed calls).
  const int64_t cr = check_rows(M);
  Tensor xh = Tensor::empty({cr, N}, t);
  copy(X[0].ref().slice_rows(0, cr), xh);
  Tensor qh = Tensor::empty({cr, N}, DType::kF8E4M3);
  Tensor sh = Tensor::empty(quant_scale_shape(r, cr, N), quant_scale_dtype(r));
  quantize(r, xh, qh, sh, opt);
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  const bool ok = same_bytes(Q[0].ref().slice_rows(0, cr), qh) &&
                  same_bytes(S[0].ref().slice_rows(0, scale_rows_for(r, cr)), sh);

  const double bytes = static_cast<double>(set_bytes);
  Row row{"quantize", quant_recipe_name(r), dtype_name(t), M, N, us, bytes / (us * 1e-6) / 1e9, bytes / (us * 1e-6) / hbm, ok};
  if (r == QuantRecipe::kMxfp8Rowwise || r == QuantRecipe::kMxfp8Colwise)
    row.recipe += mode == E8M0Rounding::kCeil ? "/ceil" : "/floor";
  const std::string variant = tuning ? "rows_per_thread=" + std::to_string(tuning->rows_per_thread) : "default";
  if (tuning) row.recipe += " r" + std::to_string(tuning->rows_per_thread);
  bench::JsonLine()
      .add("bench", "quant")
      .add("op", row.op)
      .add("variant", variant)
      .add("recipe", quant_recipe_name(r))
      .add("mx_rounding", mode == E8M0Rounding::kCeil ? "ceil" : "floor")
      .add("dtype", row.dtype)
      .add("M", static_cast<long long>(M))
      .add("N", static_cast<long long>(N))
      .add("us", us)
      .add("bytes", bytes)
      .add("GBps", row.gbps)
      .add("hbm_GBps", hbm / 1e9)
      .add("frac_hbm", row.frac)
      .add("rotation", rot)
      .add("check", ok ? "bit_exact_first_rows" : "MISMATCH")
      .print();
  return row;
}

Row bench_dequantize(QuantRecipe r, DType out_t, int64_t M, int64_t N, double hbm,
                    const cuda::QuantTuning* tuning = nullptr) {
  const Shape ss = quant_scale_shape(r, M, N);
  const DType sd = quant_scale_dtype(r);
  const size_t set_bytes = static_cast<size_t>(M * N) * (dtype_size(out_t) + 1) + ss.numel() * dtype_size(sd);
  const int rot = bench::rotation_for(set_bytes);
  std::vector<Tensor> Q, S, O;
  for (int k = 0; k < rot; ++k) {
    // Real codes and scales: quantize filled bf16 data once (outside the timing).
    Tensor x = Tensor::empty({M, N}, DType::kBF16, Device::cuda(0));
    fill(x, 999u + 13u * k);
    Q.push_back(Tensor::empty({M, N}, DType::kF8E4M3, Device::cuda(0)));
    S.push_back(Tensor::empty(ss, sd, Device::cuda(0)));
    O.push_back(Tensor::empty({M, N}, out_t, Device::cuda(0)));
    quantize(r, x, Q.back(), S.back());
  }
  const double us = bench::time_us([&](int i) {
    if (tuning) cuda::dequantize(r, Q[i % rot], S[i % rot], O[i % rot], Stream{}, *tuning);
    else dequantize(r, Q[i % rot], S[i % rot], O[i % rot]);
  });

  const int64_t cr = check_rows(M);
  Tensor qh = Tensor::empty({cr, N}, DType::kF8E4M3);
  copy(Q[0].ref().slice_rows(0, cr), qh);
  Tensor sh = Tensor::empty(quant_scale_shape(r, cr, N), sd);
  copy(S[0].ref().slice_rows(0, scale_rows_for(r, cr)), sh);
  Tensor oh = Tensor::empty({cr, N}, out_t);
  dequantize(r, qh, sh, oh);
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  const bool ok = same_bytes(O[0].ref().slice_rows(0, cr), oh);  // filled data has no NaN

  const double bytes = static_cast<double>(set_bytes);
  Row row{"dequantize", quant_recipe_name(r), dtype_name(out_t), M, N, us, bytes / (us * 1e-6) / 1e9,
          bytes / (us * 1e-6) / hbm, ok};
  const std::string variant = tuning ? "rows_per_thread=" + std::to_string(tuning->rows_per_thread) : "default";
  if (tuning) row.recipe += " r" + std::to_string(tuning->rows_per_thread);
  bench::JsonLine()
      .add("bench", "quant")
      .add("op", row.op)
      .add("variant", variant)
      .add("recipe", row.recipe)
      .add("dtype", row.dtype)
      .add("M", static_cast<long long>(M))
      .add("N", static_cast<long long>(N))
      .add("us", us)
      .add("bytes", bytes)
      .add("GBps", row.gbps)
      .add("hbm_GBps", hbm / 1e9)
      .add("frac_hbm", row.frac)
      .add("rotation", rot)
      .add("check", ok ? "bit_exact_first_rows" : "MISMATCH")
      .print();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, sweep = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--sweep") == 0) {
      sweep = true;
    } else {
      std::fprintf(stderr, "bench_quant: unknown option '%s' (accepted: --quick, --sweep)\n", argv[i]);
      return 2;
    }
  }
  try {
    epx::bench::BenchDevice dev;
    if (!epx::bench::open_bench_device("quant", dev)) return 0;
    const cudaDeviceProp& prop = dev.prop;
    const double hbm = dev.hbm;
    const double hbm_random = measure_random_copy_bytes_per_s();
    std::printf("{\"bench\":\"quant\",\"device\":\"%s\",\"sms\":%d,\"hbm_copy_GBps\":%.1f,\"random_copy_GBps\":%.1f}\n",
                prop.name, prop.multiProcessorCount, hbm / 1e9, hbm_random / 1e9);

    std::vector<std::pair<int64_t, int64_t>> shapes = {{4096, 7168}};
    if (!quick) shapes.insert(shapes.begin(), {32768, 7168});
    const epx::QuantRecipe recipes[] = {epx::QuantRecipe::kFp8Block1x128, epx::QuantRecipe::kMxfp8Rowwise,
                                        epx::QuantRecipe::kFp8Block128x128, epx::QuantRecipe::kMxfp8Colwise};
    std::vector<Row> rows;
    for (auto [M, N] : shapes) {
      for (epx::QuantRecipe r : recipes)
        rows.push_back(bench_quantize(r, epx::E8M0Rounding::kFloor, epx::DType::kBF16, M, N, hbm));
      rows.push_back(bench_quantize(epx::QuantRecipe::kMxfp8Rowwise, epx::E8M0Rounding::kCeil, epx::DType::kBF16, M, N, hbm));
      for (epx::QuantRecipe r : recipes) rows.push_back(bench_quantize(r, epx::E8M0Rounding::kFloor, epx::DType::kF32, M, N, hbm));
      for (epx::QuantRecipe r : recipes) rows.push_back(bench_dequantize(r, epx::DType::kBF16, M, N, hbm));
      if (!sweep) continue;
      for (int rpt : {4, 8}) {
        epx::cuda::QuantTuning tu;
        tu.rows_per_thread = rpt;
        for (epx::QuantRecipe r : {epx::QuantRecipe::kFp8Block1x128, epx::QuantRecipe::kMxfp8Rowwise})
          rows.push_back(bench_quantize(r, epx::E8M0Rounding::kFloor, epx::DType::kBF16, M, N, hbm, &tu));
        for (epx::QuantRecipe r : recipes) rows.push_back(bench_dequantize(r, epx::DType::kBF16, M, N, hbm, &tu));
      }
    }

    bool all_ok = true, target_met = true;
    std::printf("\n%-11s %-27s %-5s %-13s %10s %9s %7s  %s\n", "op", "recipe", "dtype", "shape", "us", "GB/s", "%HBM",
                "check");
    for (const Row& r : rows) {
      char shape[32];
      std::snprintf(shape, sizeof shape, "%lldx%lld", static_cast<long long>(r.M), static_cast<long long>(r.N));
      std::printf("%-11s %-27s %-5s %-13s %10.1f %9.1f %6.1f%%  %s\n", r.op.c_str(), r.recipe.c_str(), r.dtype.c_str(),
                  shape, r.us, r.gbps, 100 * r.frac, r.ok ? "ok" : "MISMATCH");
      all_ok = all_ok && r.ok;
      const bool variant = r.recipe.find(" r") != std::string::npos;
      const bool activation = !variant && r.op == "quantize" && r.dtype == "bf16" &&
                              (r.recipe == "fp8_block_1x128" || r.recipe.rfind("mxfp8_rowwise", 0) == 0);
      if (activation && r.frac < 0.75) target_met = false;
    }
    std::printf("copy of random data %.1f GB/s (%.1f%% of the memset-data copy used as the ceiling)\n", hbm_random / 1e9,
                100 * hbm_random / hbm);
    std::printf("HBM copy %.1f GB/s; activation-recipe target (>= 75%% of it): %s; checks: %s\n", hbm / 1e9,
                target_met ? "met" : "NOT met", all_ok ? "all bit-exact" : "MISMATCH");
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_quant: %s\n", e.what());
    return 1;
  }
}
