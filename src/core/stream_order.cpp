#include "core/stream_order.h"

#include "epx/error.h"

#ifdef EPX_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace epx::detail {

void* SideStream::event(const char* fn, int slot) const {
  require(slot >= 0 && slot < static_cast<int>(events_.size()), fn, "event slot ", slot, " of a side stream with ",
          events_.size(), " events");
  return events_[slot];
}

#ifdef EPX_HAVE_CUDA

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(Status::kCudaError, concat("epx::SideStream: ", what, " failed: ", cudaGetErrorString(e)));
}

// Streams and events belong to the device current at their creation.
struct CurrentDevice {
  int previous = -1;
  explicit CurrentDevice(int device) {
    check(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~CurrentDevice() {
    if (previous >= 0) cudaSetDevice(previous);
  }
};
}  // namespace

SideStream::SideStream(Device device, int events) : device_(device) {
  if (device.is_cpu()) return;
  CurrentDevice d(device.index);
  // The highest priority: the block scheduler then starts this stream's blocks (short, latency-bound
  // communication kernels) before queued blocks of the caller's (long GEMMs) as SMs free up.
  int least = 0, greatest = 0;
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest), "cudaStreamCreateWithPriority");
  stream_ = s;
  for (int i = 0; i < events; ++i) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    events_.push_back(e);
  }
}

SideStream::~SideStream() {
  if (device_.is_cpu()) return;
  CurrentDevice d(device_.index);
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void SideStream::record(Stream stream, int slot) {
  if (device_.is_cpu()) return;
  check(cudaEventRecord(static_cast<cudaEvent_t>(event("epx::SideStream::record", slot)),
                        static_cast<cudaStream_t>(stream.handle)),
        "cudaEventRecord");
}

void SideStream::wait(Stream stream, int slot) {
  if (device_.is_cpu()) return;
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.handle),
                            static_cast<cudaEvent_t>(event("epx::SideStream::wait", slot)), 0),
        "cudaStreamWaitEvent");
}

#else  // CPU-only build: every device is the host

SideStream::SideStream(Device device, int) : device_(device) {
  require(device.is_cpu(), "epx::SideStream", "a side stream on ", device.str(),
          " needs the CUDA backend, which this build lacks");
}
SideStream::~SideStream() = default;
void SideStream::record(Stream, int) {}
void SideStream::wait(Stream, int) {}

#endif

}  // namespace epx::detail
