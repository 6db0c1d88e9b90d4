// What the GPU-to-GPU link carries when the copy engine and SM stores move bytes at the same time, so
// that a transport splitting its rows between the two can be judged before it is built. GPU d sends
// --mib MiB from its memory to GPU (d + 1) % n (peer access; with --both-ways every GPU sends at once,
// as every rank does in the EP ops):
//  - "ce": one cudaMemcpyAsync of all the bytes;
//  - "sm": a copy kernel of 16-byte register loads and stores on `sms` CTAs of 512 threads;
//  - "ce+sm": the first `ce_fraction` of the bytes by the copy engine and the rest by the kernel, on
//    two streams at once.
// JSON lines: GB/s per direction (the slowest sender's), the best of 5 timings of 4 transfers each.
//
// usage: bench_link_mix [--mib N]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench/bench_util.h"
#include "core/device_memory.h"

using namespace epx;
using epx::bench::JsonLine;

namespace {

__global__ void __launch_bounds__(512) push_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  constexpr int kUnroll = 4;  // loads in flight per thread before its stores
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// One sender's buffers, streams and events.
struct Sender {
  char* src = nullptr;
  char* dst = nullptr;  // on the next GPU
  cudaStream_t sm = nullptr, ce = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr, fork = nullptr, ce_done = nullptr;
};

// GB/s per direction of `iters` transfers by `senders` GPUs at once: the first ce_fraction of each
// transfer's bytes by the copy engine, the rest by `sms` CTAs of push_kernel.
double transfer_gbps(std::vector<Sender>& ss, int senders, size_t bytes, double ce_fraction, int sms, int iters) {
  const size_t ce_bytes = static_cast<size_t>(static_cast<double>(bytes) * ce_fraction) / 4096 * 4096;
  const size_t sm_bytes = bytes - ce_bytes;
  for (int d = 0; d < senders; ++d) {
    EPX_CUDA_CHECK(cudaSetDevice(d));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
  }
  for (int d = 0; d < senders; ++d) {
    Sender& s = ss[d];
    EPX_CUDA_CHECK(cudaSetDevice(d));
    EPX_CUDA_CHECK(cudaEventRecord(s.begin, s.sm));
    EPX_CUDA_CHECK(cudaEventRecord(s.fork, s.sm));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(s.ce, s.fork, 0));
    for (int it = 0; it < iters; ++it) {
      if (ce_bytes > 0) EPX_CUDA_CHECK(cudaMemcpyAsync(s.dst, s.src, ce_bytes, cudaMemcpyDeviceToDevice, s.ce));
      if (sm_bytes > 0)
        push_kernel<<<sms, 512, 0, s.sm>>>(reinterpret_cast<const uint4*>(s.src + ce_bytes),
                                           reinterpret_cast<uint4*>(s.dst + ce_bytes), sm_bytes / 16);
    }
    EPX_CUDA_CHECK(cudaGetLastError());
    EPX_CUDA_CHECK(cudaEventRecord(s.ce_done, s.ce));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(s.sm, s.ce_done, 0));
    EPX_CUDA_CHECK(cudaEventRecord(s.end, s.sm));
  }
  float slowest_ms = 0.0f;
  for (int d = 0; d < senders; ++d) {
    EPX_CUDA_CHECK(cudaSetDevice(d));
    EPX_CUDA_CHECK(cudaEventSynchronize(ss[d].end));
    float ms = 0.0f;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, ss[d].begin, ss[d].end));
    slowest_ms = std::max(slowest_ms, ms);
  }
  return static_cast<double>(bytes) * iters / (slowest_ms * 1e-3) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  long mib = 256;
  for (int i = 1; i + 1 < argc; i += 2)
    if (!std::strcmp(argv[i], "--mib")) mib = std::atol(argv[i + 1]);
  if (mib <= 0) {
    std::fprintf(stderr, "bench_link_mix: --mib is %ld (expected > 0)\n", mib);
    return 2;
  }
  try {
    const int n = detail::cuda_device_count();
    if (n < 2) {
      JsonLine().add("bench", "link_mix").add("skipped", "needs 2 CUDA devices, " + std::to_string(n) + " visible")
          .print();
      return 0;
    }
    const size_t bytes = static_cast<size_t>(mib) << 20;
    std::vector<Sender> ss(n);
    for (int d = 0; d < n; ++d) {
      EPX_CUDA_CHECK(cudaSetDevice(d));
      int can = 0;
      EPX_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, d, (d + 1) % n));
      if (!can) {
        JsonLine().add("bench", "link_mix").add("skipped", "GPU " + std::to_string(d) + " cannot reach its peer")
            .print();
        return 0;
      }
      const cudaError_t e = cudaDeviceEnablePeerAccess((d + 1) % n, 0);
      if (e != cudaErrorPeerAccessAlreadyEnabled) EPX_CUDA_CHECK(e);
      Sender& s = ss[d];
      EPX_CUDA_CHECK(cudaMalloc(&s.src, bytes));
      EPX_CUDA_CHECK(cudaMemset(s.src, d + 1, bytes));
      EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s.sm, cudaStreamNonBlocking));
      EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s.ce, cudaStreamNonBlocking));
      EPX_CUDA_CHECK(cudaEventCreate(&s.begin));
      EPX_CUDA_CHECK(cudaEventCreate(&s.end));
      EPX_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
      EPX_CUDA_CHECK(cudaEventCreateWithFlags(&s.ce_done, cudaEventDisableTiming));
    }
    for (int d = 0; d < n; ++d) {  // d's receive buffer, written by d - 1
      EPX_CUDA_CHECK(cudaSetDevice(d));
      EPX_CUDA_CHECK(cudaMalloc(&ss[(d + n - 1) % n].dst, bytes));
    }
    cudaDeviceProp prop{};
    EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    JsonLine().add("bench", "link_mix").add("device", prop.name).add("gpus", n).add("mib", static_cast<long long>(mib))
        .print();
    auto best = [&](int senders, double ce_fraction, int sms) {
      transfer_gbps(ss, senders, bytes, ce_fraction, sms, 2);  // warm-up
      double b = 0.0;
      for (int r = 0; r < 5; ++r) b = std::max(b, transfer_gbps(ss, senders, bytes, ce_fraction, sms, 4));
      return b;
    };
    auto line = [&](const char* mode, bool both, int sms, double ce_fraction, double gbps) {
      JsonLine j;
      j.add("bench", "link_mix").add("mode", mode).add("both_ways", both);
      if (sms > 0) j.add("sms", sms);
      if (sms > 0 && ce_fraction > 0) j.add("ce_fraction", ce_fraction);
      j.add("gbps", gbps).print();
    };
    for (bool both : {false, true}) {
      const int senders = both ? n : 1;
      line("ce", both, 0, 1.0, best(senders, 1.0, 0));
      for (int sms : {16, 32, 64, prop.multiProcessorCount}) line("sm", both, sms, 0.0, best(senders, 0.0, sms));
      for (int sms : {16, 32, 64})
        for (double a : {0.4, 0.5, 0.6, 0.7}) line("ce+sm", both, sms, a, best(senders, a, sms));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_link_mix: %s\n", e.what());
    return 1;
  }
  return 0;
}
