// Benchmark plumbing: event timing (median over repetitions, inputs rotated so the L2 cache does
// not serve them), the measured HBM ceiling, and JSON lines.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <random>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "cuda/common/cuda_check.h"
#include "epx/tensor.h"

namespace epx::bench {

/// Median over `reps` of the mean time of `iters` back-to-back calls, in microseconds. fn(i) gets
/// the call index so it can rotate among input sets.
inline double time_us(const std::function<void(int)>& fn, int iters = 20, int reps = 7, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn(i);
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  EPX_CUDA_CHECK(cudaEventCreate(&a));
  EPX_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  int call = 0;
  for (int r = 0; r < reps; ++r) {
    EPX_CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) fn(call++);
    EPX_CUDA_CHECK(cudaEventRecord(b));
    EPX_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1e3 * ms / iters);
  }
  EPX_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Medians of several variants of one operation timed fairly on a GPU whose clock falls within tens
/// of milliseconds of sustained tensor-core load (an H200 under a large GEMM: ~15%): first ~0.3 s of
/// fns[0] to reach the sustained clock, then `rounds` rounds in which every variant runs `iters`
/// back-to-back calls, in a fresh random order each round, so no variant always follows an idle gap
/// or the same neighbour. Times in microseconds per call, in the order of fns.
inline std::vector<double> time_interleaved(const std::vector<std::function<void()>>& fns, int rounds = 7,
                                            int iters = 5) {
  std::vector<double> out(fns.size(), 0.0);
  if (fns.empty()) return out;
  cudaEvent_t a, b;
  EPX_CUDA_CHECK(cudaEventCreate(&a));
  EPX_CUDA_CHECK(cudaEventCreate(&b));
  auto calls_ms = [&](const std::function<void()>& fn, int calls) {  // `calls` back-to-back calls, in ms
    EPX_CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) fn();
    EPX_CUDA_CHECK(cudaEventRecord(b));
    EPX_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  };
  for (float warm_ms = 0; warm_ms < 300.0f;) warm_ms += std::max(calls_ms(fns[0], 10), 0.01f);
  std::vector<std::vector<double>> t(fns.size());
  std::vector<size_t> order(fns.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937 rng(12345);
  for (int r = 0; r < rounds; ++r) {
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t v : order) {
      fns[v]();  // one untimed call: the variant's own setup (cached arrays) out of the timing
      t[v].push_back(1e3 * calls_ms(fns[v], iters) / iters);
    }
  }
  EPX_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  for (size_t v = 0; v < fns.size(); ++v) {
    std::sort(t[v].begin(), t[v].end());
    out[v] = t[v][t[v].size() / 2];
  }
  return out;
}

/// Device-to-device copy bandwidth (bytes read + written per second), the HBM ceiling we report
/// fractions of.
inline double measure_hbm_bytes_per_s() {
  const size_t bytes = size_t(1) << 30;
  void *src = nullptr, *dst = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&src, bytes));
  EPX_CUDA_CHECK(cudaMalloc(&dst, bytes));
  EPX_CUDA_CHECK(cudaMemset(src, 1, bytes));
  const double us = time_us([&](int) { EPX_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 5, 5, 2);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * bytes / (us * 1e-6);
}

/// topk_idx [T, K] int32 on `device`: K distinct experts per token, uniform (partial Fisher-Yates).
inline Tensor random_expert_ids(int T, int E, int K, uint32_t seed, Device device) {
  std::mt19937 rng(seed);
  Tensor h = Tensor::empty({T, K}, DType::kI32);
  std::vector<int> perm(E);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    for (int k = 0; k < K; ++k) {
      std::uniform_int_distribution<int> d(k, E - 1);
      std::swap(perm[k], perm[d(rng)]);
      h.ptr<int32_t>()[t * K + k] = perm[k];
    }
  }
  return h.to(device);
}

/// One JSON object on one line, keys in insertion order.
class JsonLine {
 public:
  JsonLine& add(const std::string& k, const std::string& v) { return raw(k, "\"" + v + "\""); }
  JsonLine& add(const std::string& k, const char* v) { return add(k, std::string(v)); }
  JsonLine& add(const std::string& k, double v) {
    std::ostringstream os;
    os.precision(6);
    os << v;
    return raw(k, os.str());
  }
  JsonLine& add(const std::string& k, long long v) { return raw(k, std::to_string(v)); }
  JsonLine& add(const std::string& k, int v) { return raw(k, std::to_string(v)); }
  JsonLine& add(const std::string& k, bool v) { return raw(k, v ? "true" : "false"); }
  JsonLine& add(const std::string& k, const std::vector<double>& v) {
    std::ostringstream os;
    os.precision(6);
    os << '[';
    for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
    os << ']';
    return raw(k, os.str());
  }
  void print(FILE* out = stdout) const {
    std::fprintf(out, "{%s}\n", body_.c_str());
    std::fflush(out);
  }

 private:
  JsonLine& raw(const std::string& k, const std::string& v) {
    body_ += (body_.empty() ? "\"" : ",\"") + k + "\":" + v;
    return *this;
  }
  std::string body_;
};

/// How many rotating copies of an input of `bytes` keep the working set above twice the L2.
inline int rotation_for(size_t bytes) {
  int dev = 0, l2 = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
  const size_t want = 2 * static_cast<size_t>(l2);
  return static_cast<int>(std::max<size_t>(1, (want + bytes - 1) / bytes));
}

/// Device 0 as a single-GPU benchmark reports it.
struct BenchDevice {
  cudaDeviceProp prop{};
  double hbm = 0;  // the HBM copy rate measured at opening, bytes per second
};

/// Device 0 and its measured HBM rate; false, after printing {"bench": name, "skipped": ...}, where no
/// CUDA device is visible.
inline bool open_bench_device(const char* name, BenchDevice& d) {
  if (detail::cuda_device_count() == 0) {
    JsonLine().add("bench", name).add("skipped", "no CUDA device visible").print();
    return false;
  }
  EPX_CUDA_CHECK(cudaGetDeviceProperties(&d.prop, 0));
  d.hbm = measure_hbm_bytes_per_s();
  return true;
}

/// The first line of a benchmark's output: bench, device, sms and hbm_gbps; the caller adds its own
/// fields and prints it.
inline JsonLine device_line(const char* name, const BenchDevice& d) {
  JsonLine j;
  j.add("bench", name).add("device", d.prop.name).add("sms", d.prop.multiProcessorCount).add("hbm_gbps", d.hbm * 1e-9);
  return j;
}

}  // namespace epx::bench
