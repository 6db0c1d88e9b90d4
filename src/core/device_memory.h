// The only place the core touches the CUDA runtime. Without the CUDA backend every function here
// reports kNotSupported (or 0 devices), so the CPU build links and runs unchanged.
#pragma once

#include <cstddef>
#include <string>

#include "epx/tensor.h"

namespace epx::detail {

bool cuda_backend_built();
/// Visible CUDA devices; 0 without the backend, a driver or a GPU (never throws).
int cuda_device_count();
/// Multiprocessors of CUDA device `device`.
int device_sm_count(int device);
void* device_alloc(size_t bytes, int device);
void device_free(void* ptr, int device) noexcept;
/// Synchronous copy between host and/or device memory.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void memset_bytes(void* dst, Device device, int value, size_t bytes);
/// Stream-ordered copy of src into dst (equal byte counts; host memory is copied at once): for
/// framework bindings that hand out copies of epx-owned buffers without synchronising.
void copy_async(const TensorRef& src, const TensorRef& dst, Stream stream);
/// Waits for all work on the device (tools and benchmarks; never on a hot path).
void device_synchronize(int device);
/// Bytes in use on the device by every process and context (total - free): what a job sees.
size_t device_memory_used(int device);

/// Where a GPU op sequence spends its time, when EPX_PROFILE=1: phase_mark(stream, "name") records
/// an event on the stream ending the phase that began at the previous mark of that stream;
/// phase_report() synchronises, adds the phases up and returns them as one JSON object
/// ({"name": ms, ...}, summed over calls) and starts over. Without EPX_PROFILE both cost nothing
/// (no event, no synchronisation), so the marks stay in hot paths.
bool profiling_enabled();
void phase_mark(Stream stream, const char* name);
std::string phase_report();
/// Prefixes the names of the marks this thread records while it lives (e.g. "shared." for the
/// shared experts, whose FFN marks would otherwise add up with the routed experts').
class PhasePrefix {
 public:
  explicit PhasePrefix(const char* prefix);
  ~PhasePrefix();
  PhasePrefix(const PhasePrefix&) = delete;
  PhasePrefix& operator=(const PhasePrefix&) = delete;

 private:
  std::string saved_;
};

}  // namespace epx::detail
