// The only place the core touches the CUDA runtime. Without the CUDA backend every function here
// reports kNotSupported (or 0 devices), so the CPU build links and runs unchanged.
#pragma once

#include <cstddef>

#include "epx/tensor.h"

namespace epx::detail {

bool cuda_backend_built();
/// Visible CUDA devices; 0 without the backend, a driver or a GPU (never throws).
int cuda_device_count();
void* device_alloc(size_t bytes, int device);
void device_free(void* ptr, int device) noexcept;
/// Synchronous copy between host and/or device memory.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void memset_bytes(void* dst, Device device, int value, size_t bytes);
/// Waits for all work on the device (tools and benchmarks; never on a hot path).
void device_synchronize(int device);
/// Bytes in use on the device by every process and context (total - free): what a job sees.
size_t device_memory_used(int device);

}  // namespace epx::detail
