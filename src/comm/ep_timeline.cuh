// Device side of ep_timeline.h: each .cu that stamps a launch defines its own buffer with
// EPX_TIMELINE_BUFFER() and stamps with EPX_STAMP(phase); both are empty unless EPX_EP_TIMELINE.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "comm/ep_timeline.h"
#include "cuda/common/cuda_check.h"

namespace epx::comm {
constexpr int kTimelineMaxBlocks = 2048;
}  // namespace epx::comm

#ifdef EPX_EP_TIMELINE
namespace epx::comm {
// Host side, instantiated in the .cu that owns the buffer (device symbols are per translation unit).
template <class Stamps, class Count>
void clear_timeline(const Stamps& stamps, const Count& blocks) {
  const int zero = 0;
  EPX_CUDA_CHECK(cudaMemcpyToSymbol(blocks, &zero, sizeof zero));
  std::vector<unsigned long long> z(sizeof(Stamps) / sizeof(unsigned long long), 0ull);
  EPX_CUDA_CHECK(cudaMemcpyToSymbol(stamps, z.data(), sizeof(Stamps)));
}
template <class Stamps, class Count>
bool read_timeline(const Stamps& stamps, const Count& blocks, const Count& writers, EpTimeline& out) {
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  int b = 0, w = 0;
  EPX_CUDA_CHECK(cudaMemcpyFromSymbol(&b, blocks, sizeof b));
  EPX_CUDA_CHECK(cudaMemcpyFromSymbol(&w, writers, sizeof w));
  if (b <= 0) return false;
  out.blocks = b < kTimelineMaxBlocks ? b : kTimelineMaxBlocks;
  out.writer_blocks = w;
  out.stamps.assign(static_cast<size_t>(out.blocks) * kTlPhases, 0);
  EPX_CUDA_CHECK(cudaMemcpyFromSymbol(out.stamps.data(), stamps, out.stamps.size() * sizeof(uint64_t)));
  return true;
}
}  // namespace epx::comm

#define EPX_TIMELINE_BUFFER()                                                                 \
  __device__ unsigned long long tl_stamps[::epx::comm::kTimelineMaxBlocks * ::epx::comm::kTlPhases]; \
  __device__ int tl_blocks;                                                                   \
  __device__ int tl_writer_blocks;
#define EPX_STAMP(phase)                                                                       \
  do {                                                                                         \
    if (threadIdx.x == 0 && blockIdx.x < ::epx::comm::kTimelineMaxBlocks) {                    \
      unsigned long long t_;                                                                   \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                   \
      tl_stamps[blockIdx.x * ::epx::comm::kTlPhases + (phase)] = t_;                           \
    }                                                                                          \
  } while (0)
#define EPX_STAMP_GRID(writers)                                   \
  do {                                                            \
    if (blockIdx.x == 0 && threadIdx.x == 0) {                    \
      tl_blocks = static_cast<int>(gridDim.x);                    \
      tl_writer_blocks = (writers);                               \
    }                                                             \
  } while (0)
#else
#define EPX_TIMELINE_BUFFER()
#define EPX_STAMP(phase) \
  do {                   \
  } while (0)
#define EPX_STAMP_GRID(writers) \
  do {                          \
  } while (0)
#endif
