// A second stream beside the caller's, and the events that order work between the two: what lets
// the MoE layer run its collectives beside its expert GEMMs. Ordering is by CUDA events recorded on
// one stream and waited on by another, so it costs no host synchronisation and is captured into a
// CUDA graph like any other stream work. For a CPU device, or without the CUDA backend, the side
// stream is the null handle and ordering does nothing: host ops run in call order.
#pragma once

#include <vector>

#include "epx/tensor.h"

namespace epx::detail {

class SideStream {
 public:
  /// A non-blocking stream of the device's highest priority on `device` and `events` events, all
  /// made here (never later, where a CUDA graph capture may be under way); nothing for a CPU device.
  SideStream(Device device, int events);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  Stream stream() const { return Stream{stream_}; }
  /// Event `slot` marks the work queued on `stream` so far.
  void record(Stream stream, int slot);
  /// Work queued on `stream` from now on waits for what event `slot` marked at its last record.
  /// Record a slot again only after its wait is queued.
  void wait(Stream stream, int slot);

 private:
  void* event(const char* fn, int slot) const;

  Device device_;
  void* stream_ = nullptr;     // cudaStream_t
  std::vector<void*> events_;  // cudaEvent_t, without timing
};

}  // namespace epx::detail
