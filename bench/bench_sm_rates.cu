// How many bytes a second n SMs move through HBM in the two shapes of work the EP ops do on the
// receiving side, so that an SM budget's figures can be read against a ceiling:
//  - "expand_1_to_4": each source row read once and written to 4 scattered rows (the dispatch's
//    expansion to the expert-major layout), by 16-byte register copies (8 vectors a lane in flight)
//    or by bulk copies (one global -> shared load per row, then one shared -> global store per
//    destination, `stages` rows in flight per warp);
//  - "reduce_4_to_1": 4 scattered rows read and summed into one (the combine's partials), by
//    register loads, `unroll` vectors of each of the 4 rows per lane in flight before the adds;
//  - "reduce_2_to_1": the same with 2 rows (the combine's sums of two ranks' partials).
// Rows of --row-bytes (default 14336: H = 7168 in bf16), --rows source rows (default 8192: what one
// of two ranks receives at T = 4096). One CTA per SM (its dynamic shared memory leaves no room for a
// second), so `sms` CTAs occupy exactly that many SMs. Bytes counted: read + written.
//
// usage: bench_sm_rates [--rows N] [--row-bytes B]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "bench/bench_util.h"
#include "core/device_memory.h"
#include "cuda/permute/permute_bulk.cuh"

using namespace epx;
using epx::bench::JsonLine;
namespace bulk = epx::cuda::permute::bulk;

namespace {

constexpr int kFan = 4;
constexpr int kMaxStages = 8;
// Dynamic shared memory of the register kernels: more than half an SM's, so one CTA per SM.
constexpr int kOneCtaSmem = 150 * 1024;

template <int U>
__global__ void expand_regs_kernel(const char* src, char* dst, const int* map, int rows, int row_bytes) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int n = row_bytes / 16;
  for (int r = blockIdx.x * warps + warp; r < rows; r += gridDim.x * warps) {
    const uint4* s = reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * row_bytes);
    for (int v0 = lane; v0 < n; v0 += 32 * U) {
      uint4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * 32 < n) x[u] = s[v0 + u * 32];
#pragma unroll
      for (int k = 0; k < kFan; ++k) {
        uint4* d = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(map[r * kFan + k]) * row_bytes);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v0 + u * 32 < n) d[v0 + u * 32] = x[u];
      }
    }
  }
}

// Each warp keeps `stages` rows in flight (stages >= 2): lane 0 loads a row into a stage, lanes < kFan
// store it to their destination rows; a stage is refilled once the stores of the row before have read it.
__global__ void expand_bulk_kernel(const char* src, char* dst, const int* map, int rows, int row_bytes, int stages) {
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * kMaxStages;
  char* stage0 = smem + 1024 + static_cast<size_t>(warp) * stages * row_bytes;
  if (lane == 0)
    for (int s = 0; s < stages; ++s) bulk::mbar_init(bars + s, 1);
  bulk::fence_proxy_async();
  __syncwarp();
  const int first = blockIdx.x * warps + warp, step = gridDim.x * warps;
  auto load = [&](int s, int r) {
    bulk::mbar_arrive_expect_tx(bars + s, row_bytes);
    bulk::load_async(stage0 + static_cast<size_t>(s) * row_bytes, src + static_cast<int64_t>(r) * row_bytes, row_bytes,
                     bars + s);
  };
  for (int s = 0; s < stages && lane == 0; ++s)
    if (first + s * step < rows) load(s, first + s * step);
  uint32_t parity = 0;  // bit s: the phase stage s waits for next
  int i = 0;
  for (int r = first; r < rows; r += step, ++i) {
    const int s = i % stages;
    bulk::mbar_wait(bars + s, parity >> s & 1u);
    parity ^= 1u << s;
    if (lane < kFan) {
      bulk::store_async(dst + static_cast<int64_t>(map[r * kFan + lane]) * row_bytes,
                        stage0 + static_cast<size_t>(s) * row_bytes, row_bytes);
      bulk::commit();
    }
    if (i > 0) {
      if (lane < kFan) bulk::wait_read<1>();
      __syncwarp();
      const int next = r - step + stages * step;
      if (lane == 0 && next < rows) load((i - 1) % stages, next);
    }
  }
  if (lane < kFan) bulk::wait_all();
}

// kIn of the 4 mapped rows of each output row (4: a partial's rows, 2: a sum's two partials).
template <int kIn, int U>
__global__ void reduce_regs_kernel(const char* src, char* dst, const int* map, int rows, int row_bytes) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int n = row_bytes / 16;
  for (int r = blockIdx.x * warps + warp; r < rows; r += gridDim.x * warps) {
    uint4* d = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(r) * row_bytes);
    for (int v0 = lane; v0 < n; v0 += 32 * U) {
      uint4 x[kIn][U];
#pragma unroll
      for (int k = 0; k < kIn; ++k) {
        const uint4* s = reinterpret_cast<const uint4*>(src + static_cast<int64_t>(map[r * kFan + k]) * row_bytes);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v0 + u * 32 < n) x[k][u] = s[v0 + u * 32];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        uint4 acc = x[0][u];
#pragma unroll
        for (int k = 1; k < kIn; ++k) {
          acc.x += x[k][u].x;
          acc.y += x[k][u].y;
          acc.z += x[k][u].z;
          acc.w += x[k][u].w;
        }
        if (v0 + u * 32 < n) d[v0 + u * 32] = acc;
      }
    }
  }
}

// One register-load sum shape: its kernel, the vectors of each row a lane loads before adding, and
// the bytes one call moves.
struct RegisterSum {
  const char* op;
  int unroll;
  void (*kernel)(const char*, char*, const int*, int, int);
  double bytes;
};

void report(const char* op, const char* kind, int sms, int warps, int depth, double us, double bytes, double hbm) {
  const double bps = bytes / (us * 1e-6);
  JsonLine()
      .add("bench", "sm_rates")
      .add("op", op)
      .add("kind", kind)
      .add("sms", sms)
      .add("warps", warps)
      .add(std::strcmp(kind, "bulk") == 0 ? "stages" : "unroll", depth)
      .add("us", us)
      .add("gbps", bps * 1e-9)
      .add("gbps_per_sm", bps * 1e-9 / sms)
      .add("fraction_of_hbm", bps / hbm)
      .print();
}

}  // namespace

int main(int argc, char** argv) {
  int rows = 8192, row_bytes = 14336;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rows")) rows = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--row-bytes")) row_bytes = std::atoi(argv[i + 1]);
  }
  if (rows <= 0 || row_bytes <= 0 || row_bytes % 16 != 0) {
    std::fprintf(stderr,
                 "bench_sm_rates: --rows is %d (expected > 0), --row-bytes %d (expected a positive multiple of 16)\n",
                 rows, row_bytes);
    return 2;
  }
  try {
    bench::BenchDevice dev;
    if (!bench::open_bench_device("sm_rates", dev)) return 0;
    const cudaDeviceProp& prop = dev.prop;
    const double hbm = dev.hbm;
    bench::device_line("sm_rates", dev).add("rows", rows).add("row_bytes", row_bytes).print();
    const size_t src_bytes = static_cast<size_t>(rows) * row_bytes;
    char *src = nullptr, *dst = nullptr;
    int* map = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&src, src_bytes));
    EPX_CUDA_CHECK(cudaMalloc(&dst, src_bytes * kFan));
    EPX_CUDA_CHECK(cudaMemset(src, 1, src_bytes));
    EPX_CUDA_CHECK(cudaMemset(dst, 1, src_bytes * kFan));
    std::vector<int> h(static_cast<size_t>(rows) * kFan);
    std::iota(h.begin(), h.end(), 0);
    std::shuffle(h.begin(), h.end(), std::mt19937(1));  // scattered destination rows, each once
    EPX_CUDA_CHECK(cudaMalloc(&map, h.size() * sizeof(int)));
    EPX_CUDA_CHECK(cudaMemcpy(map, h.data(), h.size() * sizeof(int), cudaMemcpyHostToDevice));
    const auto smem_attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    EPX_CUDA_CHECK(cudaFuncSetAttribute(expand_regs_kernel<8>, smem_attr, kOneCtaSmem));
    EPX_CUDA_CHECK(cudaFuncSetAttribute(expand_bulk_kernel, smem_attr, static_cast<int>(prop.sharedMemPerBlockOptin)));
    const double bytes = static_cast<double>(src_bytes) * (1 + kFan);
    const double sum_bytes = static_cast<double>(src_bytes) * 3;  // two rows read, one written
    const RegisterSum sums[] = {{"reduce_4_to_1", 1, reduce_regs_kernel<4, 1>, bytes},
                                {"reduce_4_to_1", 2, reduce_regs_kernel<4, 2>, bytes},
                                {"reduce_2_to_1", 2, reduce_regs_kernel<2, 2>, sum_bytes},
                                {"reduce_2_to_1", 4, reduce_regs_kernel<2, 4>, sum_bytes}};
    for (const RegisterSum& r : sums) EPX_CUDA_CHECK(cudaFuncSetAttribute(r.kernel, smem_attr, kOneCtaSmem));
    auto time = [](const std::function<void()>& launch) {
      return bench::time_us([&](int) { launch(); }, 10, 5, 2);
    };
    for (int n : {8, 16, 24, 32, 64, prop.multiProcessorCount}) {
      if (n > prop.multiProcessorCount) continue;
      for (int warps : {16, 32}) {
        const int threads = warps * 32;
        report("expand_1_to_4", "registers", n, warps, 8,
               time([&] { expand_regs_kernel<8><<<n, threads, kOneCtaSmem>>>(src, dst, map, rows, row_bytes); }), bytes,
               hbm);
        for (const RegisterSum& r : sums)
          report(r.op, "registers", n, warps, r.unroll,
                 time([&] { r.kernel<<<n, threads, kOneCtaSmem>>>(dst, src, map, rows, row_bytes); }), r.bytes, hbm);
      }
      for (const std::pair<int, int>& ws : std::vector<std::pair<int, int>>{{1, 4}, {2, 4}, {2, 7}, {4, 3}, {8, 2}}) {
        const int warps = ws.first, stages = ws.second;
        const size_t smem = 1024 + static_cast<size_t>(warps) * stages * row_bytes;
        if (smem > prop.sharedMemPerBlockOptin) continue;
        report("expand_1_to_4", "bulk", n, warps, stages, time([&] {
                 expand_bulk_kernel<<<n, warps * 32, smem>>>(src, dst, map, rows, row_bytes, stages);
               }),
               bytes, hbm);
      }
    }
    EPX_CUDA_CHECK(cudaGetLastError());
    cudaFree(src);
    cudaFree(dst);
    cudaFree(map);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sm_rates: %s\n", e.what());
    return 1;
  }
  return 0;
}
