// Single 64-bit global accesses at GPU scope, for words that several blocks of a grid read and write
// while it runs (flags, published leaves): morally strong under the PTX memory model, so a reader that
// polls sees a writer's store without a data race, and never served from a stale L1 line.
#pragma once

namespace epx::cuda {

__device__ __forceinline__ unsigned long long load_relaxed_gpu(const unsigned long long* a) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed_gpu(unsigned long long* a, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
// Also orders this thread's earlier writes (and, after a CTA barrier, the block's) before the store.
__device__ __forceinline__ void store_release_gpu(unsigned long long* a, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}

}  // namespace epx::cuda
