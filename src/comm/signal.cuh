// A barrier between the ranks of a group over their symmetric windows, with a timeout.
//
// Every rank owns an inbox of R uint32 words in its window; barrier number e (a device counter, so
// a replayed CUDA graph keeps counting) stores e into inbox[my rank] of every peer with release
// semantics at system scope, then waits until its own inbox holds >= e from every peer (acquire).
// Comparisons are wrap-safe. A wait that exceeds the timeout gives up, records which peers never
// arrived and at which operation in the group's status words, and marks the group broken so later
// barriers return at once: a missing rank becomes an error at Group::check(), never a hang.
#pragma once

#include <cstdint>

#include "comm/ep_kernels.h"

namespace epx::comm {

struct SignalArgs {
  uint32_t* const* peer_inbox;  // [R] device pointers to each rank's inbox (LSA pointers)
  uint32_t* my_inbox;           // [R] this rank's inbox
  uint32_t* epoch;              // device counter of barriers passed
  int32_t* status;              // [kStatusWords]
  int rank, R;
  uint64_t timeout_ns;
  int signal_mode = kSignalRelaxed;  // before-write barriers' signal (DeviceGroup::signal_mode)
};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A signal that carries no data (the overlapped launches' opening signal): no ordering with this
// thread's earlier accesses.
__device__ __forceinline__ void store_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/// Records in the group's status words that `peer` never arrived at operation op_code (wait number
/// `at`), which also marks the group broken: later waits return at once, check() names the peer.
__device__ __forceinline__ void record_missing_peer(int32_t* status, int peer, int op_code, uint32_t at) {
  atomicOr(reinterpret_cast<uint32_t*>(&status[peer < 32 ? 5 : 6]), 1u << (peer & 31));
  atomicCAS(reinterpret_cast<uint32_t*>(&status[7]), 0u, static_cast<uint32_t>(op_code));
  status[8] = static_cast<int32_t>(at);
}

/// Polls *word (acquire, system scope) until done(value) holds: true, or false once timeout_ns
/// have passed.
template <class Done>
__device__ __forceinline__ bool wait_for_word(const uint32_t* word, uint64_t timeout_ns, unsigned sleep_ns, Done done) {
  const uint64_t start = global_ns();
  while (!done(load_acquire_sys(word))) {
    if (global_ns() - start > timeout_ns) return false;
    __nanosleep(sleep_ns);
  }
  return true;
}

/// Waits until peer p has signalled barrier number `next` (wrap-safe); a wait that gives up records
/// p as missing at op_code.
__device__ __forceinline__ void wait_for_peer(const SignalArgs& a, int p, uint32_t next, int op_code) {
  auto arrived = [next](uint32_t v) { return static_cast<int32_t>(v - next) >= 0; };
  if (!wait_for_word(a.my_inbox + p, a.timeout_ns, 64, arrived)) record_missing_peer(a.status, p, op_code, next);
}

/// What a barrier follows (group_barrier):
///  - kBeforeWrite: an op's opening barrier, after which this rank writes into its peers' windows. It
///    only says that this rank's previous op has ended: the grid that read what peers had sent it
///    completed before this one began, so its reads have returned, and the signal carries no data.
///  - kAfterBlockWrites: this block's own writes into the peers' windows (prepare's headers). The
///    signalling threads' release stores, after the block barrier that follows those writes, order
///    them before the signal, as a grid-wide barrier orders a block's writes before its arrival.
///  - kAfterWrites: writes of earlier launches (the phased paths' delivery): every thread fences first.
enum class BarrierAfter { kBeforeWrite, kAfterBlockWrites, kAfterWrites };

/// Called by every thread of ONE block; returns when all peers arrived (or the wait gave up).
/// Unless signal_mode is kSignalFence (EPX_EP_SIGNAL=fence: a system fence before the signal and
/// after the wait, whatever the barrier follows), a before-write barrier signals as the overlapped
/// launches do (signal_mode: a relaxed store by default) and no barrier fences after its wait: the
/// waiting threads' acquire loads, then the block barrier, order this block's later accesses (and
/// the next launch follows this one's completion).
__device__ __forceinline__ void group_barrier(const SignalArgs& a, int op_code,
                                              BarrierAfter after = BarrierAfter::kAfterWrites) {
  __shared__ uint32_t next_s;
  if (threadIdx.x == 0) next_s = *a.epoch + 1;
  __syncthreads();
  const uint32_t next = next_s;
  const bool broken = a.status[7] != 0;
  const bool fence = a.signal_mode == kSignalFence;
  if (fence || after == BarrierAfter::kAfterWrites) __threadfence_system();
  const bool relaxed = !fence && after == BarrierAfter::kBeforeWrite && a.signal_mode == kSignalRelaxed;
  for (int p = threadIdx.x; p < a.R; p += blockDim.x) {
    if (p == a.rank) continue;
    if (relaxed) store_relaxed_sys(a.peer_inbox[p] + a.rank, next);
    else store_release_sys(a.peer_inbox[p] + a.rank, next);
  }
  if (!broken)
    for (int p = threadIdx.x; p < a.R; p += blockDim.x)
      if (p != a.rank) wait_for_peer(a, p, next, op_code);
  __syncthreads();
  if (threadIdx.x == 0) *a.epoch = next;
  if (fence) __threadfence_system();
  __syncthreads();
}

}  // namespace epx::comm
